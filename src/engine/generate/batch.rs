//! One batch of rows decoded together: the prompts left-padded into one prefill, then one
//! decode step a token for every row, over a [`BatchCache`] allocated once for prompt + new
//! tokens (GPU memory does not grow with the steps). The host sees the sampled ids of each
//! step and nothing else.

use super::sampling::Sampler;
use super::Sampling;
use crate::engine::model::Model;
use candle_core::{DType, Result, Tensor};
use std::time::{Duration, Instant};

/// What to generate: a batch of rows (prompts; a prompt sampled N times is N rows).
pub struct Rows<'a> {
    pub prompts: &'a [Vec<u32>],
    /// New tokens at most, per row.
    pub max_new: usize,
    pub sampling: &'a Sampling,
    /// The draws' seed (the batch's: rows draw from one stream).
    pub seed: u64,
    /// A row stops after one of these tokens.
    pub stop: &'a [u32],
    /// Also pool each row's final hidden states over its new tokens (the embeddings of
    /// [`super::diversity`]); costs one more step.
    pub embed: bool,
}

/// Why a row stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// It produced a stop token (the last of its ids).
    Eos,
    /// It reached the most new tokens.
    Length,
}

/// One row's new tokens.
#[derive(Clone, Debug)]
pub struct RowOut {
    pub ids: Vec<u32>,
    pub stop: StopReason,
}

/// What a batch produced.
pub struct Generation {
    pub rows: Vec<RowOut>,
    /// `[B, n_embd]` (f32, on the model's device): each row's final hidden states averaged
    /// over its new tokens (with [`Rows::embed`]).
    pub embeddings: Option<Tensor>,
    /// From the start to the first tokens chosen (prefill and one draw).
    pub first_token: Duration,
    pub elapsed: Duration,
    /// The prefill's share of `elapsed` (prompts in, the first logits out; with
    /// [`BatchOptions::time_sampling`] the device's time, otherwise the host's launches).
    pub prefill: Duration,
    /// The draws' share of `elapsed` (with [`BatchOptions::time_sampling`]; zero otherwise).
    pub sampling: Duration,
    /// Whether the decode steps were replayed from a CUDA graph.
    pub graphed: bool,
}

/// How [`generate_rows_with`] runs a batch (the results do not depend on it).
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// Prefill each distinct prompt once and copy its cache rows to the rows that repeat it
    /// (a prompt sampled N times: one prefill, not N).
    pub share_prefill: bool,
    /// Wait for the device before and after each draw, to measure [`Generation::sampling`]
    /// (a synchronisation a step).
    pub time_sampling: bool,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            share_prefill: true,
            time_sampling: false,
        }
    }
}

/// For each row, the number of its prompt among the distinct ones (in order of first
/// appearance), and the row where each distinct prompt first appears.
fn distinct(prompts: &[Vec<u32>]) -> (Vec<usize>, Vec<usize>) {
    let mut seen: std::collections::HashMap<&[u32], usize> = Default::default();
    let mut row_of = Vec::new();
    let first = prompts
        .iter()
        .enumerate()
        .map(|(r, p)| {
            *seen.entry(p.as_slice()).or_insert_with(|| {
                row_of.push(r);
                row_of.len() - 1
            })
        })
        .collect();
    (first, row_of)
}

/// Decode `req`'s rows together; `on_step` sees each step's tokens (None for a row that has
/// stopped).
pub fn generate_rows(
    model: &Model,
    req: &Rows,
    on_step: impl FnMut(&[Option<u32>]),
) -> Result<Generation> {
    generate_rows_with(model, req, BatchOptions::default(), on_step)
}

/// [`generate_rows`] run as `opts` says.
pub fn generate_rows_with(
    model: &Model,
    req: &Rows,
    opts: BatchOptions,
    mut on_step: impl FnMut(&[Option<u32>]),
) -> Result<Generation> {
    let start = Instant::now();
    let b = req.prompts.len();
    let mut rows: Vec<RowOut> = (0..b)
        .map(|_| RowOut {
            ids: Vec::with_capacity(req.max_new),
            stop: StopReason::Length,
        })
        .collect();
    if b == 0 || req.max_new == 0 {
        return Ok(Generation {
            rows,
            embeddings: None,
            first_token: start.elapsed(),
            elapsed: start.elapsed(),
            prefill: Duration::ZERO,
            sampling: Duration::ZERO,
            graphed: false,
        });
    }
    if req.prompts.iter().any(|p| p.is_empty()) {
        candle_core::bail!("a prompt has no tokens");
    }
    let dev = model.device();
    let width = req.prompts.iter().map(Vec::len).max().unwrap_or(1);
    let pads: Vec<usize> = req.prompts.iter().map(|p| width - p.len()).collect();
    // Padding repeats the row's first token: a token of the row (the repetition penalty
    // counts what the row holds), never attended to.
    let mut flat = Vec::with_capacity(b * width);
    for (p, &pad) in req.prompts.iter().zip(&pads) {
        flat.extend(std::iter::repeat_n(p[0], pad));
        flat.extend_from_slice(p);
    }
    let ids = Tensor::from_vec(flat, (b, width), dev)?;
    let mut sampler = Sampler::new(&ids, model.spec.vocab_size, req.sampling, req.seed)?;
    let stop = match req.stop {
        [] => None,
        s => Some(
            Tensor::new(s, dev)?
                .to_dtype(DType::F32)?
                .reshape((1, s.len()))?,
        ),
    };
    // 1 while a row's tokens are its output (until after its stop token).
    let mut alive = Tensor::ones((b, 1), DType::F32, dev)?;
    let mut pooled = match req.embed {
        true => Some(Tensor::zeros((b, model.spec.n_embd), DType::F32, dev)?),
        false => None,
    };
    let no_logits = || candle_core::Error::Msg("decode_batch gave no logits".into());
    let (first, row_of) = distinct(req.prompts);
    let (mut cache, mut logits) = if opts.share_prefill && row_of.len() < b {
        // Each distinct prompt once: its rows of the prefill's cache and logits copied to
        // every row that repeats it.
        let idx = Tensor::from_vec(
            row_of.iter().map(|&r| r as u32).collect(),
            row_of.len(),
            dev,
        )?;
        let upads: Vec<usize> = row_of.iter().map(|&r| pads[r]).collect();
        let mut ucache = model.batch_cache(&upads, width + req.max_new)?;
        let ulogits = model
            .decode_batch(&ids.index_select(&idx, 0)?, &mut ucache, true)?
            .logits
            .ok_or_else(no_logits)?;
        let map = Tensor::from_vec(first.iter().map(|&u| u as u32).collect(), b, dev)?;
        (ucache.rows(&first)?, ulogits.index_select(&map, 0)?)
    } else {
        let mut cache = model.batch_cache(&pads, width + req.max_new)?;
        let logits = model
            .decode_batch(&ids, &mut cache, true)?
            .logits
            .ok_or_else(no_logits)?;
        (cache, logits)
    };
    if opts.time_sampling {
        dev.synchronize()?;
    }
    let prefill = start.elapsed();
    let mut sampling = Duration::ZERO;
    let mut done = vec![false; b];
    let mut first_token = None;
    let mut step = vec![None; b];
    for i in 0..req.max_new {
        if opts.time_sampling {
            dev.synchronize()?;
        }
        let t1 = Instant::now();
        let tok = sampler.sample(&logits)?;
        let host: Vec<u32> = tok.to_vec1()?;
        if opts.time_sampling {
            sampling += t1.elapsed();
        }
        first_token.get_or_insert_with(|| start.elapsed());
        for r in 0..b {
            step[r] = (!done[r]).then_some(host[r]);
            if !done[r] {
                rows[r].ids.push(host[r]);
                if req.stop.contains(&host[r]) {
                    done[r] = true;
                    rows[r].stop = StopReason::Eos;
                }
            }
        }
        on_step(&step);
        let last = i + 1 == req.max_new || done.iter().all(|&d| d);
        if last && pooled.is_none() {
            break;
        }
        // Feed the tokens: the next logits, and the hidden state of the token fed.
        let out = model.decode_batch(&tok.unsqueeze(1)?, &mut cache, !last)?;
        if let Some(sum) = &pooled {
            pooled = Some((sum + out.hidden.broadcast_mul(&alive)?)?);
        }
        if last {
            break;
        }
        sampler.observe(&tok)?;
        if let Some(stop) = &stop {
            let hit = tok
                .to_dtype(DType::F32)?
                .unsqueeze(1)?
                .broadcast_eq(stop)?
                .to_dtype(DType::F32)?
                .max_keepdim(1)?;
            alive = (&alive - (&alive * hit)?)?;
        }
        logits = out.logits.ok_or_else(no_logits)?;
    }
    let embeddings = match pooled {
        Some(sum) => {
            let counts: Vec<f32> = rows.iter().map(|r| r.ids.len().max(1) as f32).collect();
            Some(sum.broadcast_div(&Tensor::from_vec(counts, (b, 1), dev)?)?)
        }
        None => None,
    };
    Ok(Generation {
        rows,
        embeddings,
        first_token: first_token.unwrap_or_default(),
        elapsed: start.elapsed(),
        prefill,
        sampling,
        graphed: cache.graphed(),
    })
}
