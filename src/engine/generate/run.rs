//! `cockpit generate` over many prompts: a prompts file (or one prompt) sampled N times
//! each, `batch_size` rows decoded together, each prompt's samples and their diversity as a
//! JSON line; and the benchmark of batch sizes.

use super::batch::{generate_rows_with, BatchOptions, Rows, StopReason};
use super::diversity::{self, Diversity};
use super::prompts::{self, Prompt};
use super::Sampling;
use crate::engine::data::Tok;
use crate::engine::model::Model;
use crate::engine::source::{open, Source};
use crate::engine::EngineError;
use crate::util::DeviceSpec;
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct ManyOptions {
    /// One prompt a line, or JSON Lines ([`prompts`]).
    pub prompts_file: Option<PathBuf>,
    /// Or one prompt (text or ids).
    pub prompt: Option<String>,
    pub prompt_ids: Vec<u32>,
    /// Samples per prompt.
    pub samples: usize,
    /// Rows decoded together; None: [`auto_batch_size`].
    pub batch_size: Option<usize>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub device: DeviceSpec,
    pub ignore_eos: bool,
    pub chat: bool,
}

/// One sample of a prompt.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SampleOut {
    pub text: Option<String>,
    pub ids: Vec<u32>,
    pub tokens: usize,
    pub stop: StopReason,
}

/// One prompt's line of the output.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PromptOut {
    /// Its line in the prompts file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    pub prompt: Option<String>,
    pub prompt_tokens: usize,
    pub samples: Vec<SampleOut>,
    pub diversity: Diversity,
}

/// What a run of [`run_many`] produced, and its figures.
pub struct ManyReport {
    pub prompts: Vec<PromptOut>,
    pub rows: usize,
    /// Rows decoded together (`--batch-size`, or [`auto_batch_size`]'s choice).
    pub batch_size: usize,
    pub new_tokens: usize,
    /// Generation's wall time (after loading).
    pub seconds: f64,
    /// The first batch's time to its first tokens.
    pub first_token_s: f64,
    pub load_s: f64,
    /// Each figure's mean over the prompts.
    pub mean: Diversity,
    /// Of `seconds`: the prefills (prompts in, first logits out), and the draws.
    pub prefill_s: f64,
    pub sampling_s: f64,
}

/// The batches' options: a prompt's samples share its prefill; the draws are timed.
const TIMED: BatchOptions = BatchOptions {
    share_prefill: true,
    time_sampling: true,
};

/// The compute dtype for generation on `device`: the GPU's (bf16 where it has it), f32 on
/// the CPU.
fn compute_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        crate::engine::precision::choose(
            crate::config::DType::Auto,
            crate::engine::device::compute_capability(device),
        )
        .map(|(d, _)| d)
        .unwrap_or(DType::F32)
    } else {
        DType::F32
    }
}

/// The model of `src` on `spec`'s device, and the seconds it took to load.
pub(crate) fn load(src: &Path, spec: DeviceSpec) -> Result<(Source, f64), EngineError> {
    let device = crate::engine::device::open(spec)?;
    // (generation runs on the device's one stream)
    crate::engine::device::single_stream(&device);
    let t0 = Instant::now();
    let s = open(src, compute_dtype(&device), &device, 64)?;
    Ok((s, t0.elapsed().as_secs_f64()))
}

/// Ids of a prompt's text (or a conversation's messages), through the chat template with
/// `chat`; and the template's end-of-turn token.
fn encode(
    s: &Source,
    src: &Path,
    tok: Option<&Tok>,
    prompt: &Prompt,
    chat: bool,
    at: &str,
) -> Result<(Vec<u32>, Option<u32>), EngineError> {
    // (Token ids need no tokenizer: a directory of weights alone takes them.)
    if let Prompt::Ids(ids) = prompt {
        return Ok((ids.clone(), None));
    }
    let Some(t) = tok else {
        return Err(usage(format!(
            "{at}: the model has no tokenizer (none beside its weights, or the built-in corpus); give token ids"
        )));
    };
    let messages = match (prompt, chat) {
        (Prompt::Ids(ids), _) => return Ok((ids.clone(), None)),
        (Prompt::Text(text), false) => return Ok((t.encode_prompt(text)?, None)),
        (Prompt::Messages(_), false) => {
            return Err(usage(format!("{at}: \"messages\" need --chat")))
        }
        (Prompt::Text(text), true) => vec![serde_json::json!({"role": "user", "content": text})],
        (Prompt::Messages(m), true) => m.clone(),
    };
    let tmpl = super::template::template_of(s, src).map_err(|e| usage(format!("--chat: {e}")))?;
    let rendered = tmpl.render(&messages, true).map_err(|e| {
        usage(format!(
            "{at}: --chat: the chat template fails to render: {e}"
        ))
    })?;
    Ok((t.encode_offsets(&rendered, at)?.0, tmpl.eos_id(t)))
}

/// Rows a batch takes at most when `--batch-size` is not given.
pub const AUTO_BATCH_MAX: usize = 512;

/// Rows decoded together by default: on a GPU as many as half its free memory holds
/// ([`crate::engine::spec::ModelSpec::decode_bytes_per_row`] for prompts of `longest` tokens
/// and `max_new` more), at most [`AUTO_BATCH_MAX`]; 64 on the CPU. Never more than `rows`.
/// A batch of this size that runs out of memory anyway is halved and redone ([`run_many`]).
pub fn auto_batch_size(model: &Model, rows: usize, longest: usize, max_new: usize) -> usize {
    let elem = model.dtype().size_in_bytes();
    let per_row = model
        .spec
        .decode_bytes_per_row(longest, longest + max_new, elem)
        .max(1);
    let free = match model.device().is_cuda() {
        true => crate::engine::device::memory_free(model.device()),
        false => None,
    };
    let fits = match free {
        Some(free) => ((free / 2 / per_row) as usize).clamp(1, AUTO_BATCH_MAX),
        None => 64,
    };
    fits.min(rows.max(1))
}

/// A chosen batch size as a whole number of prompts' `samples` where it holds one (a
/// prompt's samples then share a batch and its prefill).
fn whole_samples(rows: usize, samples: usize) -> usize {
    if rows >= samples {
        rows - rows % samples
    } else {
        rows
    }
}

/// The chosen batch size after a batch of `rows` ran out of memory: half, whole prompts' samples
/// where that holds one; always fewer rows, at least 1 (`rows` > 1).
fn halved(rows: usize, samples: usize) -> usize {
    whole_samples(rows / 2, samples).max(1)
}

/// Generate `o.samples` samples of every prompt; `on_progress` sees the rows done so far.
pub fn run_many(
    src: &Path,
    o: &ManyOptions,
    mut on_progress: impl FnMut(usize, usize),
) -> Result<ManyReport, EngineError> {
    if o.samples == 0 {
        return Err(usage("--samples 0: give at least 1".into()));
    }
    if o.batch_size == Some(0) {
        return Err(usage("--batch-size 0: give at least 1".into()));
    }
    // The file is read (and its errors found) before the model loads.
    let lines = match (&o.prompts_file, &o.prompt, o.prompt_ids.is_empty()) {
        (Some(f), None, true) => prompts::read(f).map_err(usage)?,
        (None, Some(p), true) => vec![prompts::PromptLine {
            line: 0,
            prompt: Prompt::Text(p.clone()),
        }],
        (None, None, false) => vec![prompts::PromptLine {
            line: 0,
            prompt: Prompt::Ids(o.prompt_ids.clone()),
        }],
        _ => {
            return Err(usage(
                "give one of --prompts FILE, --prompt TEXT or --prompt-ids IDS".into(),
            ))
        }
    };
    let (s, load_s) = load(src, o.device)?;
    let tok = s.tokenizer.as_deref().map(Tok::open).transpose()?;
    let mut stop: Vec<u32> = match (&s.hf, o.ignore_eos) {
        (Some(h), false) => h.eos.clone(),
        _ => Vec::new(),
    };
    let vocab = s.model.spec.vocab_size;
    let mut encoded = Vec::with_capacity(lines.len());
    for l in &lines {
        let at = match (&o.prompts_file, l.line) {
            (Some(f), n) => format!("{}: line {n}", f.display()),
            (None, _) => "the prompt".to_string(),
        };
        let mut ids = {
            let (ids, chat_stop) = encode(&s, src, tok.as_ref(), &l.prompt, o.chat, &at)?;
            if !o.ignore_eos {
                stop.extend(chat_stop.filter(|e| !stop.contains(e)));
            }
            ids
        };
        if ids.is_empty() {
            match s.hf.as_ref().and_then(|h| h.bos) {
                Some(b) => ids.push(b),
                None => {
                    return Err(usage(format!(
                        "{at}: the prompt is empty (and the model has no BOS token to start from)"
                    )))
                }
            }
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(usage(format!(
                "{at}: prompt token {bad} is outside the model's vocabulary ({vocab})"
            )));
        }
        let total = ids.len() + o.max_tokens;
        if total > s.max_positions {
            return Err(usage(format!(
                "{at}: {} prompt + {} new tokens exceed the model's {} positions; lower --max-tokens or shorten the prompt",
                ids.len(),
                o.max_tokens,
                s.max_positions
            )));
        }
        if let Some(w) = s.hf.as_ref().and_then(|h| h.sliding_window) {
            if total > w {
                return Err(usage(format!(
                    "{at}: {total} tokens exceed the model's sliding_window = {w}, which cockpit does not compute; lower --max-tokens"
                )));
            }
        }
        encoded.push(ids);
    }
    let n = o.samples;
    let rows: Vec<Vec<u32>> = encoded
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), n))
        .collect();
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(1);
    let whole = |b: usize| whole_samples(b, n);
    let mut batch_size = o
        .batch_size
        .unwrap_or_else(|| whole(auto_batch_size(&s.model, rows.len(), longest, o.max_tokens)));
    let start = Instant::now();
    let mut outs = Vec::with_capacity(rows.len());
    let mut embeddings = Vec::new();
    let mut first_token_s = None;
    let (mut prefill_s, mut sampling_s) = (0.0, 0.0);
    let mut c = 0u64;
    while outs.len() < rows.len() {
        let chunk = &rows[outs.len()..(outs.len() + batch_size).min(rows.len())];
        let req = Rows {
            prompts: chunk,
            max_new: o.max_tokens,
            sampling: &o.sampling,
            seed: o.sampling.seed.wrapping_add(c),
            stop: &stop,
            embed: n >= 2,
        };
        let g = match generate_rows_with(&s.model, &req, TIMED, |_| {}) {
            Ok(g) => g,
            // The batch size was chosen here, from an estimate: a smaller one is tried.
            Err(e)
                if o.batch_size.is_none()
                    && batch_size > 1
                    && crate::engine::device::is_out_of_memory(&e) =>
            {
                batch_size = halved(batch_size, n);
                tracing::warn!("a batch ran out of memory: {batch_size} rows at a time from here");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        c += 1;
        first_token_s.get_or_insert(g.first_token.as_secs_f64());
        prefill_s += g.prefill.as_secs_f64();
        sampling_s += g.sampling.as_secs_f64();
        outs.extend(g.rows);
        embeddings.extend(g.embeddings);
        on_progress(outs.len(), rows.len());
    }
    let cosine = if embeddings.is_empty() {
        vec![None; encoded.len()]
    } else {
        let all = Tensor::cat(&embeddings, 0)?;
        let d = all.dim(1)?;
        diversity::pairwise_cosine_distance(&all.reshape((encoded.len(), n, d))?)?
    };
    let seconds = start.elapsed().as_secs_f64();
    let new_tokens = outs.iter().map(|r| r.ids.len()).sum();
    let mut prompts_out = Vec::with_capacity(encoded.len());
    for (i, (l, ids)) in lines.iter().zip(&encoded).enumerate() {
        let mine = &outs[i * n..(i + 1) * n];
        let samples: Vec<&[u32]> = mine.iter().map(|r| r.ids.as_slice()).collect();
        prompts_out.push(PromptOut {
            line: (l.line > 0).then_some(l.line),
            prompt: match &l.prompt {
                Prompt::Text(t) => Some(t.clone()),
                Prompt::Ids(_) | Prompt::Messages(_) => None,
            },
            prompt_tokens: ids.len(),
            samples: mine
                .iter()
                .map(|r| SampleOut {
                    text: tok.as_ref().map(|t| t.decode(&r.ids)),
                    ids: r.ids.clone(),
                    tokens: r.ids.len(),
                    stop: r.stop,
                })
                .collect(),
            diversity: diversity::of_samples(&samples, cosine[i]),
        });
    }
    let mean = diversity::mean(
        &prompts_out
            .iter()
            .map(|p| p.diversity.clone())
            .collect::<Vec<_>>(),
    );
    Ok(ManyReport {
        rows: rows.len(),
        batch_size,
        prompts: prompts_out,
        new_tokens,
        seconds,
        first_token_s: first_token_s.unwrap_or_default(),
        load_s,
        mean,
        prefill_s,
        sampling_s,
    })
}

/// One batch size's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchRow {
    pub batch: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub first_token_ms: f64,
    pub load_s: f64,
    pub prefill_ms: f64,
    /// New tokens per second of the decode steps (after the prefill).
    pub decode_tokens_per_s: f64,
    /// The draws' share of `seconds`.
    pub sampling_share: f64,
    /// Whether the decode steps were replayed from a CUDA graph.
    pub graphed: bool,
}

/// Tokens/s of batches of `batches` rows (random prompts of `prompt_len` ids), `max_tokens`
/// new tokens each, every row to the end (no stop token); `on_row` sees each batch's
/// figures as they come.
pub fn bench(
    src: &Path,
    device: DeviceSpec,
    batches: &[usize],
    prompt_len: usize,
    max_tokens: usize,
    sampling: &Sampling,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, EngineError> {
    use rand::{Rng, SeedableRng};
    if let Some(0) = batches.iter().copied().find(|&b| b == 0) {
        return Err(usage("--bench: a batch of 0 rows".into()));
    }
    let (s, load_s) = load(src, device)?;
    let total = prompt_len + max_tokens;
    if total > s.max_positions {
        return Err(usage(format!(
            "{prompt_len} prompt + {max_tokens} new tokens exceed the model's {} positions; lower --max-tokens",
            s.max_positions
        )));
    }
    let vocab = s.model.spec.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(sampling.seed);
    let mut prompts = |b: usize| -> Vec<Vec<u32>> {
        (0..b)
            .map(|_| {
                (0..prompt_len)
                    .map(|_| rng.random_range(0..vocab))
                    .collect()
            })
            .collect()
    };
    // Warm up (kernels loaded, allocator primed) on a short run.
    let warm = prompts(1);
    generate_rows_with(
        &s.model,
        &Rows {
            prompts: &warm,
            max_new: 4.min(max_tokens),
            sampling,
            seed: sampling.seed,
            stop: &[],
            embed: false,
        },
        TIMED,
        |_| {},
    )?;
    let mut out = Vec::new();
    for &b in batches {
        let rows = prompts(b);
        let g = generate_rows_with(
            &s.model,
            &Rows {
                prompts: &rows,
                max_new: max_tokens,
                sampling,
                seed: sampling.seed,
                stop: &[],
                embed: false,
            },
            TIMED,
            |_| {},
        )?;
        let new_tokens: usize = g.rows.iter().map(|r| r.ids.len()).sum();
        let seconds = g.elapsed.as_secs_f64();
        let row = BenchRow {
            batch: b,
            prompt_tokens: prompt_len,
            new_tokens,
            seconds,
            tokens_per_s: new_tokens as f64 / seconds.max(1e-9),
            first_token_ms: g.first_token.as_secs_f64() * 1e3,
            load_s,
            prefill_ms: g.prefill.as_secs_f64() * 1e3,
            decode_tokens_per_s: new_tokens as f64 / (seconds - g.prefill.as_secs_f64()).max(1e-9),
            sampling_share: g.sampling.as_secs_f64() / seconds.max(1e-9),
            graphed: g.graphed,
        };
        on_row(&row);
        out.push(row);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{halved, whole_samples};

    #[test]
    fn chosen_batches_hold_whole_prompts_and_shrink_on_out_of_memory() {
        assert_eq!(whole_samples(140, 8), 136);
        assert_eq!(whole_samples(512, 8), 512);
        assert_eq!(whole_samples(5, 8), 5);
        assert_eq!(whole_samples(7, 1), 7);
        assert_eq!(halved(136, 8), 64);
        assert_eq!(halved(12, 8), 6);
        assert_eq!(halved(2, 8), 1);
        // Every halving ends at one row.
        let mut b = 512;
        let mut seen = vec![b];
        while b > 1 {
            let next = halved(b, 3);
            assert!(next < b && next >= 1);
            b = next;
            seen.push(b);
        }
        assert_eq!(seen.last(), Some(&1));
    }
}
