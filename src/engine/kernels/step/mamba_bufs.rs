//! The Mamba layers' dimensions, weight entries and activation buffers on the whole-model step
//! (the kernels that use them: mamba.rs).

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::{align, ptr};
use crate::config::HybridConfig;
use crate::engine::kernels::spec::MAMBA_STEP_CHUNK;

/// The scan's chunk length inside the step ([`MAMBA_STEP_CHUNK`]).
pub(super) const CHUNK: usize = MAMBA_STEP_CHUNK;

/// A Mamba layer's own entries, beyond in_proj (`qkv_w`, `qkv_b`) and out_proj (`o_w`, `o_b`).
#[derive(Clone, Copy, Debug)]
pub(super) struct MambaIdx {
    /// The depthwise conv's weight `[conv channels, 1, d_conv]` and bias `[conv channels]`.
    pub(super) conv_w: usize,
    pub(super) conv_b: Option<usize>,
    /// Per head: dt's bias, log(−A) and the D skip.
    pub(super) dt_bias: usize,
    pub(super) a_log: usize,
    pub(super) d: usize,
    /// The gated RMSNorm's weight `[inner]`.
    pub(super) norm: usize,
}

/// The hybrid's Mamba dimensions, from its [`HybridConfig`].
#[derive(Clone, Copy, Debug)]
pub(super) struct MambaDims {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) state: usize,
    pub(super) groups: usize,
    pub(super) conv_k: usize,
    /// dt's limits (`f32::INFINITY`: no upper limit); `clamp`: the model clamps at all.
    pub(super) dt_min: f32,
    pub(super) dt_max: f32,
    pub(super) clamp: bool,
}

impl MambaDims {
    pub(super) fn new(h: &HybridConfig) -> Self {
        Self {
            heads: h.mamba_n_heads,
            head_dim: h.mamba_d_head,
            state: h.mamba_d_state,
            groups: h.mamba_n_groups,
            conv_k: h.mamba_d_conv,
            dt_min: h.dt_min as f32,
            dt_max: h.dt_max.map_or(f32::INFINITY, |m| m as f32),
            clamp: h.dt_min > 0.0 || h.dt_max.is_some(),
        }
    }

    /// heads · head width.
    pub(super) fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The conv's channels: x | B | C.
    pub(super) fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }

    /// in_proj's output width: z | x B C | dt.
    pub(super) fn in_w(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }

    /// Chunks of [`CHUNK`] covering `t` positions.
    pub(super) fn chunks(&self, t: usize) -> usize {
        t.div_ceil(CHUNK)
    }
}

/// Device addresses of the Mamba layers' activations for one micro-batch size.
#[derive(Clone, Debug)]
pub(super) struct MambaActs {
    /// Per layer (0 for attention layers): the scan's output with the D skip, before the gated
    /// norm (bf16 `[N, inner]`), and the gated norm's 1/rms per row and group (f32 `[N, groups]`).
    pub(super) y: Vec<u64>,
    pub(super) rstd: Vec<u64>,
    /// Scratch shared by the layers: the conv's output x | B | C after SiLU (bf16 `[N, conv]`),
    /// dt after softplus and its limits and its cumulative sum × A within each chunk (f32
    /// `[B, H, chunks·CHUNK]` each), the chunk states (f32 `[B, H, chunks, head_dim, state]`),
    /// and the backward's f32 gradients: of those two per-position values, of the conv's output
    /// (`[N, conv]`) and of the scan's output (`[N, inner]`).
    pub(super) xc: u64,
    pub(super) dtv: u64,
    pub(super) lam: u64,
    pub(super) states: u64,
    pub(super) ddt: u64,
    pub(super) dlam: u64,
    pub(super) dxc: u64,
    pub(super) dy: u64,
    /// The backward's gradient of each chunk's start state, then of its own contribution to
    /// its end state (the layout of `states`).
    pub(super) dstates: u64,
    /// Each chunk's C·Bᵀ per group (f32 `[B, groups, chunks, CHUNK, CHUNK]`), shared by the
    /// group's heads.
    pub(super) cb: u64,
}

/// The device memory behind [`MambaActs`] (kept by the arena).
pub(super) struct MambaArena {
    _bf: CudaSlice<bf16>,
    _f32: CudaSlice<f32>,
    pub(super) acts: MambaActs,
}

impl MambaArena {
    /// The buffers for micro-batch `b` of `t` positions; `mamba[l]`: layer l is a Mamba layer.
    pub(super) fn new(
        dev: &CudaDevice,
        dims: &MambaDims,
        (b, t): (usize, usize),
        mamba: &[bool],
    ) -> Result<Self> {
        let stream = dev.cuda_stream();
        let n = b * t;
        let (inner, conv, nh) = (dims.inner(), dims.conv_dim(), dims.heads);
        let tp = dims.chunks(t) * CHUNK;
        let layers = mamba.iter().filter(|&&m| m).count();
        // bf16: y per Mamba layer, then xc.
        let (y_len, xc_len) = (align(n * inner), align(n * conv));
        let bf = dev.alloc_zeros::<bf16>((layers * y_len + xc_len).max(1))?;
        // f32: rstd per Mamba layer, dtv, lam, states, ddt, dlam, dxc, dy.
        let rstd_len = align(n * dims.groups);
        let pos_len = align(b * nh * tp);
        let st_len = align(b * nh * dims.chunks(t) * dims.head_dim * dims.state);
        let cb_len = align(b * dims.groups * dims.chunks(t) * CHUNK * CHUNK);
        let f_len = layers * rstd_len
            + 4 * pos_len
            + 2 * st_len
            + align(n * conv)
            + align(n * inner)
            + cb_len;
        let f = dev.alloc_zeros::<f32>(f_len.max(1))?;
        let (bp, fp) = (ptr(&bf, &stream), ptr(&f, &stream));
        let (mut y, mut rstd) = (Vec::new(), Vec::new());
        let mut k = 0;
        for &m in mamba {
            if m {
                y.push(bp + 2 * (k * y_len) as u64);
                rstd.push(fp + 4 * (k * rstd_len) as u64);
                k += 1;
            } else {
                y.push(0);
                rstd.push(0);
            }
        }
        let mut next = layers * rstd_len;
        let mut take = |len: usize| {
            let o = fp + 4 * next as u64;
            next += len;
            o
        };
        let acts = MambaActs {
            y,
            rstd,
            xc: bp + 2 * (layers * y_len) as u64,
            dtv: take(pos_len),
            lam: take(pos_len),
            ddt: take(pos_len),
            dlam: take(pos_len),
            states: take(st_len),
            dxc: take(align(n * conv)),
            dy: take(align(n * inner)),
            dstates: take(st_len),
            cb: take(cb_len),
        };
        Ok(Self {
            _bf: bf,
            _f32: f,
            acts,
        })
    }
}
