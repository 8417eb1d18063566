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
        let Some((prompt, tok, stop)) = &self.sample else {
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
            stop,
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

/// `eval.sample_prompts` as ids, the tokenizer that shows the text and the tokens that end a
/// reply.
pub(super) type SampleSet = (Vec<Vec<u32>>, Option<crate::engine::data::Tok>, Vec<u32>);

/// The tokens an eval sample stops at: the tokenizer's end of text and, for chat data, the
/// template's end of turn.
pub(super) fn stop_ids(
    tok: Option<&crate::engine::data::Tok>,
    template: Option<&crate::engine::data::template::ChatTemplate>,
) -> Vec<u32> {
    let mut stop: Vec<u32> = tok.and_then(|t| t.eos_id()).into_iter().collect();
    if let (Some(t), Some(tm)) = (tok, template) {
        stop.extend(tm.eos_id(t).filter(|e| !stop.contains(e)));
    }
    stop
}

/// `eval.sample_prompts` as ids (through the data's tokenizer — for chat data each a user turn
/// through the chat `template`; token ids written out for the built-in corpus), each within the
/// training context, the tokenizer that shows the text and the tokens that end a reply.
pub(super) fn sample_set(
    cfg: &crate::config::Config,
    vocab: usize,
    template: Option<&crate::engine::data::template::ChatTemplate>,
) -> Result<Option<SampleSet>, crate::engine::EngineError> {
    use crate::engine::EngineError;
    if cfg.eval.samples_per_prompt == 0 {
        return Ok(None);
    }
    let tok = if cfg.data.source == "files" {
        Some(crate::engine::data::Tok::open(&cfg.data.tokenizer)?)
    } else {
        None
    };
    let mut prompts = Vec::with_capacity(cfg.eval.sample_prompts.len());
    for (i, p) in cfg.eval.sample_prompts.iter().enumerate() {
        let at = format!("eval.sample_prompts[{i}]");
        let ids = match (&tok, template) {
            (Some(t), Some(tm)) => {
                let turn = [serde_json::json!({"role": "user", "content": p})];
                let text = tm.render(&turn, true).map_err(|e| {
                    EngineError::Config(format!(
                        "{at} = {p:?}: the chat template fails to render: {e}"
                    ))
                })?;
                t.encode_offsets(&text, &at)?.0
            }
            (Some(t), None) => t.encode_prompt(p)?,
            (None, _) => p
                .split(|c: char| c.is_whitespace() || c == ',')
                .filter(|w| !w.is_empty())
                .map(|w| w.parse::<u32>())
                .collect::<Result<Vec<u32>, _>>()
                .map_err(|_| {
                    EngineError::Config(format!(
                        "eval.sample_prompts[{i}] = {p:?}: the built-in corpus has no tokenizer; give token ids (\"1 2 3\")"
                    ))
                })?,
        };
        if ids.is_empty() || ids.len() >= cfg.model.seq_len {
            return Err(EngineError::Config(format!(
                "eval.sample_prompts[{i}] = {p:?}: {} tokens; it must have 1 to model.seq_len - 1 ({})",
                ids.len(),
                cfg.model.seq_len - 1
            )));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Config(format!(
                "eval.sample_prompts[{i}] = {p:?}: token {bad} is outside the vocabulary ({vocab})"
            )));
        }
        prompts.push(ids);
    }
    let stop = stop_ids(tok.as_ref(), template);
    Ok(Some((prompts, tok, stop)))
}

impl Trainer {
    /// `eval.samples_per_prompt`: that many sampled continuations of each of
    /// `eval.sample_prompts`, all decoded together on the live weights (no copy of the
    /// model), and their diversity.
    pub(super) fn sample_diversity(&self) -> candle_core::Result<Option<Event>> {
        use crate::engine::generate::{diversity, generate_rows, Rows, Sampling};
        let Some((prompts, tok, stop)) = &self.sample_set else {
            return Ok(None);
        };
        let n = self.cfg.eval.samples_per_prompt;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let max_new = self
            .cfg
            .eval
            .sample_tokens
            .min(self.model.spec.seq_len.saturating_sub(longest));
        let rows: Vec<Vec<u32>> = prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), n))
            .collect();
        let sampling = Sampling {
            temperature: 1.0,
            seed: self.cfg.run.seed ^ self.step,
            ..Sampling::greedy()
        };
        let g = generate_rows(
            &self.model,
            &Rows {
                prompts: &rows,
                max_new,
                sampling: &sampling,
                seed: sampling.seed,
                stop,
                embed: n >= 2,
            },
            |_| {},
        )?;
        let cosine = match &g.embeddings {
            Some(e) => {
                let d = e.dim(1)?;
                diversity::pairwise_cosine_distance(&e.reshape((prompts.len(), n, d))?)?
            }
            None => vec![None; prompts.len()],
        };
        let per_prompt: Vec<diversity::Diversity> = g
            .rows
            .chunks(n)
            .zip(&cosine)
            .map(|(rows, c)| {
                let ids: Vec<&[u32]> = rows.iter().map(|r| r.ids.as_slice()).collect();
                diversity::of_samples(&ids, *c)
            })
            .collect();
        let mean = diversity::mean(&per_prompt);
        let new_tokens: usize = g.rows.iter().map(|r| r.ids.len()).sum();
        let example = g.rows.first().map(|r| r.ids.as_slice()).unwrap_or(&[]);
        let example = match tok {
            Some(t) => t.decode(example),
            None => example
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" "),
        };
        Ok(Some(Event::SampleDiversity {
            step: self.step,
            prompts: prompts.len(),
            samples_per_prompt: n,
            new_tokens,
            tokens_per_s: new_tokens as f64 / g.elapsed.as_secs_f64().max(1e-9),
            distinct_1: mean.distinct_1,
            distinct_2: mean.distinct_2,
            distinct_3: mean.distinct_3,
            cosine_distance: mean.cosine_distance,
            example,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::data::template::ChatTemplate;

    /// Chat data: `eval.sample_prompts` go through the chat template as user turns (the reply's
    /// header last); plain data: the prompt's own ids.
    #[test]
    fn chat_sample_prompts_are_user_turns_through_the_template() {
        let p = format!(
            "{}/tests/fixtures/chat/qwen.jinja",
            env!("CARGO_MANIFEST_DIR")
        );
        let tm = ChatTemplate::new(&std::fs::read_to_string(&p).unwrap(), p, Default::default())
            .unwrap();
        let mut cfg = crate::config::Config::default();
        cfg.data.source = "files".into();
        cfg.data.tokenizer = "byte".into();
        cfg.model.seq_len = 256;
        cfg.eval.samples_per_prompt = 2;
        cfg.eval.sample_prompts = vec!["hi".into()];
        let text = |ids: &[u32]| String::from_utf8(ids.iter().map(|&b| b as u8).collect()).unwrap();
        let (prompts, _, _) = sample_set(&cfg, 256, Some(&tm)).unwrap().unwrap();
        let want = tm
            .render(
                &[serde_json::json!({"role": "user", "content": "hi"})],
                true,
            )
            .unwrap();
        assert_eq!(text(&prompts[0]), want);
        assert!(
            want.contains("user\nhi") && want.ends_with("assistant\n"),
            "{want}"
        );
        let (plain, _, _) = sample_set(&cfg, 256, None).unwrap().unwrap();
        assert_eq!(text(&plain[0]), "hi");
    }
}
