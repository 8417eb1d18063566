//! Held-out evaluation and the greedy sample shown at eval time.

use super::{Trainer, LN2};
use crate::engine::data::loader::{mean_se, Batch};
use crate::engine::events::{EvalStats, Event};

impl Trainer {
    /// Each window's mean loss in one held-out batch: on the whole-model step when the run
    /// has one and the batch is a full micro-batch (its forward alone), else the candle
    /// model's.
    pub(super) fn eval_windows(&mut self, b: &Batch) -> candle_core::Result<Vec<f64>> {
        self.try_whole_step()?;
        if let Some(whole) = self
            .whole_step
            .as_mut()
            .filter(|_| b.batch == self.micro_batch)
        {
            let current = self.weights_copied || self.parallel.masters_partial();
            let rows = crate::engine::kernels::Rows {
                inputs: &b.inputs,
                targets: &b.targets,
                segments: b.segments.as_deref().filter(|_| self.cfg.data.packing),
                b: b.batch,
            };
            let losses = whole.eval_losses(&rows, current)?;
            // The bf16 copies are current now, until the next optimizer step.
            self.weights_copied = true;
            return Ok(losses);
        }
        if b.segments.is_some() {
            return self.masked_eval_windows(b);
        }
        let (x, y) = self.batch_tensors(b)?;
        let losses = self.model.token_losses(&x, &y)?;
        let rows = losses.reshape((b.batch, b.seq_len))?.mean(1)?;
        Ok(rows.to_vec1::<f32>()?.into_iter().map(f64::from).collect())
    }

    /// Instruction/chat rows: each row's mean loss over its targets that train (rows with none
    /// are left out), attention within each packed sample.
    fn masked_eval_windows(&mut self, b: &Batch) -> candle_core::Result<Vec<f64>> {
        use crate::engine::data::packing::IGNORE;
        let shape = (b.batch, b.seq_len);
        let x = candle_core::Tensor::from_slice(&b.inputs, shape, &self.device)?;
        let m = crate::engine::model::Masked::new(&b.targets, IGNORE, shape, &self.device)?;
        self.model.set_segments(b.segments.as_deref(), b.batch)?;
        let losses = self.model.token_losses(&x, &m.targets);
        self.model.set_segments(None, b.batch)?;
        let losses = losses?.to_vec1::<f32>()?;
        Ok(losses
            .chunks(b.seq_len)
            .zip(b.targets.chunks(b.seq_len))
            .filter_map(|(l, y)| {
                let n = y.iter().filter(|&&v| v != IGNORE).count();
                let sum: f64 = l
                    .iter()
                    .zip(y)
                    .filter(|(_, &v)| v != IGNORE)
                    .map(|(&l, _)| f64::from(l))
                    .sum();
                (n > 0).then(|| sum / n as f64)
            })
            .collect())
    }

    /// The mean loss of the eval's windows and its standard error (over windows).
    pub(super) fn evaluate(&mut self) -> candle_core::Result<EvalStats> {
        let mut per_window = Vec::with_capacity(self.val.windows());
        let plan = self.val.clone();
        for b in plan.batches(self.micro_batch) {
            let b = Self::keep_fault(&mut self.data_fault, b)?;
            per_window.extend(self.eval_windows(&b)?);
        }
        let (val_loss, se) = mean_se(&per_window);
        Ok(EvalStats {
            step: self.step,
            val_loss,
            val_bpt: val_loss / LN2,
            val_ppl: val_loss.exp(),
            val_loss_se: se,
            val_bpt_se: se / LN2,
            val_tokens: plan.tokens_scored(),
        })
    }

    /// `eval.sample_tokens`: the model's greedy continuation of the fixed prompt, within the
    /// training context.
    pub(super) fn sample_text(&self) -> candle_core::Result<Option<Event>> {
        let Some((prompt, tok)) = &self.sample else {
            return Ok(None);
        };
        let n = self
            .cfg
            .eval
            .sample_tokens
            .min(self.model.spec.seq_len - prompt.len());
        let ids = crate::engine::generate::generate(
            &self.model,
            prompt,
            n,
            &crate::engine::generate::Sampling::greedy(),
            &[],
            |_| {},
        )?;
        let show = |ids: &[u32]| match tok {
            Some(t) => t.decode(ids),
            None => ids
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        };
        Ok(Some(Event::Sample {
            step: self.step,
            prompt: show(prompt),
            text: show(&ids),
        }))
    }
}
