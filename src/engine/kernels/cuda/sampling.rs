//! The next token of every row of a batch in one launch (sampling.cuh): repetition penalty,
//! temperature, top-k, top-p and the draw, for src/engine/generate/sampling.rs on CUDA.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::optimizer::with_ptrs;
use super::{
    cuda_of, device_of, err, i32_of, kernel_build, ptx_sm90, view, wrap, MODULE, MODULE_SM75,
    MODULE_SM90, PTX, PTX_SM75,
};

/// Threads per row (SAMPLE_THREADS in sampling.cuh).
const SAMPLE_THREADS: u32 = 512;

/// How [`sample_rows`] chooses (src/engine/generate/sampling.rs's `Sampling`, as the kernel
/// takes it).
#[derive(Clone, Copy, Debug)]
pub struct SampleArgs {
    /// The first maximum, nothing drawn (temperature 0).
    pub greedy: bool,
    /// 1 / temperature.
    pub inv_t: f32,
    /// A seen token's logit is multiplied by `pen_pos` (1 / r) when ≥ 0, by `pen_neg` (r)
    /// when negative.
    pub pen_pos: f32,
    pub pen_neg: f32,
    /// 0 = off.
    pub top_k: usize,
    /// ≥ 1 = off.
    pub top_p: f32,
    pub seed: u64,
    /// The draw's counter: a new value each step.
    pub step: u64,
}

/// The token of each row of `logits` (`[B, V]` f32, contiguous, on a CUDA device), `[B]`
/// u32, and each row's floor (`[B]` f32): the tokens allowed were those whose penalised,
/// tempered logit is at or above it (greedy: the maximum). `seen` (`[B, V]` u8, nonzero where
/// the row holds the token) applies the repetition penalty.
pub fn sample_rows(
    logits: &Tensor,
    seen: Option<&Tensor>,
    a: &SampleArgs,
) -> Result<(Tensor, Tensor)> {
    let (rows, vocab) = logits.dims2()?;
    if logits.dtype() != DType::F32 || !logits.is_contiguous() {
        return Err(err("sample_rows: logits must be contiguous f32 [B, V]"));
    }
    if let Some(s) = seen {
        if s.dims() != [rows, vocab] || s.dtype() != DType::U8 || !s.is_contiguous() {
            return Err(err("sample_rows: seen must be contiguous u8 [B, V]"));
        }
    }
    if rows == 0 || vocab == 0 {
        return Err(err("sample_rows: an empty batch or vocabulary"));
    }
    let dev = device_of(logits)?;
    // SAFETY: the kernel writes every row's token and floor.
    let out = unsafe { dev.alloc::<u32>(rows)? };
    let floor = unsafe { dev.alloc::<f32>(rows)? };
    let f = load_kernel!(&dev, "sample_rows_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (SAMPLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, vocab_i) = (i32_of(rows, "rows")?, i32_of(vocab, "vocab")?);
    let top_k = i32_of(a.top_k.min(vocab), "top_k")?;
    let greedy = i32::from(a.greedy);
    let (ls, ll) = logits.storage_and_layout();
    let lv = view::<f32>(cuda_of(&ls)?, ll)?;
    let guard = seen.map(|s| s.storage_and_layout());
    let use_seen = i32::from(guard.is_some());
    match &guard {
        Some((ss, sl)) => {
            let sv = view::<u8>(cuda_of(ss)?, sl)?;
            // SAFETY: the arguments match sample_rows_f32; logits and seen hold rows·vocab
            // elements, out and floor rows.
            unsafe {
                launch!(
                    f,
                    cfg,
                    [
                        &lv, &sv, &use_seen, &out, &floor, &rows_i, &vocab_i, &a.inv_t, &a.pen_pos,
                        &a.pen_neg, &top_k, &a.top_p, &a.seed, &a.step, &greedy
                    ]
                )
            }
            .w()?;
        }
        None => {
            let none = 0u64;
            // SAFETY: as above; `seen` is a null pointer the kernel does not read (use_seen 0).
            unsafe {
                launch!(
                    f,
                    cfg,
                    [
                        &lv, &none, &use_seen, &out, &floor, &rows_i, &vocab_i, &a.inv_t,
                        &a.pen_pos, &a.pen_neg, &top_k, &a.top_p, &a.seed, &a.step, &greedy
                    ]
                )
            }
            .w()?;
        }
    }
    drop(guard);
    drop(ls);
    Ok((wrap(out, &dev, rows), wrap(floor, &dev, rows)))
}

/// Mark each row's token (`tokens` `[B]` u32) as seen in `seen` (`[B, V]` u8), in place: the
/// repetition penalty's record after a step.
pub fn sample_observe(seen: &Tensor, tokens: &Tensor) -> Result<()> {
    let (rows, vocab) = seen.dims2()?;
    if seen.dtype() != DType::U8 || !seen.is_contiguous() {
        return Err(err("sample_observe: seen must be contiguous u8 [B, V]"));
    }
    if tokens.dims() != [rows] || tokens.dtype() != DType::U32 || !tokens.is_contiguous() {
        return Err(err("sample_observe: tokens must be contiguous u32 [B]"));
    }
    let dev = device_of(seen)?;
    let f = load_kernel!(&dev, "sample_observe")?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, vocab_i) = (i32_of(rows, "rows")?, i32_of(vocab, "vocab")?);
    with_ptrs::<u8, _>(&[seen], |s| {
        with_ptrs::<u32, _>(&[tokens], |t| {
            // SAFETY: the arguments match sample_observe; seen holds rows·vocab bytes,
            // tokens rows u32.
            unsafe { launch!(f, cfg, [&s[0], &t[0], &rows_i, &vocab_i]) }.w()?;
            Ok(())
        })
    })
}
