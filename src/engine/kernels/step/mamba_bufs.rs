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
///
/// What the backward reads of a layer's forward lives in one of `slots`: a slot per Mamba layer
/// where the step keeps activations (`model.recompute = "none"`: the backward computes none of
/// the forward again), else one slot that every layer shares, which the backward's recompute of
/// the layer's forward has just refilled.
#[derive(Clone, Debug)]
pub(super) struct MambaActs {
    /// Per layer (0 for attention layers): the scan's output with the D skip, before the gated
    /// norm (bf16 `[N, inner]`), and the gated norm's 1/rms per row and group (f32 `[N, groups]`).
    pub(super) y: Vec<u64>,
    pub(super) rstd: Vec<u64>,
    /// Per layer (0 for attention layers), its slot's: dt after softplus and its limits, and its
    /// cumulative sum × A within each chunk (f32 `[B, H, chunks·CHUNK]` each); each chunk's
    /// C·Bᵀ per group (f32 `[B, groups, chunks, CHUNK, CHUNK]`), which the group's heads share;
    /// the state at each chunk's start (16-bit `[B, H, chunks, head_dim, state]`, the step's
    /// type, as the chunk products read it); the conv's output x | B | C after SiLU (bf16
    /// `[N, conv]`).
    pub(super) dtv: Vec<u64>,
    pub(super) lam: Vec<u64>,
    pub(super) cb: Vec<u64>,
    pub(super) states: Vec<u64>,
    pub(super) xc: Vec<u64>,
    /// Scratch shared by the layers: the backward's f32 gradients of dt and of its cumulative
    /// sum (`[B, H, chunks·CHUNK]`) and of the conv's output (`[N, conv]`).
    pub(super) ddt: u64,
    pub(super) dlam: u64,
    pub(super) dxc: u64,
    /// The backward's gradient of the scan's output (`[N, inner]`, 16-bit: the scan's
    /// backward rounds its tiles to it).
    pub(super) dy: u64,
    /// The backward's gradient of each chunk's own contribution to its end state, 16-bit (the
    /// layout of `states`): the state passing's backward makes it.
    pub(super) down: u64,
}

/// The device memory behind [`MambaActs`] (kept by the arena).
pub(super) struct MambaArena {
    _bf: CudaSlice<bf16>,
    _f32: CudaSlice<f32>,
    pub(super) acts: MambaActs,
}

impl MambaArena {
    /// The buffers for micro-batch `b` of `t` positions; `mamba[l]`: layer l is a Mamba layer;
    /// `keep`: each Mamba layer keeps its own slot (no recompute).
    pub(super) fn new(
        dev: &CudaDevice,
        dims: &MambaDims,
        (b, t): (usize, usize),
        mamba: &[bool],
        keep: bool,
    ) -> Result<Self> {
        let stream = dev.cuda_stream();
        let n = b * t;
        let (inner, conv, nh) = (dims.inner(), dims.conv_dim(), dims.heads);
        let tp = dims.chunks(t) * CHUNK;
        let layers = mamba.iter().filter(|&&m| m).count();
        let slots = if keep { layers } else { layers.min(1) };
        let st_elems = b * nh * dims.chunks(t) * dims.head_dim * dims.state;
        // 16-bit: y per Mamba layer, states and xc per slot, then down and dy.
        let (y_len, st16_len, xc_len) = (align(n * inner), align(st_elems), align(n * conv));
        let slot16_len = st16_len + xc_len;
        let bf16_len = layers * y_len + slots * slot16_len + st16_len + align(n * inner);
        let bf = dev.alloc_zeros::<bf16>(bf16_len.max(1))?;
        // f32: rstd per Mamba layer; dtv, lam, cb per slot; ddt, dlam, dxc.
        let rstd_len = align(n * dims.groups);
        let pos_len = align(b * nh * tp);
        let cb_len = align(b * dims.groups * dims.chunks(t) * CHUNK * CHUNK);
        let slot_len = 2 * pos_len + cb_len;
        let f_len = layers * rstd_len + slots * slot_len + 2 * pos_len + align(n * conv);
        let f = dev.alloc_zeros::<f32>(f_len.max(1))?;
        let (bp, fp) = (ptr(&bf, &stream), ptr(&f, &stream));
        let at16 = |o: usize| bp + 2 * o as u64;
        let at32 = |o: usize| fp + 4 * o as u64;
        let slot16 = layers * y_len;
        let slot32 = layers * rstd_len;
        let mut acts = MambaActs {
            y: Vec::new(),
            rstd: Vec::new(),
            dtv: Vec::new(),
            lam: Vec::new(),
            cb: Vec::new(),
            states: Vec::new(),
            xc: Vec::new(),
            ddt: 0,
            dlam: 0,
            dxc: 0,
            down: at16(slot16 + slots * slot16_len),
            dy: at16(slot16 + slots * slot16_len + st16_len),
        };
        let mut k = 0;
        for &m in mamba {
            if !m {
                for v in [
                    &mut acts.y,
                    &mut acts.rstd,
                    &mut acts.dtv,
                    &mut acts.lam,
                    &mut acts.cb,
                    &mut acts.states,
                    &mut acts.xc,
                ] {
                    v.push(0);
                }
                continue;
            }
            let s = if keep { k } else { 0 };
            let slot = slot32 + s * slot_len;
            acts.y.push(at16(k * y_len));
            acts.rstd.push(at32(k * rstd_len));
            acts.dtv.push(at32(slot));
            acts.lam.push(at32(slot + pos_len));
            acts.cb.push(at32(slot + 2 * pos_len));
            acts.states.push(at16(slot16 + s * slot16_len));
            acts.xc.push(at16(slot16 + s * slot16_len + st16_len));
            k += 1;
        }
        let mut next = slot32 + slots * slot_len;
        let mut take = |len: usize| {
            let o = at32(next);
            next += len;
            o
        };
        acts.ddt = take(pos_len);
        acts.dlam = take(pos_len);
        acts.dxc = take(align(n * conv));
        Ok(Self {
            _bf: bf,
            _f32: f,
            acts,
        })
    }
}
