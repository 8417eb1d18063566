//! Text generation: batches of sequences decoded together over a cache allocated once
//! ([`batch`]), the next tokens chosen on the device ([`sampling`]), several samples per
//! prompt and their diversity ([`diversity`]), prompts read from a file ([`prompts`]), text
//! streamed as tokens come ([`stream`]), a conversation ([`chat`]) through the
//! model's chat template ([`template`]).

pub mod batch;
pub mod chat;
pub mod diversity;
pub mod prompts;
pub mod run;
pub mod sampling;
pub mod stream;
pub mod template;

use super::model::Model;
use candle_core::Result;

pub use batch::{
    generate_rows, generate_rows_with, BatchOptions, Generation, RowOut, Rows, StopReason,
};

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (the most likely token); otherwise logits ÷ temperature.
    pub temperature: f64,
    /// Keep the k most likely tokens; 0 = all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 = all.
    pub top_p: f64,
    /// Logits of the tokens already in the row (prompt or output) divided by this when
    /// positive, multiplied when negative (transformers' repetition_penalty); 1 = off.
    pub repetition_penalty: f64,
    pub seed: u64,
}

impl Sampling {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }

    /// What is wrong with these options (named as `cockpit generate`'s flags, with the
    /// value), if anything.
    pub fn problem(&self) -> Option<String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Some(format!("--temperature {}: must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Some(format!("--top-p {}: must be in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Some(format!(
                "--repetition-penalty {}: must be > 0 (1 = off)",
                self.repetition_penalty
            ));
        }
        None
    }
}

/// Continue `prompt` by up to `max_new` tokens, stopping after a token of `stop`; `on_token`
/// sees each new token as it is chosen. Returns the new tokens. (A batch of one row of
/// [`generate_rows`].)
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    let rows = [prompt.to_vec()];
    let req = Rows {
        prompts: &rows,
        max_new,
        sampling,
        seed: sampling.seed,
        stop,
        embed: false,
    };
    let out = generate_rows(model, &req, |step| {
        if let Some(Some(t)) = step.first() {
            on_token(*t);
        }
    })?;
    Ok(out
        .rows
        .into_iter()
        .next()
        .map(|r| r.ids)
        .unwrap_or_default())
}
