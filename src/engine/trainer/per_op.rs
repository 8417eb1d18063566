//! The per-op executor: the candle model's forward and autograd backward.

use super::Trainer;
use crate::engine::data::loader::Batch;
use crate::engine::device;
use candle_core::Tensor;
use std::time::{Duration, Instant};

impl Trainer {
    /// [`Self::forward_backward`] on the per-op path: the candle model's forward and autograd
    /// backward, one micro-batch at a time, gradients summed per tensor.
    pub(super) fn forward_backward_per_op(
        &mut self,
        lambda: f64,
    ) -> candle_core::Result<(f64, f64, Vec<Tensor>, Duration, Duration)> {
        let mut wait = Duration::ZERO;
        let t0 = Instant::now();
        let mut grads: Vec<Option<Tensor>> = vec![None; self.opt.slots.len()];
        let mut ce_sum = 0.0;
        let mut sumsq_val = 0.0;
        let scale = self.scaler.scale;
        let coef = self.penalty_coef();
        let inject_nan = self.take_nan_fault();
        for a in 0..self.accum {
            // Dropout masks depend only on (seed, step, micro-batch): a resumed run draws the same.
            let seed = crate::engine::dropout::micro_seed(self.cfg.run.seed, self.step, a);
            self.model.reseed_dropout(seed);
            let (batch, w) = self.next_batch()?;
            wait += w;
            let ce = self.batch_loss(&batch)?;
            ce_sum += ce.to_scalar::<f32>()? as f64;
            let ce = if inject_nan { (ce * f64::NAN)? } else { ce };
            let mut loss = (ce / self.accum as f64)?;
            if a == 0 {
                if let Some(ss) = self.reg_sumsq()? {
                    sumsq_val = ss.to_scalar::<f32>()? as f64;
                    // λ·Σw²/(2σ²)/N: in the same per-token units as CE, and differentiable.
                    // At λ = 0 it adds nothing: keep it out of the graph (no backward pass).
                    if lambda != 0.0 {
                        loss = (loss + (ss * (lambda * coef))?)?;
                    }
                }
            }
            if scale != 1.0 {
                loss = (loss * scale)?;
            }
            let store = loss.backward()?;
            if a + 1 == self.accum {
                self.step_memory = device::memory_in_use(&self.device);
            }
            for (g, slot) in grads.iter_mut().zip(&self.opt.slots) {
                if let Some(new) = store.get(slot.var.as_tensor()) {
                    // A leaf's gradient keeps its op graph (and so every activation of this
                    // micro-batch) alive; the gradient itself is all the step needs.
                    let new = new.detach();
                    *g = Some(match g.take() {
                        Some(acc) => (acc + new)?,
                        None => new,
                    });
                }
            }
        }
        let grads = grads
            .into_iter()
            .zip(&self.opt.slots)
            .map(|(g, s)| match g {
                Some(g) if scale != 1.0 => g / scale,
                Some(g) => Ok(g),
                None => s.var.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.device.synchronize()?;
        let compute = t0.elapsed().saturating_sub(wait);
        Ok((ce_sum / self.accum as f64, sumsq_val, grads, wait, compute))
    }

    /// Σw² over the regularized weights, as a differentiable f32 scalar.
    pub(super) fn reg_sumsq(&self) -> candle_core::Result<Option<Tensor>> {
        let mut acc: Option<Tensor> = None;
        for &i in &self.reg_slots {
            let s = crate::engine::kernels::sum_sq(self.opt.slots[i].var.as_tensor())?;
            acc = Some(match acc {
                Some(a) => (a + s)?,
                None => s,
            });
        }
        Ok(acc)
    }

    /// A micro-batch's mean CE: over every target of a token stream, or (instruction/chat
    /// rows) over the targets that train, with attention kept within each packed sample.
    pub(super) fn batch_loss(&mut self, b: &Batch) -> candle_core::Result<Tensor> {
        use crate::engine::data::packing::IGNORE;
        if b.segments.is_none() {
            let (x, y) = self.batch_tensors(b)?;
            return self.model.loss(&x, &y, true);
        }
        let shape = (b.batch, b.seq_len);
        let x = Tensor::from_slice(&b.inputs, shape, &self.device)?;
        let m = crate::engine::model::Masked::new(&b.targets, IGNORE, shape, &self.device)?;
        self.trained_slots.0 += m.count as u64;
        self.trained_slots.1 += b.targets.len() as u64;
        self.model.set_segments(b.segments.as_deref(), b.batch)?;
        let ce = self.model.masked_loss(&x, &m, true);
        self.model.set_segments(None, b.batch)?;
        ce
    }

    pub(super) fn batch_tensors(&self, b: &Batch) -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (b.batch, b.seq_len);
        Ok((
            Tensor::from_slice(&b.inputs, shape, &self.device)?,
            Tensor::from_slice(&b.targets, shape, &self.device)?,
        ))
    }
}
