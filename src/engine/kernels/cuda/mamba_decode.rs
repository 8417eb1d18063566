//! A hybrid's Mamba-2 layer for one new position per row (mamba_decode.cuh), for
//! src/engine/model/mamba_decode.rs on CUDA: from in_proj's output to the gated norm's, the
//! conv window and the scan's state carried to the next step — two launches a layer instead of
//! the candle ops' narrows, conv taps, softplus, decay, outer product, read-out and norm.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

use super::super::MambaDecode;
use super::{
    cuda_of, device_of, err, i32_of, kernel_build, ptx_sm90, view, wrap, Elem, MODULE, MODULE_SM75,
    MODULE_SM90, PTX, PTX_SM75,
};

/// Threads a block and the state rows it takes (MD_THREADS, MD_ROWS in mamba_decode.cuh).
const THREADS: u32 = 256;
const ROWS: usize = 8;

/// Whether [`mamba_decode`] takes a layer of these sizes: a conv of 2 to 8 taps (the window
/// it carries), groups that divide the heads, and B and C in 48 KB of shared memory.
pub fn mamba_decode_takes(d: &MambaDecode) -> bool {
    (2..=8).contains(&d.conv_k)
        && d.groups > 0
        && d.heads.is_multiple_of(d.groups)
        && d.head_dim > 0
        && (ROWS + 2 * d.state) * 4 <= 48 * 1024
}

/// One position of a Mamba-2 layer for each row: `proj` `[B, W]` (in_proj's output, z | x, B,
/// C | dt), the conv's last inputs `hist` `[B, K − 1, conv]`, its weight `conv_w` `[conv, K]`
/// and bias (all one dtype: f32, bf16 or f16), `dt_bias`, `a_log`, `dskip` `[H]` and the norm's
/// weight `[inner]` in f32, the scan's state `[B, H, P, S]` f32 → the gated norm's output
/// `[B, inner]`, the conv's inputs after this position and the state after it (new tensors).
#[allow(clippy::too_many_arguments)]
pub fn mamba_decode(
    proj: &Tensor,
    hist: &Tensor,
    conv_w: &Tensor,
    conv_b: Option<&Tensor>,
    dt_bias: &Tensor,
    a_log: &Tensor,
    dskip: &Tensor,
    norm_w: &Tensor,
    state: &Tensor,
    d: &MambaDecode,
) -> Result<(Tensor, Tensor, Tensor)> {
    by_dtype!(
        proj.dtype(),
        decode_t(proj, hist, conv_w, conv_b, dt_bias, a_log, dskip, norm_w, state, d)
    )
}

#[allow(clippy::too_many_arguments)]
fn decode_t<T: Elem>(
    proj: &Tensor,
    hist: &Tensor,
    conv_w: &Tensor,
    conv_b: Option<&Tensor>,
    dt_bias: &Tensor,
    a_log: &Tensor,
    dskip: &Tensor,
    norm_w: &Tensor,
    state: &Tensor,
    d: &MambaDecode,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (h, p, s, g, k) = (d.heads, d.head_dim, d.state, d.groups, d.conv_k);
    let inner = h * p;
    let conv = inner + 2 * g * s;
    let w = inner + conv + h;
    let b = proj.dim(0)?;
    let shapes_agree = proj.dims() == [b, w]
        && hist.dims() == [b, k - 1, conv]
        && conv_w.dims() == [conv, k]
        && conv_b.is_none_or(|c| c.dims() == [conv])
        && [dt_bias, a_log, dskip].iter().all(|t| t.dims() == [h])
        && norm_w.dims() == [inner]
        && state.dims() == [b, h, p, s];
    if !mamba_decode_takes(d) || !shapes_agree {
        return Err(err(format!(
            "mamba decode: proj {:?}, hist {:?}, conv {:?}, state {:?} do not agree with {d:?}",
            proj.dims(),
            hist.dims(),
            conv_w.dims(),
            state.dims()
        )));
    }
    let same = [hist, conv_w].iter().all(|t| t.dtype() == proj.dtype())
        && conv_b.is_none_or(|c| c.dtype() == proj.dtype());
    let f32s = [dt_bias, a_log, dskip, norm_w, state]
        .iter()
        .all(|t| t.dtype() == DType::F32);
    if !same || !f32s {
        return Err(err(
            "mamba decode: proj, hist and the conv's weights in one dtype; the rest f32",
        ));
    }
    let dev = device_of(proj)?;
    // SAFETY: every element of the four outputs is written: state_out and gated by the step
    // kernel's (row, head, state row) blocks, hist_out's x channels by each head's blocks and
    // its B, C channels by each group's first head, out by the norm's blocks.
    let state_out = unsafe { dev.alloc::<f32>(b * h * p * s)? };
    let hist_out = unsafe { dev.alloc::<T>(b * (k - 1) * conv)? };
    let gated = unsafe { dev.alloc::<f32>(b * inner)? };
    let out = unsafe { dev.alloc::<T>(b * inner)? };
    let step = load_kernel!(&dev, &kernel_name::<T>("mamba_decode_step"))?;
    let norm = load_kernel!(&dev, &kernel_name::<T>("mamba_decode_norm"))?;
    let (ps, pl) = proj.storage_and_layout();
    let (hs, hl) = hist.storage_and_layout();
    let (ws, wl) = conv_w.storage_and_layout();
    let (dbs, dbl) = dt_bias.storage_and_layout();
    let (als, all) = a_log.storage_and_layout();
    let (dss, dsl) = dskip.storage_and_layout();
    let (nws, nwl) = norm_w.storage_and_layout();
    let (ss, sl) = state.storage_and_layout();
    let (pv, hv, wv) = (
        view::<T>(cuda_of(&ps)?, pl)?,
        view::<T>(cuda_of(&hs)?, hl)?,
        view::<T>(cuda_of(&ws)?, wl)?,
    );
    let (dbv, alv, dsv, nwv, sv) = (
        view::<f32>(cuda_of(&dbs)?, dbl)?,
        view::<f32>(cuda_of(&als)?, all)?,
        view::<f32>(cuda_of(&dss)?, dsl)?,
        view::<f32>(cuda_of(&nws)?, nwl)?,
        view::<f32>(cuda_of(&ss)?, sl)?,
    );
    let bias = conv_b.map(|c| c.storage_and_layout());
    let bias_view = match &bias {
        Some((bs, bl)) => Some(view::<T>(cuda_of(bs)?, bl)?),
        None => None,
    };
    // (no bias: a null pointer, which the kernel checks)
    let null = 0u64;
    let (h_i, p_i, s_i, g_i, k_i) = (
        i32_of(h, "heads")?,
        i32_of(p, "head width")?,
        i32_of(s, "state")?,
        i32_of(g, "groups")?,
        i32_of(k, "conv taps")?,
    );
    let (clamp, lo, hi) = match d.dt_limits {
        Some((lo, hi)) => (1i32, lo, hi),
        None => (0i32, 0f32, 0f32),
    };
    let cfg = LaunchConfig {
        grid_dim: ((b * h) as u32, p.div_ceil(ROWS) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: ((ROWS + 2 * s) * 4) as u32,
    };
    let mut launch = step.builder();
    launch.arg(&pv).arg(&hv).arg(&wv);
    match &bias_view {
        Some(v) => launch.arg(v),
        None => launch.arg(&null),
    };
    launch
        .arg(&dbv)
        .arg(&alv)
        .arg(&dsv)
        .arg(&sv)
        .arg(&state_out)
        .arg(&hist_out)
        .arg(&gated)
        .arg(&h_i)
        .arg(&p_i)
        .arg(&s_i)
        .arg(&g_i)
        .arg(&k_i)
        .arg(&clamp)
        .arg(&lo)
        .arg(&hi);
    // SAFETY: the arguments match mamba_decode_step_<T> in order and type (the bias a device
    // pointer or 0); the buffers hold the shapes checked above; the shared memory is the
    // kernel's (MD_ROWS + 2·S) floats.
    unsafe { launch.launch(cfg) }.w()?;
    let (inner_i, eps) = (i32_of(inner, "inner width")?, d.eps);
    let cfg = LaunchConfig {
        grid_dim: ((b * g) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match mamba_decode_norm_<T>; gated and out hold B·inner elements,
    // the norm's weight inner.
    unsafe { launch!(norm, cfg, [&gated, &nwv, &out, &inner_i, &g_i, &eps]) }.w()?;
    drop((ps, hs, ws, dbs, als, dss, nws, ss, bias));
    Ok((
        wrap(out, &dev, (b, inner)),
        wrap(hist_out, &dev, (b, k - 1, conv)),
        wrap(state_out, &dev, (b, h, p, s)),
    ))
}
