//! The routed experts' dimensions, weight entries and buffers on the whole-model step (the
//! launches that use them: moe.rs).

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::{align, ptr};
use crate::config::HybridConfig;

/// The kinds of expert products (moe_mm.rs's `ExpertMm`), each with its row of operand
/// addresses a layer.
pub(super) const EXPERT_MM_KINDS: usize = 6;

/// A layer's experts: the router `[E, C]`, the experts' packed gate | up `[E, 2I, C]` and
/// down `[E, C, I]` (transformers' `block_sparse_moe` tensors).
#[derive(Clone, Copy, Debug)]
pub(super) struct MoeIdx {
    pub(super) router: usize,
    pub(super) gate_up: usize,
    pub(super) down: usize,
}

/// The experts' shape, from the hybrid's [`HybridConfig`].
#[derive(Clone, Copy, Debug)]
pub(super) struct MoeDims {
    /// Experts (E), those each token takes (k), each one's SwiGLU width (I).
    pub(super) experts: usize,
    pub(super) top_k: usize,
    pub(super) hidden: usize,
}

impl MoeDims {
    /// None without routed experts.
    pub(super) fn new(h: &HybridConfig) -> Option<Self> {
        (h.experts > 0).then_some(Self {
            experts: h.experts,
            top_k: h.experts_top_k,
            hidden: h.expert_hidden,
        })
    }
}

/// Device addresses of the experts' activations for one micro-batch size: n rows, P = n·k
/// (row, slot) pairs. What the backward reads of a layer's forward sits in a slot per layer
/// unless the whole block is computed again in the backward (`model.recompute = "full"` or
/// `"offload"`: one slot, which that recompute refills).
#[derive(Clone, Debug)]
pub(super) struct MoeActs {
    /// Per layer's slot: the router logits (f32 `[n, E]`), each slot's expert and weight
    /// (i32, f32 `[n, k]`) and place in expert order (i32 `[n, k]`), the pairs in expert order
    /// (i32 `[P]`: row·k + slot) and the experts' gate | up outputs (16-bit `[P, 2I]`).
    pub(super) logits: Vec<u64>,
    pub(super) topi: Vec<u64>,
    pub(super) topw: Vec<u64>,
    pub(super) pos: Vec<u64>,
    pub(super) perm: Vec<u64>,
    pub(super) gu: Vec<u64>,
    /// Scratch: the pairs' gathered rows (16-bit `[P, C]`, twice: an input and an output),
    /// their activations and its gradient (`[P, I]` each), the gate | up gradient (`[P, 2I]`),
    /// the router logits' gradient (16-bit `[n, E]`), the slots' weight gradients (f32
    /// `[n, k]`) and the load-balancing loss's gradient per router probability (f32 `[E]`).
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) act: u64,
    pub(super) du: u64,
    pub(super) dgu: u64,
    pub(super) dlogits: u64,
    pub(super) dw: u64,
    pub(super) aux: u64,
    /// Per layer: its experts' counts (u32 `[E]`) then its router probabilities' sums (f32
    /// bits `[E]`), at `2E·layer` in [`MoeArena::counts`].
    pub(super) counts: u64,
    /// The router's per-block probability sums (f32 `[blocks, E]`, blocks ≤ ⌈n/8⌉) and the
    /// ticket (u32, 0 between launches) by which its last block adds them up (moe.cuh).
    pub(super) part: u64,
    pub(super) ticket: u64,
    /// Per layer: the experts' operand addresses for grouped matmuls (u64
    /// `[kind][A | B | C][E]`, moe_mm.rs; written only where those run).
    pub(super) ptrs: u64,
}

/// The device memory behind [`MoeActs`] (kept by the arena).
pub(super) struct MoeArena {
    _bf: CudaSlice<bf16>,
    _f32: CudaSlice<f32>,
    /// Each layer's counts and probability sums, read back to the host after its router
    /// ([`MoeActs::counts`]).
    pub(super) counts: CudaSlice<u32>,
    _ptrs: CudaSlice<u64>,
    pub(super) acts: MoeActs,
}

impl MoeArena {
    /// The buffers for `layers` layers with experts, micro-batch `b` of `t` positions,
    /// width `c`; `keep`: a slot per layer.
    pub(super) fn new(
        dev: &CudaDevice,
        d: &MoeDims,
        (b, t, c): (usize, usize, usize),
        layers: usize,
        keep: bool,
    ) -> Result<Self> {
        let stream = dev.cuda_stream();
        let (n, e, k, i) = (b * t, d.experts, d.top_k, d.hidden);
        let p = n * k;
        let slots = if keep { layers } else { layers.min(1) };
        // 16-bit: gu per slot, then x, y, act, du, dgu, dlogits.
        let gu_len = align(p * 2 * i);
        let scratch16 = [p * c, p * c, p * i, p * i, p * 2 * i, n * e].map(align);
        let bf_len = slots * gu_len + scratch16.iter().sum::<usize>();
        let bf = dev.alloc_zeros::<bf16>(bf_len.max(1))?;
        // 4-byte: logits, topi, topw, pos, perm per slot, then dw, aux and the router's
        // per-block sums.
        let slot32 = [n * e, n * k, n * k, n * k, p].map(align);
        let slot32_len: usize = slot32.iter().sum();
        let f_len = slots * slot32_len + align(n * k) + align(e) + align(n.div_ceil(8) * e);
        let f = dev.alloc_zeros::<f32>(f_len.max(1))?;
        // (then the router's ticket)
        let counts = dev.alloc_zeros::<u32>(2 * e * layers + 1)?;
        let ptrs = dev.alloc_zeros::<u64>((EXPERT_MM_KINDS * 3 * e * layers).max(1))?;
        let (bp, fp) = (ptr(&bf, &stream), ptr(&f, &stream));
        let mut acts = MoeActs {
            logits: Vec::new(),
            topi: Vec::new(),
            topw: Vec::new(),
            pos: Vec::new(),
            perm: Vec::new(),
            gu: Vec::new(),
            x: 0,
            y: 0,
            act: 0,
            du: 0,
            dgu: 0,
            dlogits: 0,
            dw: 0,
            aux: 0,
            part: 0,
            ticket: ptr(&counts, &stream) + 4 * (2 * e * layers) as u64,
            counts: ptr(&counts, &stream),
            ptrs: ptr(&ptrs, &stream),
        };
        for l in 0..layers {
            let s = if keep { l } else { 0 };
            acts.gu.push(bp + 2 * (s * gu_len) as u64);
            let mut at = s * slot32_len;
            for (v, len) in [
                &mut acts.logits,
                &mut acts.topi,
                &mut acts.topw,
                &mut acts.pos,
                &mut acts.perm,
            ]
            .into_iter()
            .zip(slot32)
            {
                v.push(fp + 4 * at as u64);
                at += len;
            }
        }
        let mut at16 = slots * gu_len;
        for (v, len) in [
            &mut acts.x,
            &mut acts.y,
            &mut acts.act,
            &mut acts.du,
            &mut acts.dgu,
            &mut acts.dlogits,
        ]
        .into_iter()
        .zip(scratch16)
        {
            *v = bp + 2 * at16 as u64;
            at16 += len;
        }
        let at32 = slots * slot32_len;
        acts.dw = fp + 4 * at32 as u64;
        acts.aux = fp + 4 * (at32 + align(n * k)) as u64;
        acts.part = fp + 4 * (at32 + align(n * k) + align(e)) as u64;
        Ok(Self {
            _bf: bf,
            _f32: f,
            counts,
            _ptrs: ptrs,
            acts,
        })
    }
}
