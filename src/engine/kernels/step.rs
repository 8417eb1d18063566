//! The whole training step of a decoder-only model as one hand-scheduled CUDA program, built
//! from the model's shape ([`StepWeights`]): LayerNorm or RMSNorm, GELU or SwiGLU MLP, biases
//! or none, multi-head or grouped-query attention, learned positions or RoPE, tied or untied
//! head — one program for every family, not one per architecture.
//!
//! The per-op path (the custom ops in `cuda.rs`) still goes through candle's autograd: every
//! graph edge costs a zero-fill and an add, every f32 master weight is cast to bf16 by its own
//! kernel and its gradient cast back, and every op allocates its output. Here none of that
//! happens:
//!
//! - one multi-tensor kernel casts all fp32 master weights into ONE flat bf16 buffer, laid
//!   out so that q|k|v of a layer are one `[(H + 2·KV)·hd, C]` matrix (and a SwiGLU MLP's
//!   gate|up one `[2F, C]` matrix);
//! - activations live in one preallocated arena per micro-batch size (no per-step device
//!   allocation); the residual add is fused with the next LayerNorm;
//! - matmuls call cuBLAS directly (bf16 in, fp32 accumulate), and the weight gradients are
//!   accumulated by cuBLAS (`beta = 1`) straight into ONE flat fp32 gradient buffer, as are
//!   the bias (column-sum), LayerNorm and embedding gradients — so gradient accumulation over
//!   micro-batches is free and the optimizer reads views of that buffer;
//! - the LM head runs in chunks of rows: each chunk's logits are written into one padded
//!   buffer, the cross-entropy kernel overwrites them with their gradient, and the head's
//!   backward for those rows follows at once — the logits never exist whole (at a 128k
//!   vocabulary they would outweigh every other activation).
//!
//! The forward/backward is the same arithmetic as the plain candle model (tests/gpu_kernels.rs
//! compares loss and every gradient on the GPU).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use candle_core::cuda_backend::cudarc::driver::{
    result as drv,
    sys::{
        CUdevice_attribute, CUevent_flags, CUfunction_attribute, CUgraphInstantiate_flags,
        CUstreamCaptureMode,
    },
    CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Device, Result, Tensor, TensorId, Var};
use half::bf16;

use super::buckets;
use super::cuda::{
    err, flat_cfg, i32_of, load_function, multi_grid, row_cfg, with_f32_ptrs, with_ptrs,
};
use super::lt::{Epi, Lt, Mm, Operand};
use super::reduce::Overlap;
use super::side::{Buf, Side};
use super::spec::{LinearWB, StepLora, StepMatrix, StepWeights, LORA_TARGETS};
use super::WeightCopy;
use crate::config::Recompute;
use crate::engine::dropout;
use crate::engine::events::KernelTime;
use crate::engine::kernels::nf4::Nf4;

/// Elements each sub-buffer is aligned to (256 bytes in bf16): cuBLAS and vector loads like it.
const ALIGN: usize = 128;

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// A kernel argument (the launch builder borrows its arguments, so they live in a slice).
enum Arg {
    P(u64),
    I(i32),
    U(u32),
    F(f32),
    L(i64),
}

/// A linear layer's shape: `[rows, inp]` in, `[rows, out]` out; `ldy` is the output's (or
/// its gradient's) row stride.
#[derive(Clone, Copy)]
struct Lin {
    rows: usize,
    inp: usize,
    out: usize,
    ldy: usize,
    /// The input's (or its gradient's) row stride: `inp` unless set ([`Lin::ldx`]).
    ldx: usize,
}

impl Lin {
    fn new(rows: usize, inp: usize, out: usize, ldy: usize) -> Self {
        Self {
            rows,
            inp,
            out,
            ldy,
            ldx: inp,
        }
    }

    /// The same layer over an input of row stride `ldx` (columns of a wider matrix).
    fn ldx(self, ldx: usize) -> Self {
        Self { ldx, ..self }
    }

    /// `y[rows, out] = x[rows, inp]·wᵀ` (row-major; `ldy` ≥ out).
    fn fwd(&self, x: u64, w: u64, y: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (true, false),
            mnk: (self.out, self.rows, self.inp),
            a: op(w, self.inp),
            b: op(x, self.ldx),
            c: op(y, self.ldy),
        }
    }

    /// `dx[rows, inp] = dy[rows, out]·w`.
    fn dx(&self, dy: u64, w: u64, dx: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (false, false),
            mnk: (self.inp, self.rows, self.out),
            a: op(w, self.inp),
            b: op(dy, self.ldy),
            c: op(dx, self.ldx),
        }
    }

    /// `dw[out, inp] (+)= dyᵀ·x`.
    fn dw(&self, x: u64, dy: u64, dw: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (false, true),
            mnk: (self.inp, self.out, self.rows),
            a: op(x, self.ldx),
            b: op(dy, self.ldy),
            c: op(dw, self.inp),
        }
    }
}

/// A matrix operand for cuBLAS: device address, leading dimension, batch stride (elements).
#[derive(Clone, Copy)]
struct Mat {
    p: u64,
    ld: i32,
    stride: i64,
}

fn mat(p: u64, ld: usize) -> Mat {
    Mat {
        p,
        ld: ld as i32,
        stride: 0,
    }
}

fn bmat(p: u64, ld: usize, stride: usize) -> Mat {
    Mat {
        p,
        ld: ld as i32,
        stride: stride as i64,
    }
}

/// A timed launch: its group name and the events before and after it.
type Mark = (&'static str, CudaEvent, CudaEvent);

/// A loaded kernel and the name its GPU time is reported under.
struct Kern {
    f: CudaFunction,
    name: &'static str,
}

struct Kernels {
    /// The device's multiprocessor count (grid sizes).
    sms: usize,
    cast: Kern,
    axpy: Kern,
    lora_blocks: Kern,
    embed: Kern,
    residual_norm: Kern,
    norm_bwd: Kern,
    norm_bwd_add: Kern,
    /// Row-in-registers LayerNorm kernels for the model's width (n_embd ≤ 1024).
    norm_v8: Option<NormV8>,
    ce: Kern,
    ce_reg: Kern,
    bias_act: Kern,
    gelu_bwd: Kern,
    col_sum: Kern,
    qkv_split: Kern,
    heads_merge: Kern,
    heads_split: Kern,
    softmax_fwd: Kern,
    softmax_bwd: Kern,
    embedding_bwd: Kern,
    rope: Kern,
    swiglu_fwd: Kern,
    swiglu_bwd: Kern,
    dropout_rows: Kern,
    nf4_dequant: Kern,
    /// Flash attention for head dim 64 and for head dim 128.
    flash64: Flash,
    /// None where the GPU's shared memory per block is too small for them (a T4's 64 KB:
    /// [`super::flash_fits`] keeps such models off flash attention).
    flash128: Option<Flash>,
}

/// flash.cu's kernels for one head dim, and the dynamic shared memory the forward and the
/// backward's main kernel launch with (0 where the kernel's memory is static).
struct Flash {
    fwd: Kern,
    fwd_drop: Kern,
    pre: Kern,
    bwd: Kern,
    dq: Kern,
    fwd_smem: u32,
    bwd_smem: u32,
    /// The backward's block: threads, and keys it owns (the grid's second dimension covers T
    /// in steps of it).
    bwd_block: (u32, usize),
}

impl Flash {
    /// `hopper`: the kernels are the compute_90a build, whose forward and backward run on
    /// warpgroup tensor-core instructions (flash_sm90.cu).
    fn load(
        named: &dyn Fn(&str, &'static str) -> Result<Kern>,
        hd: usize,
        hopper: bool,
    ) -> Result<Self> {
        let sfx = if hd == 64 { "" } else { "_d128" };
        let k = |base: &str, group: &'static str| named(&format!("{base}{sfx}_bf16"), group);
        let (mut fwd_smem, mut bwd_smem) = super::spec::flash_smem(hd);
        let mut bwd_block = (128, 64);
        let bwd = if hopper && hd == 64 {
            // Three warpgroups over 128 keys (flash_sm90.cu's flash_bwd_ws_bf16).
            bwd_smem = super::spec::FLASH_BWD_WS_SMEM;
            bwd_block = (384, 128);
            named("flash_bwd_ws_bf16", "flash_bwd_ws")?
        } else if hopper {
            bwd_smem = super::spec::FLASH_BWD_WG_D128_SMEM;
            named(&format!("flash_bwd_wg{sfx}_bf16"), "flash_bwd_wg")?
        } else {
            k("flash_bwd", "flash_bwd")?
        };
        let (fwd, fwd_drop) = if hopper {
            fwd_smem = super::spec::flash_fwd_wg_smem(hd);
            (
                named(&format!("flash_fwd_wg{sfx}_bf16"), "flash_fwd_wg")?,
                named(&format!("flash_fwd_drop_wg{sfx}_bf16"), "flash_fwd_wg")?,
            )
        } else {
            (
                k("flash_fwd", "flash_fwd")?,
                k("flash_fwd_drop", "flash_fwd")?,
            )
        };
        let f = Self {
            fwd,
            fwd_drop,
            pre: k("flash_bwd_preprocess", "flash_bwd_preprocess")?,
            bwd,
            dq: k("flash_bwd_dq_convert", "flash_bwd_dq_convert")?,
            fwd_smem,
            bwd_smem,
            bwd_block,
        };
        // Above 48 KB a kernel's dynamic shared memory must be allowed explicitly.
        let allow = |k: &Kern, bytes: u32| -> Result<()> {
            if bytes > 48 * 1024 {
                k.f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .w()?;
            }
            Ok(())
        };
        allow(&f.fwd, f.fwd_smem)?;
        allow(&f.fwd_drop, f.fwd_smem)?;
        allow(&f.bwd, f.bwd_smem)?;
        Ok(f)
    }
}

/// The LayerNorm kernels specialised for rows of ⌈n_embd/256⌉ chunks, and the grids that
/// fill every SM once (kernels.cu's launch bounds: blocks of 256 threads per SM).
struct NormV8 {
    fwd: Kern,
    /// The backward's dx pass (per width) and its column-sum pass.
    bwd: Kern,
    bwd_wb: Kern,
    /// One wave of the forward (blocks).
    grid: u32,
    /// One wave of the backward's dx pass.
    bwd_grid: u32,
}

impl Kernels {
    /// `half`: the fp16 build of the kernels (same names).
    fn load(dev: &CudaDevice, stream: &CudaStream, c: usize, half: bool) -> Result<Self> {
        let named = |name: &str, group: &'static str| -> Result<Kern> {
            let f = load_function(dev, name, half)?;
            Ok(Kern { f, name: group })
        };
        let hopper = super::cuda::kernel_build(dev) == "sm90";
        let f = |name: &'static str| -> Result<Kern> {
            named(
                name,
                name.trim_end_matches("_bf16").trim_end_matches("_f32"),
            )
        };
        let sms = stream
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()?
            .max(1) as usize;
        // Row widths (256-column chunks) with a kernel of their own in kernels.cu.
        const NORM_CH: [usize; 10] = [1, 2, 3, 4, 6, 8, 10, 12, 14, 16];
        let ch = NORM_CH.into_iter().find(|&ch| ch * 256 >= c);
        let norm_v8 = if let (true, Some(ch)) = (c.is_multiple_of(8), ch) {
            // (forward, backward dx pass) blocks per SM, as kernels.cu's launch bounds give.
            let (fwd_per_sm, bwd_per_sm) = match ch {
                1..=3 => (4, 3),
                4..=8 => (2, 2),
                _ => (2, 1),
            };
            Some(NormV8 {
                fwd: named(&format!("residual_norm_v8_bf16_{ch}"), "residual_norm")?,
                bwd: named(&format!("norm_bwd_dx_v8_bf16_{ch}"), "norm_bwd")?,
                bwd_wb: named("norm_bwd_wb_v8_bf16", "norm_bwd_wb")?,
                grid: sms as u32 * fwd_per_sm,
                bwd_grid: sms as u32 * bwd_per_sm,
            })
        } else {
            None
        };
        Ok(Self {
            sms,
            cast: f("cast_multi_f32_bf16")?,
            axpy: f("axpy_multi_f32")?,
            lora_blocks: f("lora_blocks_16")?,
            embed: f("embed_fwd_bf16")?,
            residual_norm: f("residual_norm_bf16")?,
            norm_bwd: f("norm_bwd_bf16")?,
            norm_bwd_add: f("norm_bwd_add_bf16")?,
            norm_v8,
            ce: f("ce_fused_bf16")?,
            ce_reg: named("ce_fused_reg_bf16", "ce_fused")?,
            bias_act: f("bias_act_v8_bf16")?,
            gelu_bwd: f("bias_gelu_bwd_v8_bf16")?,
            col_sum: f("col_sum_v8_bf16")?,
            qkv_split: f("qkv_split_bf16")?,
            heads_merge: f("heads_merge_bf16")?,
            heads_split: f("heads_split_bf16")?,
            softmax_fwd: f("causal_softmax_fwd_bf16")?,
            softmax_bwd: f("causal_softmax_bwd_bf16")?,
            embedding_bwd: f("embedding_bwd_bf16")?,
            rope: f("rope_qkv_bf16")?,
            swiglu_fwd: f("swiglu_fwd_v8_bf16")?,
            swiglu_bwd: f("swiglu_bwd_v8_bf16")?,
            dropout_rows: f("dropout_rows_v8_bf16")?,
            nf4_dequant: f("nf4_dequant_bf16")?,
            flash64: Flash::load(&named, 64, hopper)?,
            flash128: super::cuda::flash_fits(dev, 128)
                .then(|| Flash::load(&named, 128, hopper))
                .transpose()?,
        })
    }
}

/// One parameter's place in the flat buffers (the same element offset in bf16 and f32).
struct Entry {
    /// The parameter (None: a 4-bit base matrix, `nf4`).
    var: Option<Var>,
    /// A frozen base matrix in NF4: dequantized into the step's scratch where a matmul reads
    /// it ([`GptStep::wl`]); in no buffer of the step. `nf4_ptrs`: its codes, block maxima
    /// and group scales on the device.
    nf4: Option<Arc<Nf4>>,
    nf4_ptrs: [u64; 3],
    /// Rows (a matrix's output features; a vector's length).
    rows: usize,
    off: usize,
    n: usize,
    /// A frozen weight (LoRA's base): its bf16 copy lives in the frozen buffer (`off` is
    /// there), and it has no gradient.
    frozen: bool,
    /// A frozen bf16 matrix the step reads where it is (the model's own storage, at
    /// `ext_ptr`): no copy at all. Packed projections made of such matrices run as one
    /// matmul per part ([`GptStep::lin_fwd_parts`]).
    ext: bool,
    ext_ptr: u64,
}

/// A LoRA adapter of one projection: its A `[r, inp]` and B `[out, r]` entries, the scale,
/// and the column where its output starts in the projection's (packed) output.
#[derive(Clone, Copy)]
struct LoraIdx {
    a: usize,
    b: usize,
    r: usize,
    inp: usize,
    out: usize,
    col: usize,
    scale: f32,
    /// Its first column in its group's `x·Aᵀ` ([`LORA_GROUPS`]).
    ucol: usize,
}

/// A LoRA group run as one matmul with its base projection (`kernels.lora_concat`;
/// [`GptStep::plan_lora_blocks`]): the 16-bit matrix `[W | B]` of `out` rows (the base's
/// parts' rows, then the group's block-diagonal B beside them) and its row stride `ld` = the
/// model width + the group's Σ r — also the row stride of the group's normed input, whose last
/// columns hold `u = scale·x·[A₁; A₂; …]ᵀ`. Forward `y = [x | u]·[W | B]ᵀ`, backward
/// `[dx | du] = dy·[W | B]`: no pass of the adapters' own over the projection's output.
#[derive(Clone, Copy)]
struct Cat {
    w: u64,
    ld: usize,
}

/// [`LoraIdx`] slots of a layer, in `model::LORA_TARGETS` order.
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;

/// Adapters that share their input: q, k, v (the normed block input) and gate, up (the normed
/// MLP input). A group's A matrices sit adjacent in the buffers, stacked into one
/// `[count·r, inp]` matrix, so that `u = x·[A₁; A₂; …]ᵀ`, its weight gradient and its data
/// gradient `dx += du·[A₁; A₂; …]` are one matmul each for the whole group.
const LORA_GROUPS: [&[usize]; 4] = [&[Q, K, V], &[O], &[GATE, UP], &[DOWN]];
const G_QKV: usize = 0;
const G_O: usize = 1;
const G_GU: usize = 2;
const G_DOWN: usize = 3;

/// Entry indices of one transformer layer (None: the model has no such bias). `qkv` is the
/// packed q|k|v projection, `up` the packed gate|up projection of a SwiGLU MLP (or the GELU
/// MLP's up projection).
#[derive(Clone, Copy)]
struct LayerIdx {
    ln1_w: usize,
    ln1_b: Option<usize>,
    qkv_w: usize,
    qkv_b: Option<usize>,
    o_w: usize,
    o_b: Option<usize>,
    ln2_w: usize,
    ln2_b: Option<usize>,
    up_w: usize,
    up_b: Option<usize>,
    down_w: usize,
    down_b: Option<usize>,
    lora: [Option<LoraIdx>; 7],
}

/// The flat buffers' layout as it is built: each entry's offset in the trainable buffers
/// (bf16 copy and fp32 gradient), or, while `frozen` is set, in the frozen bf16 buffer.
#[derive(Default)]
struct Layout {
    entries: Vec<Entry>,
    off: usize,
    frozen_off: usize,
    frozen: bool,
    /// Frozen 16-bit matrices pushed now are copied into the frozen buffer, not read in
    /// place (a small packed projection: [`PACK_COPY_MAX_BYTES`]).
    copy: bool,
}

/// The most bytes a packed projection (q|k|v, gate|up) of a frozen 16-bit base may have for the
/// step to keep its own copy of it as one matrix, rather than read the model's separate
/// matrices in place with one matmul each: on the Llama-style 114M (H100, cuBLASLt tuned, B8
/// T1024) q|k|v as one matmul of 1280 rows took 27.8 µs against 17.7 + 8.9 + 18.3 for its
/// three parts (its data gradient 31.4 against 44.1), gate|up 72.5 against 2 × 40.5; at the 1B
/// and 8B shapes (12–50 MB a projection) the parts are wide enough alone, and a copy of every
/// layer's would cost their memory.
const PACK_COPY_MAX_BYTES: usize = 8 << 20;

/// bf16 or fp16: the dtypes a weight the step reads in place (or copies as is) may have.
fn is_16bit(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// Device addresses of 16-bit weights in the step's own type: fp16 (`half`) or bf16.
fn ptrs_16(ts: &[&Tensor], half: bool) -> Result<Vec<u64>> {
    let want = if half { DType::F16 } else { DType::BF16 };
    if let Some(t) = ts.iter().find(|t| t.dtype() != want) {
        return Err(err(format!(
            "whole-model step: a {:?} weight for a {want:?} step",
            t.dtype()
        )));
    }
    if half {
        with_ptrs::<half::f16, _>(ts, |p| Ok(p.to_vec()))
    } else {
        with_ptrs::<bf16, _>(ts, |p| Ok(p.to_vec()))
    }
}

impl Layout {
    /// Place `v` next (aligned unless `pad` is false, which keeps it adjacent to the entry
    /// before: packed projections); its entry index.
    fn push(&mut self, v: &Var, pad: bool) -> usize {
        let n = v.as_tensor().elem_count();
        let rows = v.as_tensor().dims().first().copied().unwrap_or(1);
        let ext = self.frozen && !self.copy && is_16bit(v.dtype()) && v.rank() == 2;
        let mut nowhere = 0;
        let off = if ext {
            // (Not in any buffer: read in place.)
            &mut nowhere
        } else if self.frozen {
            &mut self.frozen_off
        } else {
            &mut self.off
        };
        if pad {
            *off = align(*off);
        }
        self.entries.push(Entry {
            var: Some(v.clone()),
            nf4: None,
            nf4_ptrs: [0; 3],
            rows,
            off: *off,
            n,
            frozen: self.frozen,
            ext,
            ext_ptr: 0,
        });
        *off += n;
        self.entries.len() - 1
    }

    /// The LoRA adapters of one group of slots ([`LORA_GROUPS`]; always trainable): their A
    /// matrices adjacent (one stacked matrix), then their B matrices; adapter `j` writes its
    /// projection's output columns from `cols[j]` on.
    fn adapters(
        &mut self,
        ls: &[Option<StepLora>; 7],
        group: &[usize],
        cols: &[usize; 7],
        slots: &mut [Option<LoraIdx>; 7],
    ) -> Result<()> {
        let frozen = std::mem::replace(&mut self.frozen, false);
        let mut ucol = 0;
        let mut shape = None;
        for &j in group {
            let Some(l) = &ls[j] else { continue };
            let (r, inp) = l.a.as_tensor().dims2()?;
            let (out, r2) = l.b.as_tensor().dims2()?;
            if r2 != r || shape.is_some_and(|s| s != (r, inp)) {
                return Err(err(format!(
                    "whole-model step: LoRA {} A is [{r}, {inp}], B [{out}, {r2}] (the adapters \
                     of one input share r)",
                    LORA_TARGETS[j]
                )));
            }
            shape = Some((r, inp));
            slots[j] = Some(LoraIdx {
                a: self.push(&l.a, ucol == 0),
                b: 0,
                r,
                inp,
                out,
                col: cols[j],
                scale: l.scale as f32,
                ucol,
            });
            ucol += r;
        }
        for &j in group {
            if let (Some(l), Some(ad)) = (&ls[j], slots[j].as_mut()) {
                ad.b = self.push(&l.b, true);
            }
        }
        self.frozen = frozen;
        Ok(())
    }

    /// A linear layer's matrix: a parameter ([`Self::push`]) or a frozen 4-bit one (in no
    /// buffer).
    fn push_mat(&mut self, m: &StepMatrix, pad: bool) -> usize {
        match m {
            StepMatrix::Var(v) => self.push(v, pad),
            StepMatrix::Nf4(q) => {
                self.entries.push(Entry {
                    var: None,
                    nf4: Some(q.clone()),
                    nf4_ptrs: [0; 3],
                    rows: q.out,
                    off: 0,
                    n: q.out * q.inp,
                    frozen: true,
                    ext: false,
                    ext_ptr: 0,
                });
                self.entries.len() - 1
            }
        }
    }

    /// `v` if there is one, aligned.
    fn push_opt(&mut self, v: &Option<Var>) -> Option<usize> {
        v.as_ref().map(|v| self.push(v, true))
    }

    /// Weights packed into one matrix (or biases into one vector): the first aligned, the
    /// rest adjacent; the first's index.
    fn pack(&mut self, vs: &[&Var]) -> usize {
        let first = self.push(vs[0], true);
        for v in &vs[1..] {
            self.push(v, false);
        }
        first
    }

    /// [`Self::pack`] of linear layers' matrices. Those of a frozen 16-bit base, which the
    /// step reads in place (apart: one matmul a part), are copied into the frozen buffer as
    /// one matrix where the projection is small ([`PACK_COPY_MAX_BYTES`]).
    fn pack_mats(&mut self, ms: &[&StepMatrix]) -> usize {
        let bytes: usize = ms
            .iter()
            .map(|m| match m {
                StepMatrix::Var(v) => 2 * v.as_tensor().elem_count(),
                StepMatrix::Nf4(_) => usize::MAX / 8,
            })
            .sum();
        self.copy = ms.len() > 1 && bytes <= PACK_COPY_MAX_BYTES;
        let first = self.push_mat(ms[0], true);
        for m in &ms[1..] {
            self.push_mat(m, false);
        }
        self.copy = false;
        first
    }

    /// The packed biases of `parts`, which must all have one or none (`what` names them).
    fn pack_biases(&mut self, parts: &[&LinearWB], what: &str) -> Result<Option<usize>> {
        let biases: Vec<&Var> = parts.iter().filter_map(|p| p.1.as_ref()).collect();
        if biases.is_empty() {
            return Ok(None);
        }
        if biases.len() != parts.len() {
            return Err(err(format!(
                "whole-model step: {what} must all have biases or none"
            )));
        }
        Ok(Some(self.pack(&biases)))
    }
}

/// Device addresses of one micro-batch size's activations (bf16 unless noted).
#[derive(Clone)]
struct Lay {
    b: usize,
    /// Per layer: residual input, LN1 out, qkv, attention probabilities [B·H, T, T],
    /// merged attention output, residual after attention, LN2 out, fc pre-activation, GELU out.
    /// (The LN outputs under a concatenated LoRA group are its `[x | u]`: [`Cat`].)
    res: Vec<u64>,
    ln1: Vec<u64>,
    qkv: Vec<u64>,
    prob: Vec<u64>,
    atty: Vec<u64>,
    mid: Vec<u64>,
    ln2: Vec<u64>,
    /// The MLP's pre-activation ([N, F], or SwiGLU's packed gate|up [N, 2F]) and activation
    /// output [N, F].
    fc: Vec<u64>,
    gelu: Vec<u64>,
    lnf: u64,
    /// One chunk of the logits: [head_rows, vpad] ([`GptStep::head_and_loss`]).
    logits: u64,
    head_rows: usize,
    // scratch, reused by every layer
    tmp: u64,
    da: u64,
    dres: u64,
    /// The MLP pre-activation's gradient (the side stream reads it; SwiGLU: [N, 2F]).
    dh: u64,
    /// SwiGLU: the activation output's gradient [N, F] (before the SwiGLU backward).
    dact: u64,
    dqkv: u64,
    heads: u64,
    yh: u64,
    dheads: u64,
    dyh: u64,
    dprob: u64,
    /// With dropout: the residual gradient through a mask [N, C] (bf16), flash attention's
    /// kept-flags per layer (u64 [B·H·T, ⌈T/64⌉]) and the micro-batch's seed (one u64).
    dmask: u64,
    mbits: Vec<u64>,
    seed: u64,
    /// LoRA: per layer and group, the adapters' `x·Aᵀ` [N, Σ r] (0: no adapter), and its
    /// gradient `du`.
    lora_u: Vec<[u64; 4]>,
    lora_du: Vec<[u64; 4]>,
    /// LoRA dropout: the adapters' dropped input (forward) and their data gradient before its
    /// mask (backward), `[N, widest adapted input]`; 0 without LoRA dropout.
    lora_x: u64,
    // f32: flash attention's per-layer log-sum-exp [B, H, T] and its backward scratch
    lse_att: Vec<u64>,
    fa_scratch: u64,
    /// f32 (mean, rstd) per row of every LayerNorm, kept from the forward for the backward:
    /// LN1 of layer l at 2l, LN2 at 2l + 1, the final LN at 2L.
    stats: Vec<u64>,
    loss: u64,
    // u32
    ids: u64,
    targets: u64,
}

struct Arena {
    _bf: CudaSlice<bf16>,
    /// The dropout seed (one u64), then the kept-flags of every layer.
    words: CudaSlice<u64>,
    f32s: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    targets: CudaSlice<u32>,
    lay: Lay,
    /// The micro-batch programs captured over this arena's buffers (dropped with it).
    graphs: Graphs,
}

/// What selects a captured micro-batch program: whether it is the step's first micro-batch
/// (its weight-gradient matmuls overwrite instead of adding) and the loss-gradient scale's
/// bits (the arena fixes everything else).
type GraphKey = (bool, u32);

/// CUDA graphs of whole micro-batches (forward and backward, a few hundred launches each),
/// replayed with one launch. A key is captured the second time it runs: the first run is
/// eager, and makes (and tunes) the matmul plans, which needs synchronising.
#[derive(Default)]
struct Graphs {
    seen: std::collections::HashSet<GraphKey>,
    ready: HashMap<GraphKey, CudaGraph>,
}

// SAFETY: a `CudaGraph` holds driver handles that are not thread-safe to use concurrently;
// the graphs live inside the step, which is not Sync and moves to the engine thread whole,
// where it alone launches them.
unsafe impl Send for Graphs {}

/// The whole-model step for one [`StepWeights`] layout. Build it once per model; it sizes
/// its activation arena for the micro-batch it is given (and re-sizes when that changes).
pub struct GptStep {
    /// fp16 instead of bf16 (the fp16 build of the kernels, fp16 cuBLAS operands).
    half: bool,
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    blas: Arc<CudaBlas>,
    /// cuBLASLt for the linear layers' matmuls, tuned per shape (None: plain cuBLAS and
    /// separate kernels throughout).
    lt: Option<Lt>,
    /// Bias and GELU (forward) and the GELU backward as cuBLASLt epilogues (else separate
    /// kernels).
    epilogues: bool,
    /// Replay micro-batches as CUDA graphs (off while profiling, which times each launch).
    graphs: bool,
    /// The second stream of the backward's weight gradients and bias sums (None: one
    /// stream; unused while profiling, which times launches on one stream).
    side: Option<Side>,
    /// Data parallel: the gradient buckets summed over the ranks while the backward runs
    /// ([`Self::set_grad_sum`]), and whether this micro-batch sums them (the step's last).
    sums: Option<Overlap>,
    sum_now: bool,
    k: Kernels,
    n_layer: usize,
    c: usize,
    n_head: usize,
    n_kv_head: usize,
    /// Head dim.
    hd: usize,
    /// Width of the packed q|k|v projection: (H + 2·KV)·hd.
    qkv_out: usize,
    /// The attention's width, n_head·head_dim (n_embd unless head_dim is explicit).
    att_c: usize,
    /// RMSNorm (else LayerNorm).
    rms: bool,
    /// SwiGLU MLP (gate|up packed), else GELU.
    swiglu: bool,
    vocab: usize,
    /// The logits' row stride: the vocabulary rounded up to 64.
    vpad: usize,
    t: usize,
    hidden: usize,
    eps: f32,
    entries: Vec<Entry>,
    by_id: HashMap<TensorId, usize>,
    wte: usize,
    wpe: Option<usize>,
    /// RoPE's rotations on the device, [T][hd/2] (cos, sin) ([`rope_table`]; None: learned
    /// positions).
    rope: Option<CudaSlice<f32>>,
    /// Flash attention (head dim 64 or 128) instead of materialised probabilities.
    flash: bool,
    layers: Vec<LayerIdx>,
    lnf: (usize, Option<usize>),
    head: Option<usize>,
    /// The trainable weights' bf16 compute copies, laid out as [`Self::grad`] is (a sharded
    /// optimizer all-gathers it in place).
    wbf: Tensor,
    wbf_p: u64,
    /// The frozen weights' bf16 copies (LoRA's base; none otherwise).
    _fbf: CudaSlice<bf16>,
    fbf_p: u64,
    /// The bf16 scratch a 4-bit base matrix is dequantized into before a matmul reads it.
    _nf4_buf: CudaSlice<bf16>,
    nf4_p: u64,
    grad: Tensor,
    grad_p: u64,
    /// Where the gradients summed from zero start (the matrices before are overwritten by
    /// the first micro-batch's weight-gradient matmuls).
    zero_from: usize,
    arena: Option<Arena>,
    /// Timing events per launch when profiling (`set_profiling`).
    prof: Option<RefCell<Vec<Mark>>>,
    /// Device copies of the cast and SCU-gradient pointer tables (reused every step).
    cast_table: Option<CudaSlice<u64>>,
    axpy_table: Option<CudaSlice<u64>>,
    /// Micro-batches since `begin` (the loss read-back divides by their tokens).
    micro: usize,
    /// Dropout: the keep threshold (0: none) and a kept element's scale ([`dropout`]).
    drop_thr: u32,
    /// What the backward recomputes instead of keeping ([`Recompute`]).
    recompute: Recompute,
    /// Rows per LM-head chunk, when set ([`Self::set_head_chunk_rows`]).
    head_chunk_rows: Option<usize>,
    drop_scale: f32,
    /// LoRA dropout on the adapters' input: keep threshold (0: none) and scale.
    lora_thr: u32,
    lora_scale: f32,
    /// LoRA: per layer and group, the group's block-diagonal B (`[out, Σ r]`, 16-bit; 0: the
    /// group's adapters run one by one), built from the adapters' B before each forward
    /// ([`Self::lora_blocks`]).
    lora_bd: Vec<[u64; 4]>,
    /// Its storage, and the device table of the blocks to copy (source, destination, rows,
    /// columns, row stride) with their count and largest size.
    _lora_bd_buf: Option<CudaSlice<bf16>>,
    lora_bd_table: Option<(CudaSlice<u64>, usize, usize)>,
    /// Per layer and group, the group's `[W | B]` where it runs concatenated ([`Cat`]; only
    /// q|k|v and gate|up), and the table copying the base's parts into them (the layout of
    /// `lora_bd_table`; at [`Self::cast_weights`]).
    lora_cat: Vec<[Option<Cat>; 4]>,
    lora_concat: bool,
    lora_cat_table: Option<(CudaSlice<u64>, usize, usize)>,
    /// Granite's multipliers (1 elsewhere): the embedding's, the attention blocks' and
    /// MLPs' outputs' before the residual add (both applied with the dropout masks of those
    /// sites), the attention score scale (1/√head_dim elsewhere) and 1/logits_scaling on the
    /// final norm's output (hence on the logits).
    emb_mult: f32,
    res_mult: f32,
    att_scale: f32,
    logit_mult: f32,
    /// The next micro-batch's dropout seed ([`Self::set_dropout_seed`]).
    drop_seed: u64,
}

/// RoPE's rotations for positions 0..t: `[t][inv_freq.len()]` pairs (cos, sin) of
/// position·inv_freq[j], as interleaved f32, the angles taken in double (their sines at
/// hundreds of radians need it).
fn rope_table(inv_freq: &[f64], t: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(2 * t * inv_freq.len());
    for p in 0..t {
        for &f in inv_freq {
            let (sin, cos) = (p as f64 * f).sin_cos();
            out.extend([cos as f32, sin as f32]);
        }
    }
    out
}

fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// The device address of a CUDA tensor's first element (it stays valid while the tensor's
/// storage lives: the step keeps the tensor).
fn tensor_ptr<T: candle_core::cuda_backend::CudaDType>(
    t: &Tensor,
    stream: &Arc<CudaStream>,
) -> Result<u64> {
    let (st, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else {
        return Err(err("a step buffer is not on the GPU"));
    };
    let v = cs.as_cuda_slice::<T>()?.slice(l.start_offset()..);
    let (p, _sync) = v.device_ptr(stream);
    Ok(p)
}

impl GptStep {
    pub fn new(w: &StepWeights) -> Result<Self> {
        let Device::Cuda(dev) = w.wte.as_tensor().device().clone() else {
            return Err(err("the whole-model step needs a CUDA device"));
        };
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let (vocab, c) = w.wte.as_tensor().dims2()?;
        let k = Kernels::load(&dev, &stream, c, w.half)?;
        let t = w.seq_len;
        let first = w
            .layers
            .first()
            .ok_or_else(|| err("the whole-model step needs at least one layer"))?;
        let hidden = first.up.0.rows()?;
        let swiglu = first.gate.is_some();
        let (n_head, n_kv_head) = (w.n_head, w.n_kv_head);
        // The heads' width comes from the q projection: n_head·head_dim, which an explicit
        // head_dim (Mistral-Nemo-like) sets apart from n_embd.
        let att_c = first.q.0.rows()?;
        if n_head == 0 || att_c % n_head != 0 || !(att_c / n_head).is_multiple_of(2) {
            return Err(err(format!(
                "whole-model step: the q projection's {att_c} outputs must split into n_head \
                 {n_head} heads of even size"
            )));
        }
        let hd = att_c / n_head;
        let flash = w.flash && super::spec::FLASH_HEAD_DIMS.contains(&hd);
        if att_c != c && !flash {
            return Err(err(format!(
                "whole-model step: heads {n_head}×{hd} wider or narrower than n_embd {c} need \
                 flash attention (head dim 64 or 128)"
            )));
        }
        if n_kv_head == 0 || n_head % n_kv_head != 0 || (n_kv_head != n_head && !flash) {
            return Err(err(format!(
                "whole-model step: {n_kv_head} key/value heads for {n_head} heads of size {hd} \
                 (grouped-query attention needs flash attention: head dim 64 or 128)"
            )));
        }
        if w.dropout > 0.0 && !flash {
            return Err(err(format!(
                "whole-model step: dropout needs flash attention (head dim 64 or 128, not {hd})"
            )));
        }
        if !c.is_multiple_of(8) || !hidden.is_multiple_of(8) {
            return Err(err(format!(
                "whole-model step: n_embd {c} and the MLP width {hidden} must be multiples of 8"
            )));
        }
        // First the matrices whose gradient a weight-gradient matmul writes first in every
        // step (it overwrites: no zeroing), then everything whose gradient is summed from
        // zero (biases, norms, positions, an untied embedding): only that tail is cleared.
        // q|k|v (and a SwiGLU MLP's gate|up) are packed: one matrix, one matmul.
        // A frozen base (LoRA) goes to the frozen buffer instead; its adapters are the
        // trainable matrices.
        let mut lay = Layout {
            frozen: w.frozen_base,
            ..Layout::default()
        };
        let tied = w.head.is_none();
        let wte_first = tied.then(|| lay.push(&w.wte, true));
        let (h_out, kv_out) = (n_head * hd, n_kv_head * hd);
        let up_col = if swiglu { hidden } else { 0 };
        let mut mats: Vec<([usize; 4], [Option<LoraIdx>; 7])> = Vec::new();
        for l in &w.layers {
            let qkv = lay.pack_mats(&[&l.q.0, &l.k.0, &l.v.0]);
            let o = lay.push_mat(&l.o.0, true);
            let up = match &l.gate {
                Some(g) => lay.pack_mats(&[&g.0, &l.up.0]),
                None => lay.push_mat(&l.up.0, true),
            };
            let down = lay.push_mat(&l.down.0, true);
            let cols = [0, h_out, h_out + kv_out, 0, 0, up_col, 0];
            let mut lora = [None; 7];
            for group in LORA_GROUPS {
                lay.adapters(&l.lora, group, &cols, &mut lora)?;
            }
            mats.push(([qkv, o, up, down], lora));
        }
        let head = w.head.as_ref().map(|v| lay.push(v, true));
        // (Every trainable entry after the matrices starts aligned: the tail from here on.)
        let zero_from = align(lay.off);
        let wte = match wte_first {
            Some(i) => i,
            None => lay.push(&w.wte, true),
        };
        let wpe = w.wpe.as_ref().map(|v| lay.push(v, true));
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, ([qkv_w, o_w, up_w, down_w], lora)) in w.layers.iter().zip(mats) {
            if l.gate.is_some() != swiglu {
                return Err(err("whole-model step: every layer needs the same MLP"));
            }
            let ln1_w = lay.push(&l.ln1.0, true);
            let ln1_b = lay.push_opt(&l.ln1.1);
            let qkv_b = lay.pack_biases(&[&l.q, &l.k, &l.v], "q, k and v")?;
            let o_b = lay.push_opt(&l.o.1);
            let ln2_w = lay.push(&l.ln2.0, true);
            let ln2_b = lay.push_opt(&l.ln2.1);
            let up_b = match &l.gate {
                Some(g) => lay.pack_biases(&[g, &l.up], "gate and up")?,
                None => lay.push_opt(&l.up.1),
            };
            layers.push(LayerIdx {
                ln1_w,
                ln1_b,
                qkv_w,
                qkv_b,
                o_w,
                o_b,
                ln2_w,
                ln2_b,
                up_w,
                up_b,
                down_w,
                down_b: lay.push_opt(&l.down.1),
                lora,
            });
        }
        let lnf = (lay.push(&w.ln_f.0, true), lay.push_opt(&w.ln_f.1));
        // (A multiple of the ranks' aligned ranges, for a sharded optimizer's reduce-scatter.)
        let total = lay.off.max(1).div_ceil(ALIGN * w.shards.max(1)) * ALIGN * w.shards.max(1);
        let frozen_total = align(lay.frozen_off);
        let mut entries = lay.entries;
        // Frozen bf16 matrices are read where the model keeps them.
        let ext: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].ext).collect();
        let ts: Vec<&Tensor> = ext
            .iter()
            .filter_map(|&i| entries[i].var.as_ref().map(Var::as_tensor))
            .collect();
        // (A frozen base is stored in the step's own 16-bit type: bf16, or fp16 for an fp16 step.)
        let ptrs = ptrs_16(&ts, w.half)?;
        for (&i, p) in ext.iter().zip(ptrs) {
            entries[i].ext_ptr = p;
        }
        // 4-bit base matrices: their parts' addresses, and one bf16 scratch of the largest,
        // which each matmul through one of them dequantizes into first (on the main stream,
        // which alone reads base weights).
        let mut nf4_len = 0;
        for e in entries.iter_mut() {
            let Some(q) = &e.nf4 else { continue };
            let codes = with_ptrs::<u8, _>(&[&q.codes, &q.absq], |p| Ok([p[0], p[1]]))?;
            let gscale = with_f32_ptrs(&[&q.gscale], |p| Ok(p[0]))?;
            e.nf4_ptrs = [codes[0], codes[1], gscale];
            nf4_len = nf4_len.max(e.n);
        }
        // SAFETY: written by the dequantization before each read.
        let nf4_buf = unsafe { dev.alloc::<bf16>(nf4_len.max(1))? };
        let nf4_p = ptr(&nf4_buf, &stream);
        // (Written by the cast kernel or the fused update before every read.)
        let wbf = Tensor::zeros(total, DType::BF16, &Device::Cuda(dev.clone()))?;
        let wbf_p = tensor_ptr::<bf16>(&wbf, &stream)?;
        // SAFETY: likewise (cast whenever the trainable copies are).
        let fbf = unsafe { dev.alloc::<bf16>(frozen_total.max(ALIGN))? };
        let fbf_p = ptr(&fbf, &stream);
        let grad = Tensor::zeros(total, DType::F32, &Device::Cuda(dev.clone()))?;
        let grad_p = tensor_ptr::<f32>(&grad, &stream)?;
        let by_id = entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.var.as_ref().map(|v| (v.as_tensor().id(), i)))
            .collect();
        let rope = match &w.rope_inv_freq {
            Some(f) if f.len() == hd / 2 => Some(stream.clone_htod(&rope_table(f, t)).w()?),
            Some(f) => {
                return Err(err(format!(
                    "whole-model step: {} RoPE frequencies for head dim {hd}",
                    f.len()
                )))
            }
            None => None,
        };
        let mut lt = Lt::new(stream.clone(), w.autotune, w.half).ok();
        // The second stream needs its own cuBLASLt workspace; without either, one stream.
        // Recompute rewrites shared activation buffers that the side stream's weight
        // gradients would still be reading: one stream then.
        let overlap = w.overlap && w.recompute == Recompute::None;
        let side = match (overlap, lt.as_mut()) {
            (true, Some(lt)) => lt.enable_side().and_then(|()| Side::new(&stream)).ok(),
            _ => None,
        };
        let mut step = Self {
            half: w.half,
            dev,
            stream,
            blas,
            lt,
            epilogues: w.epilogues,
            graphs: w.graphs,
            side,
            sums: None,
            sum_now: false,
            k,
            n_layer: layers.len(),
            c,
            n_head,
            n_kv_head,
            hd,
            att_c,
            qkv_out: (n_head + 2 * n_kv_head) * hd,
            rms: w.rms,
            swiglu,
            rope,
            flash,
            vocab,
            vpad: vocab.div_ceil(64) * 64,
            t,
            hidden,
            eps: w.eps as f32,
            entries,
            by_id,
            wte,
            wpe,
            layers,
            lnf,
            head,
            wbf,
            wbf_p,
            _fbf: fbf,
            fbf_p,
            _nf4_buf: nf4_buf,
            nf4_p,
            grad,
            grad_p,
            zero_from,
            arena: None,
            prof: None,
            cast_table: None,
            axpy_table: None,
            micro: 0,
            drop_thr: dropout::threshold(w.dropout),
            recompute: w.recompute,
            head_chunk_rows: None,
            drop_scale: dropout::keep_scale(dropout::threshold(w.dropout)),
            emb_mult: w.embedding_multiplier as f32,
            res_mult: w.residual_multiplier as f32,
            att_scale: w.attention_scale as f32,
            logit_mult: (1.0 / w.logits_scaling) as f32,
            lora_thr: dropout::threshold(w.lora_dropout),
            lora_scale: dropout::keep_scale(dropout::threshold(w.lora_dropout)),
            lora_bd: Vec::new(),
            _lora_bd_buf: None,
            lora_bd_table: None,
            lora_cat: Vec::new(),
            lora_concat: w.lora_concat,
            lora_cat_table: None,
            drop_seed: 0,
        };
        step.plan_lora_blocks()?;
        Ok(step)
    }

    /// The output width of LoRA group `g`'s projection (the row stride of its output).
    fn group_out(&self, g: usize) -> usize {
        match g {
            G_QKV => self.qkv_out,
            G_GU if self.swiglu => 2 * self.hidden,
            G_GU => self.hidden,
            _ => self.c,
        }
    }

    /// The base's matrices under LoRA group `g` — q|k|v or gate|up (or the GELU MLP's up) —
    /// as their first entry and how many; None for o and down.
    fn group_parts(&self, li: &LayerIdx, g: usize) -> Option<(usize, usize)> {
        match g {
            G_QKV => Some((li.qkv_w, 3)),
            G_GU => Some((li.up_w, 1 + self.swiglu as usize)),
            _ => None,
        }
    }

    /// Whether group `g` of a layer (its adapters `ads`) runs as one `[W | B]` matmul with its
    /// base ([`Cat`]): asked for (`kernels.lora_concat`), q|k|v or gate|up, adapters of one
    /// scale whose Σ r is a multiple of 8 (16-byte rows), a frozen 16-bit base with nothing of
    /// it training (a weight gradient would want `x` alone), and the rows-in-registers norms
    /// (which write and read the strided rows).
    fn concat_ok(&self, li: &LayerIdx, g: usize, ads: &[LoraIdx]) -> bool {
        let Some((first, count)) = self.group_parts(li, g) else {
            return false;
        };
        let bias = if g == G_QKV { li.qkv_b } else { li.up_b };
        self.lora_concat
            && self.k.norm_v8.is_some()
            && !ads.is_empty()
            && ads.iter().all(|ad| ad.scale == ads[0].scale)
            && lora_width(li, g).is_multiple_of(8)
            && (first..first + count).all(|i| {
                let e = &self.entries[i];
                e.frozen && e.nf4.is_none() && self.gt(i).is_none()
            })
            && self.gb(bias) == 0
    }

    /// Lay out the groups' B matrices: a group that runs concatenated ([`Self::concat_ok`])
    /// gets its `[W | B]` ([`Cat`]; the base's parts copied in by [`Self::cast_weights`]);
    /// every other group of two or more adapters of one scale (q, k, v; gate, up) its
    /// block-diagonal B, one zeroed `[out, Σ r]` matrix. A table says where each adapter's B
    /// goes ([`Self::lora_blocks`]).
    fn plan_lora_blocks(&mut self) -> Result<()> {
        let c = self.c;
        let (mut at, mut cats) = (Vec::new(), Vec::new());
        // (source entry, element offset, rows, columns, row stride)
        let (mut blocks, mut parts) = (Vec::new(), Vec::new());
        let mut len = 0;
        for li in &self.layers {
            let (mut offs, mut cat) = ([None; 4], [None; 4]);
            for g in 0..LORA_GROUPS.len() {
                let ads: Vec<LoraIdx> = LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]).collect();
                let width = lora_width(li, g);
                // (Concatenated: the base's columns first.)
                let (ld, c0) = match self.group_parts(li, g) {
                    Some((first, count)) if self.concat_ok(li, g, &ads) => {
                        let mut row = 0;
                        for i in first..first + count {
                            let rows = self.entries[i].rows;
                            parts.push((i, len + row * (c + width), rows, c, c + width));
                            row += rows;
                        }
                        debug_assert_eq!(row, self.group_out(g));
                        cat[g] = Some((len, c + width));
                        (c + width, c)
                    }
                    _ if ads.len() < 2 || ads.iter().any(|ad| ad.scale != ads[0].scale) => continue,
                    _ => {
                        offs[g] = Some(len);
                        (width, 0)
                    }
                };
                for ad in &ads {
                    blocks.push((ad.b, len + ad.col * ld + c0 + ad.ucol, ad.out, ad.r, ld));
                }
                len = align(len + self.group_out(g) * ld);
            }
            at.push(offs);
            cats.push(cat);
        }
        if blocks.is_empty() {
            self.lora_bd = vec![[0; 4]; at.len()];
            self.lora_cat = vec![[None; 4]; at.len()];
            return Ok(());
        }
        // The base's copy is made where it takes at most a quarter of the device memory free
        // now; otherwise (or where it does not fit after all) every group beside its base.
        let free = self
            .stream
            .context()
            .mem_get_info()
            .map_or(usize::MAX, |m| m.0);
        if !parts.is_empty() && 2 * len > free / 4 {
            self.lora_concat = false;
            return self.plan_lora_blocks();
        }
        let buf = match self.dev.alloc_zeros::<bf16>(len) {
            Ok(buf) => buf,
            Err(_) if !parts.is_empty() => {
                self.lora_concat = false;
                return self.plan_lora_blocks();
            }
            Err(e) => return Err(e),
        };
        let base = ptr(&buf, &self.stream);
        let at_base = |o: usize| base + 2 * o as u64;
        self.lora_bd = at
            .iter()
            .map(|offs| offs.map(|o| o.map_or(0, at_base)))
            .collect();
        self.lora_cat = cats
            .iter()
            .map(|cat| {
                cat.map(|o| {
                    o.map(|(off, ld)| Cat {
                        w: at_base(off),
                        ld,
                    })
                })
            })
            .collect();
        let table = |items: &[(usize, usize, usize, usize, usize)]| -> Result<_> {
            if items.is_empty() {
                return Ok(None);
            }
            let words: Vec<u64> = items
                .iter()
                .flat_map(|&(src, off, rows, cols, ld)| {
                    [
                        self.w(src),
                        at_base(off),
                        rows as u64,
                        cols as u64,
                        ld as u64,
                    ]
                })
                .collect();
            let mut dev_table = self.dev.alloc_zeros::<u64>(words.len())?;
            self.stream.memcpy_htod(&words, &mut dev_table).w()?;
            let max_n = items.iter().map(|b| b.2 * b.3).max().unwrap_or(1);
            Ok(Some((dev_table, items.len(), max_n)))
        };
        let bd_table = table(&blocks)?;
        let cat_table = table(&parts)?;
        self._lora_bd_buf = Some(buf);
        self.lora_bd_table = bd_table;
        self.lora_cat_table = cat_table;
        Ok(())
    }

    /// Group `g` of layer `l` as one matmul with its base, if it runs so ([`Cat`]).
    fn cat(&self, l: usize, g: usize) -> Option<Cat> {
        self.lora_cat.get(l).and_then(|c| c[g])
    }

    /// The row stride of group `g`'s normed input in layer `l`: the model width, or the
    /// `[x | u]` rows of a concatenated group.
    fn ln_ld(&self, l: usize, g: usize) -> usize {
        self.cat(l, g).map_or(self.c, |c| c.ld)
    }

    /// Copy every adapter's B (its bf16 copy as the optimizer last wrote it) into its
    /// group's block-diagonal matrix ([`Self::plan_lora_blocks`]); nothing without one.
    fn lora_blocks(&self) -> Result<()> {
        self.copy_blocks(&self.lora_bd_table)
    }

    /// One launch of the block copy over a table of (source, destination, rows, columns,
    /// destination row stride) items ([`Self::plan_lora_blocks`]); nothing without one.
    fn copy_blocks(&self, table: &Option<(CudaSlice<u64>, usize, usize)>) -> Result<()> {
        let Some((table, count, max_n)) = table else {
            return Ok(());
        };
        let table = ptr(table, &self.stream);
        self.launch(
            &self.k.lora_blocks,
            multi_grid(*max_n, *count)?,
            &[Arg::P(table)],
        )
    }

    fn w(&self, i: usize) -> u64 {
        let e = &self.entries[i];
        if e.ext {
            return e.ext_ptr;
        }
        // (A 4-bit matrix has no bf16 address of its own: [`Self::wl`]; null faults loudly.)
        debug_assert!(e.nf4.is_none(), "a 4-bit matrix read without wl()");
        if e.nf4.is_some() {
            return 0;
        }
        (if e.frozen { self.fbf_p } else { self.wbf_p }) + 2 * e.off as u64
    }

    /// A linear layer's matrix for a matmul launched next on the main stream: its bf16
    /// address, after dequantizing it into the scratch when it is a 4-bit base matrix.
    fn wl(&self, i: usize) -> Result<u64> {
        let e = &self.entries[i];
        if e.nf4.is_none() {
            return Ok(self.w(i));
        }
        let [codes, absq, gscale] = e.nf4_ptrs;
        let n8 = e.n / 8;
        self.launch(
            &self.k.nf4_dequant,
            LaunchConfig {
                grid_dim: (n8.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::P(codes),
                Arg::P(absq),
                Arg::P(gscale),
                Arg::P(self.nf4_p),
                Arg::L(n8 as i64),
            ],
        )?;
        Ok(self.nf4_p)
    }

    /// The fp32 gradient of a trainable entry (callers skip frozen ones: [`Self::gt`]).
    fn g(&self, i: usize) -> u64 {
        self.grad_p + 4 * self.entries[i].off as u64
    }

    /// The gradient address of entry `i` if it trains (None: frozen).
    fn gt(&self, i: usize) -> Option<u64> {
        (!self.entries[i].frozen).then(|| self.g(i))
    }

    /// The flat fp32 gradient buffer every [`Self::grad_of`] is a view of (data parallelism
    /// reduces it in place, in one call).
    pub fn grad_buffer(&self) -> Option<&Tensor> {
        Some(&self.grad)
    }

    /// The fp32 gradient of `var` (a view of the flat buffer), if the step owns it.
    pub fn grad_of(&self, var: &Var) -> Result<Option<Tensor>> {
        let Some(&i) = self.by_id.get(&var.as_tensor().id()) else {
            return Ok(None);
        };
        let e = &self.entries[i];
        if e.frozen {
            return Ok(None);
        }
        Ok(Some(
            self.grad
                .narrow(0, e.off, e.n)?
                .reshape(var.as_tensor().dims())?,
        ))
    }

    fn launch(&self, k: &Kern, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        self.launch_on(&self.stream, k, cfg, args)
    }

    /// [`Self::launch`] on `stream` (the step's, or the side stream).
    fn launch_on(
        &self,
        stream: &Arc<CudaStream>,
        k: &Kern,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        self.timed(k.name, || {
            let mut b = stream.launch_builder(&k.f);
            for a in args {
                match a {
                    Arg::P(p) => b.arg(p),
                    Arg::I(i) => b.arg(i),
                    Arg::U(u) => b.arg(u),
                    Arg::F(x) => b.arg(x),
                    Arg::L(x) => b.arg(x),
                };
            }
            // SAFETY: every call site passes the argument list of its kernel in kernels.cu,
            // with addresses inside this step's live buffers.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        })
    }

    /// Run `f` (launches on the stream) between two timing events when profiling.
    fn timed(&self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let Some(prof) = &self.prof else {
            return f();
        };
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timing).w()?;
        f()?;
        let end = self.stream.record_event(timing).w()?;
        prof.borrow_mut().push((name, start, end));
        Ok(())
    }

    /// Data parallel: sum the gradients over the ranks with `sum` while the backward runs,
    /// bucket by bucket from the top layer down (see `reduce.rs`), in the micro-batches
    /// [`Self::set_grad_sum_now`] names. The step then runs its launches eagerly (no CUDA
    /// graphs: the sums sit on another communicator's stream); `bf16`: summed in bf16.
    pub fn set_grad_sum(
        &mut self,
        sum: Box<dyn crate::distributed::GradSum>,
        bucket_mb: f64,
        bf16: bool,
    ) -> Result<()> {
        let min_len = ((bucket_mb * 1e6 / 4.0) as usize).max(1);
        let runs: Vec<Vec<(usize, usize)>> =
            self.layers.iter().map(|li| self.layer_runs(li)).collect();
        let plan = buckets::plan(&runs, self.grad.elem_count(), min_len);
        tracing::info!(
            buckets = plan.len(),
            bucket_mb,
            "gradient sums overlap the backward"
        );
        let wire = bf16.then(|| self.grad.elem_count());
        self.sums = Some(Overlap::new(sum, &self.dev, &self.stream, plan, wire)?);
        self.graphs = false;
        Ok(())
    }

    /// Whether the gradient sums run inside the step ([`Self::set_grad_sum`]).
    pub fn overlaps_grad_sums(&self) -> bool {
        self.sums.is_some()
    }

    /// Whether the next micro-batches sum the gradients over the ranks (the optimizer
    /// step's last micro-batch does).
    pub fn set_grad_sum_now(&mut self, on: bool) {
        self.sum_now = on;
    }

    /// Layer `li`'s gradient runs in the flat buffer as (start, end) element offsets: its
    /// trainable matrices and adapters, and its norms and biases in the zeroed tail.
    fn layer_runs(&self, li: &LayerIdx) -> Vec<(usize, usize)> {
        let mut ids = vec![li.qkv_w, li.o_w, li.up_w, li.down_w, li.ln1_w, li.ln2_w];
        ids.extend(
            [li.ln1_b, li.qkv_b, li.o_b, li.ln2_b, li.up_b, li.down_b]
                .into_iter()
                .flatten(),
        );
        ids.extend(li.lora.iter().flatten().flat_map(|ad| [ad.a, ad.b]));
        let (mut head, mut tail) = (None::<(usize, usize)>, None::<(usize, usize)>);
        for i in ids {
            let e = &self.entries[i];
            if e.frozen || e.ext || self.gt(i).is_none() {
                continue;
            }
            let (s, end) = (e.off, e.off + e.n);
            let run = if s < self.zero_from {
                &mut head
            } else {
                &mut tail
            };
            *run = Some(run.map_or((s, end), |(a, b)| (a.min(s), b.max(end))));
        }
        [head, tail].into_iter().flatten().collect()
    }

    /// Enqueue the gradient sums of the buckets due after layer `after`'s backward (None:
    /// after the whole backward, which then also waits for them); nothing unless this
    /// micro-batch sums.
    fn send_sums(&self, after: Option<usize>) -> Result<()> {
        let Some(sums) = self.sums.as_ref().filter(|_| self.sum_now) else {
            return Ok(());
        };
        for b in sums.buckets.iter().filter(|b| b.after == after) {
            sums.send(b, self.grad_p, self.side())?;
        }
        if after.is_none() {
            sums.join()?;
        }
        Ok(())
    }

    /// Time every launch with CUDA events from now on (for `cockpit bench --profile`; the
    /// events cost a little, so a normal run leaves this off).
    pub fn set_profiling(&mut self, on: bool) {
        self.prof = on.then(|| RefCell::new(Vec::new()));
    }

    /// The GPU time per kernel group since the last call (waits for the GPU); empty when
    /// profiling is off.
    pub fn take_profile(&self) -> Result<Vec<KernelTime>> {
        let Some(prof) = &self.prof else {
            return Ok(Vec::new());
        };
        let marks = std::mem::take(&mut *prof.borrow_mut());
        self.stream.synchronize().w()?;
        let mut out: Vec<KernelTime> = Vec::new();
        for (name, start, end) in &marks {
            let ms = start.elapsed_ms(end).w()? as f64;
            match out.iter_mut().find(|k| k.name == *name) {
                Some(k) => {
                    k.ms += ms;
                    k.launches += 1;
                }
                None => out.push(KernelTime {
                    name: name.to_string(),
                    ms,
                    launches: 1,
                }),
            }
        }
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(out)
    }

    /// `C = op(A)·op(B) (+ beta·C)` column-major, bf16 operands, fp32 accumulation; C in
    /// fp32 (weight gradients) or bf16; `batch > 1` strides every operand.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        name: &'static str,
        t: (bool, bool),
        mnk: (usize, usize, usize),
        a: Mat,
        b: Mat,
        c: Mat,
        c_f32: bool,
        beta: f32,
        batch: usize,
    ) -> Result<()> {
        self.gemm_ab(name, t, mnk, (a, b, c), c_f32, (1.0, beta), batch)
    }

    /// [`Self::gemm`] with `C = alpha·op(A)·op(B) + beta·C`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ab(
        &self,
        name: &'static str,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, b, c): (Mat, Mat, Mat),
        c_f32: bool,
        (alpha, beta): (f32, f32),
        batch: usize,
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let bf = if self.half {
            bsys::cudaDataType::CUDA_R_16F
        } else {
            bsys::cudaDataType::CUDA_R_16BF
        };
        let ct = if c_f32 {
            bsys::cudaDataType::CUDA_R_32F
        } else {
            bf
        };
        let (m, n, k) = (i32_of(m, "m")?, i32_of(n, "n")?, i32_of(k, "k")?);
        let h = *self.blas.handle();
        let algo = bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
        let compute = bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let alpha_p = &alpha as *const f32 as *const _;
        let beta_p = &beta as *const f32 as *const _;
        // SAFETY: the operands are device addresses inside this step's buffers, sized by the
        // caller for these shapes; the handle is bound to this device's stream.
        self.timed(name, || {
            let r = unsafe {
                if batch > 1 {
                    blas::gemm_strided_batched_ex(
                        h,
                        op(ta),
                        op(tb),
                        m,
                        n,
                        k,
                        alpha_p,
                        a.p as *const _,
                        bf,
                        a.ld,
                        a.stride,
                        b.p as *const _,
                        bf,
                        b.ld,
                        b.stride,
                        beta_p,
                        c.p as *mut _,
                        ct,
                        c.ld,
                        c.stride,
                        i32_of(batch, "batch")?,
                        compute,
                        algo,
                    )
                } else {
                    blas::gemm_ex(
                        h,
                        op(ta),
                        op(tb),
                        m,
                        n,
                        k,
                        alpha_p,
                        a.p as *const _,
                        bf,
                        a.ld,
                        b.p as *const _,
                        bf,
                        b.ld,
                        beta_p,
                        c.p as *mut _,
                        ct,
                        c.ld,
                        compute,
                        algo,
                    )
                }
            };
            r.map_err(|e| err(format!("cuBLAS gemm: {e:?}")))
        })
    }

    /// One linear layer's matmul (bf16 operands, C in fp32 or bf16): cuBLASLt's tuned
    /// algorithm, on `side` if given, or cuBLAS where cuBLASLt has none (on the step's
    /// stream, which is as well ordered: after the operands are written, before anything
    /// overwrites them).
    fn lin_gemm(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        beta: f32,
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        self.lin_gemm_ab(name, mm, c_f32, (1.0, beta), side)
    }

    /// [`Self::lin_gemm`] with `C = alpha·op(A)·op(B) + beta·C`.
    fn lin_gemm_ab(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        ab: (f32, f32),
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        if self.lt_matmul(name, mm, c_f32, ab, Epi::None, side)? {
            return Ok(());
        }
        let m = |o: Operand| mat(o.p, o.ld);
        let (a, b, c) = (m(mm.a), m(mm.b), m(mm.c));
        self.gemm_ab(name, mm.t, mm.mnk, (a, b, c), c_f32, ab, 1)
    }

    /// `y[rows, out] = x[rows, inp]·wᵀ` (row-major; `ldy` ≥ out).
    fn lin_fwd(&self, x: u64, w: u64, y: u64, d: Lin) -> Result<()> {
        self.lin_fwd_beta(x, w, y, d, 0.0)
    }

    /// [`Self::lin_fwd`] plus `beta`·y (1: on top of the adapters' share).
    fn lin_fwd_beta(&self, x: u64, w: u64, y: u64, d: Lin, beta: f32) -> Result<()> {
        self.lin_gemm("matmul fwd", d.fwd(x, w, y), false, beta, None)
    }

    /// `dx[rows, inp] = dy[rows, out]·w`.
    fn lin_dx(&self, dy: u64, w: u64, dx: u64, d: Lin) -> Result<()> {
        self.lin_dx_beta(dy, w, dx, d, 0.0)
    }

    /// [`Self::lin_dx`] plus `beta`·dx (1: on top of the adapters' share).
    fn lin_dx_beta(&self, dy: u64, w: u64, dx: u64, d: Lin, beta: f32) -> Result<()> {
        self.lin_gemm("matmul dgrad", d.dx(dy, w, dx), false, beta, None)
    }

    /// `dw[out, inp] += dyᵀ·x` into fp32; the step's first micro-batch overwrites instead
    /// (`first`: the buffer is not zeroed, and C is not read).
    fn lin_dw(&self, x: u64, dy: u64, dw: u64, d: Lin, first: bool) -> Result<()> {
        self.lin_dw_on(None, x, dy, dw, d, first)
    }

    /// [`Self::lin_dw`] queued on `side` when there is one ([`Self::lin_gemm`]).
    fn lin_dw_on(
        &self,
        side: Option<&Arc<CudaStream>>,
        x: u64,
        dy: u64,
        dw: u64,
        d: Lin,
        first: bool,
    ) -> Result<()> {
        let beta = if first { 0.0 } else { 1.0 };
        self.lin_gemm("matmul wgrad", d.dw(x, dy, dw), true, beta, side)
    }

    /// The side stream, after it waits for the main stream's work so far ([`Side::fork`]);
    /// None when there is none or profiling is on.
    fn fork(&self) -> Result<Option<&Arc<CudaStream>>> {
        match self.side() {
            Some(s) => s.fork().map(Some),
            None => Ok(None),
        }
    }

    fn side(&self) -> Option<&Side> {
        self.side.as_ref().filter(|_| self.prof.is_none())
    }

    /// [`Side::release`] (nothing without a side stream).
    fn release(&self, buf: Buf) -> Result<()> {
        self.side().map_or(Ok(()), |s| s.release(buf))
    }

    /// [`Side::reclaim`] (nothing without a side stream).
    fn reclaim(&self, buf: Buf) -> Result<()> {
        self.side().map_or(Ok(()), |s| s.reclaim(buf))
    }

    /// One linear layer's matmul through cuBLASLt with an epilogue. Ok(false): epilogues
    /// off, no cuBLASLt or no algorithm for it; nothing ran.
    fn lin_lt(&self, name: &'static str, mm: Mm, c_f32: bool, beta: f32, epi: Epi) -> Result<bool> {
        if !self.epilogues {
            return Ok(false);
        }
        self.lt_matmul(name, mm, c_f32, (1.0, beta), epi, None)
    }

    /// [`Lt::matmul`], timed under `name`. Ok(false): no cuBLASLt or no algorithm for it.
    fn lt_matmul(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        ab: (f32, f32),
        epi: Epi,
        side: Option<&Arc<CudaStream>>,
    ) -> Result<bool> {
        let Some(lt) = &self.lt else {
            return Ok(false);
        };
        let mut done = false;
        self.timed(name, || {
            done = lt.matmul(mm, c_f32, ab, epi, side.map(|s| &**s))?;
            Ok(())
        })?;
        Ok(done)
    }

    /// [`Self::lin_fwd_beta`] with a bias (+ GELU) epilogue.
    fn lin_fwd_epi(&self, x: u64, w: u64, y: u64, d: Lin, epi: Epi, beta: f32) -> Result<bool> {
        let name = match epi {
            Epi::GeluAuxBias { .. } => "matmul fwd+bias+gelu",
            _ => "matmul fwd+bias",
        };
        self.lin_lt(name, d.fwd(x, w, y), false, beta, epi)
    }

    /// The grid of the column-sum kernels over `[n, c]` (blocks of 32 × 8 threads, 256
    /// columns each): about two blocks per multiprocessor in all, enough loads in flight (a
    /// few rows per thread) and few atomics per column.
    fn col_grid(&self, n: usize, c: usize) -> LaunchConfig {
        let col_blocks = c.div_ceil(256);
        let row_blocks = (2 * self.k.sms / col_blocks)
            .clamp(1, n.div_ceil(8).max(1))
            .min(65535);
        LaunchConfig {
            grid_dim: (col_blocks as u32, row_blocks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out[c] += Σ_rows x[r, c]` (fp32; c a multiple of 8).
    fn col_sum(&self, x: u64, out: u64, n: usize, c: usize) -> Result<()> {
        self.col_sum_on(&self.stream, x, out, n, c)
    }

    /// [`Self::col_sum`] on `stream` (the step's, or the side stream).
    fn col_sum_on(
        &self,
        stream: &Arc<CudaStream>,
        x: u64,
        out: u64,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let cfg = self.col_grid(n, c);
        self.launch_on(
            stream,
            &self.k.col_sum,
            cfg,
            &[
                Arg::P(x),
                Arg::P(out),
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(c, "cols")?),
            ],
        )
    }

    /// The norm backward (LayerNorm or RMSNorm) of rows `x` with the weight and bias entries
    /// `(w, b)`, from the forward's row statistics `stats` (which the v8 kernels need):
    /// dx (+)= …, the weight (and bias) gradients accumulate. Where `bias_grad` is non-zero
    /// and the v8 kernels run, `bias_grad += Σ_rows dx` too (the residual stream's gradient
    /// is the bias gradient of the linear layer that wrote into it): Ok(true) says so.
    #[allow(clippy::too_many_arguments)]
    fn norm_bwd(
        &self,
        x: u64,
        (w, b): (usize, Option<usize>),
        (dy, ldg): (u64, usize),
        dx: u64,
        stats: u64,
        n: usize,
        add: bool,
        bias_grad: u64,
    ) -> Result<bool> {
        let d = self.c;
        let (n_i, d_i) = (i32_of(n, "rows")?, i32_of(d, "dim")?);
        let ldg_i = i32_of(ldg, "row stride")?;
        let (dw, db) = (self.gt(w).unwrap_or(0), self.gb(b));
        let rms = Arg::I(self.rms as i32);
        if let Some(v8) = &self.k.norm_v8 {
            // Two passes: dx with 16-byte accesses and rows in registers, then the column
            // sums (the forward's statistics in both).
            let cfg = LaunchConfig {
                grid_dim: (v8.bwd_grid.min(n.div_ceil(8).max(1) as u32), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [
                Arg::P(x),
                Arg::P(self.w(w)),
                Arg::P(dy),
                Arg::P(dx),
                Arg::P(stats),
                Arg::I(n_i),
                Arg::I(d_i),
                Arg::F(self.eps),
                Arg::I(add as i32),
                rms,
                Arg::I(ldg_i),
            ];
            self.launch(&v8.bwd, cfg, &args)?;
            let args = [
                Arg::P(x),
                Arg::P(dy),
                Arg::P(dx),
                Arg::P(stats),
                Arg::P(dw),
                Arg::P(db),
                Arg::P(bias_grad),
                Arg::I(n_i),
                Arg::I(d_i),
                Arg::I(ldg_i),
            ];
            if dw != 0 || db != 0 || bias_grad != 0 {
                self.launch(&v8.bwd_wb, self.col_grid(n, d), &args)?;
            }
            return Ok(bias_grad != 0);
        }
        // (Strided rows only come with the rows-in-registers kernels: [`Self::concat_ok`].)
        if ldg != d {
            return Err(err(
                "whole-model step: a strided norm gradient without the v8 kernels",
            ));
        }
        let args = [
            Arg::P(x),
            Arg::P(self.w(w)),
            Arg::P(dy),
            Arg::P(dx),
            Arg::P(dw),
            Arg::P(db),
            Arg::I(n_i),
            Arg::I(d_i),
            Arg::F(self.eps),
            rms,
        ];
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(8).clamp(1, 264) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (2 * d * 4) as u32,
        };
        let k = if add {
            &self.k.norm_bwd_add
        } else {
            &self.k.norm_bwd
        };
        self.launch(k, cfg, &args)?;
        Ok(false)
    }

    /// Size (or re-size) the activation arena for micro-batch `b`.
    /// Rows per chunk of the LM head ([`Self::head_and_loss`]) for `n` rows: the logits chunk
    /// stays under 256 MiB (a trained head re-reads and re-writes its fp32 gradient once per
    /// chunk; smaller chunks also make smaller matmuls).
    fn head_rows(&self, n: usize) -> usize {
        if let Some(rows) = self.head_chunk_rows {
            return rows.clamp(1, n);
        }
        let limit = 256 << 20;
        let per_row = 2 * self.vpad;
        let chunks = (n * per_row).div_ceil(limit).max(1);
        // Whole chunks of 64 rows (tensor-core tiles), at least one row.
        n.div_ceil(chunks).next_multiple_of(64).clamp(1, n)
    }

    fn ensure(&mut self, b: usize) -> Result<()> {
        if self.arena.as_ref().is_some_and(|a| a.lay.b == b) {
            return Ok(());
        }
        self.arena = None;
        let (l, c, t, f) = (self.n_layer, self.c, self.t, self.hidden);
        let n = b * t;
        let nc = n * c;
        // Materialised attention keeps [B·H, T, T] probabilities per layer; flash attention
        // keeps none (a [B, H, T] log-sum-exp in f32 instead).
        let probs = if self.flash {
            0
        } else {
            b * self.n_head * t * t
        };
        let heads_len = if self.flash { 0 } else { 3 * nc };
        let mut next = 0usize;
        let mut take = |len: usize| {
            let o = next;
            next += align(len);
            o
        };
        // A projection's input is kept for the backward only where a gradient needs it (its
        // weight trains, or an adapter sits on it); elsewhere (a frozen LoRA base) every
        // layer writes it into one shared buffer.
        let keep = |w: fn(&LayerIdx) -> usize, ad: &[usize]| -> Vec<bool> {
            self.layers
                .iter()
                .map(|li| self.gt(w(li)).is_some() || ad.iter().any(|&j| li.lora[j].is_some()))
                .collect()
        };
        // Recompute: the attention half's activations (and with "full" the MLP half's) are
        // rewritten in the backward, one layer at a time, into shared buffers.
        let attn_kept = self.recompute == Recompute::None;
        let mlp_kept = self.recompute != Recompute::Full;
        let and = |v: Vec<bool>, k: bool| v.into_iter().map(|x| x && k).collect::<Vec<_>>();
        let keep_ln1 = and(keep(|li| li.qkv_w, &[Q, K, V]), attn_kept);
        let keep_ln2 = and(keep(|li| li.up_w, &[GATE, UP]), mlp_kept);
        let keep_act = and(keep(|li| li.down_w, &[DOWN]), mlp_kept);
        let attn_layers = vec![attn_kept; l];
        let mlp_layers = vec![mlp_kept; l];
        let mut per_if = |len: usize, keep: &[bool]| {
            let mut shared = None;
            keep.iter()
                .map(|&k| {
                    if k {
                        take(len)
                    } else {
                        *shared.get_or_insert_with(|| take(len))
                    }
                })
                .collect::<Vec<_>>()
        };
        let all_layers = vec![true; l];
        // (A concatenated LoRA group's normed input is `[x | u]`, rows `ld` apart: [`Cat`].)
        let ld_max = |g: usize| (0..l).map(|i| self.ln_ld(i, g)).max().unwrap_or(c);
        let (ld1, ld2) = (ld_max(G_QKV), ld_max(G_GU));
        let res_o = per_if(nc, &all_layers);
        let ln1_o = per_if(n * ld1, &keep_ln1);
        let qkv_o = per_if(n * self.qkv_out, &attn_layers);
        let prob_o = per_if(probs, &attn_layers);
        let nac = n * self.att_c;
        let atty_o = per_if(nac, &attn_layers);
        let mid_o = per_if(nc, &mlp_layers);
        let ln2_o = per_if(n * ld2, &keep_ln2);
        // SwiGLU keeps the packed gate|up pre-activation [N, 2F].
        let up_out = if self.swiglu { 2 * f } else { f };
        let fc_o = per_if(n * up_out, &mlp_layers);
        let gelu_o = per_if(n * f, &keep_act);
        let res_last = take(nc);
        let lnf = take(nc);
        let head_rows = self.head_rows(n);
        let logits = take(head_rows * self.vpad);
        let tmp = take(nc);
        // (d atty [N, n_head·head_dim], the other [N, C] gradients, a concatenated LoRA
        // group's [dx | du])
        let da = take(nc.max(nac).max(n * ld1.max(ld2)));
        let dres = take(nc);
        let dh = take(n * up_out);
        let dact = take(if self.swiglu { n * f } else { 0 });
        let dqkv = take(n * self.qkv_out);
        let heads = take(heads_len);
        let yh = take(heads_len / 3);
        let dheads = take(heads_len);
        let dyh = take(heads_len / 3);
        let dprob = take(probs);
        let drop = self.drop_thr > 0;
        let dmask = take(if self.res_scaled() { nc } else { 0 });
        // LoRA: each layer's and group's x·[A₁; A₂; …]ᵀ [N, Σr] (kept for the backward) and its
        // gradient du (per layer too: the side stream's dA reads it while the backward goes on);
        // a concatenated group keeps them in its input's and `da`'s last columns instead.
        let (mut lora_u, mut lora_du) = (Vec::new(), Vec::new());
        for (i, li) in self.layers.iter().enumerate() {
            let (mut u, mut du) = ([None; 4], [None; 4]);
            for (g, (ug, dug)) in u.iter_mut().zip(du.iter_mut()).enumerate() {
                let w = lora_width(li, g);
                if w > 0 && self.cat(i, g).is_none() {
                    *ug = Some(take(n * w));
                    *dug = Some(take(n * w));
                }
            }
            lora_u.push(u);
            lora_du.push(du);
        }
        let xmax = self
            .layers
            .iter()
            .flat_map(|li| li.lora.iter().flatten().map(|ad| ad.inp))
            .max()
            .unwrap_or(0);
        let lora_x = take(if self.lora_thr > 0 { n * xmax } else { 0 });
        let bf_len = next;
        // f32: the loss accumulator [N], then (flash) the per-layer attention
        // log-sum-exp [B·H·T] and the backward scratch (dq accumulator [N·C] + delta [B·H·T]).
        let bht = if self.flash { b * self.n_head * t } else { 0 };
        let f_lse_att = align(n);
        let f_scratch = f_lse_att + l * align(bht);
        let f_stats = f_scratch
            + if self.flash {
                align(nac) + align(bht)
            } else {
                0
            };
        let f_len = f_stats + (2 * l + 1) * align(2 * n);
        // SAFETY: every activation is written before it is read within a micro-batch.
        let bf = unsafe { self.dev.alloc::<bf16>(bf_len)? };
        let f32s = self.dev.alloc_zeros::<f32>(f_len)?;
        // u64 words: the seed, then each layer's kept-flags (aligned to 16 words).
        let nkt = t.div_ceil(64);
        let bits_len = if drop {
            (b * self.n_head * t * nkt).div_ceil(16) * 16
        } else {
            0
        };
        let words = self.dev.alloc_zeros::<u64>(16 + l * bits_len)?;
        let wbase = ptr(&words, &self.stream);
        let ids = self.dev.alloc_zeros::<u32>(n)?;
        let targets = self.dev.alloc_zeros::<u32>(n)?;
        let base = ptr(&bf, &self.stream);
        let fbase = ptr(&f32s, &self.stream);
        let at = |o: usize| base + 2 * o as u64;
        let all = |v: &[usize]| v.iter().map(|&o| at(o)).collect::<Vec<_>>();
        let mut res = all(&res_o);
        res.push(at(res_last));
        let lay = Lay {
            b,
            res,
            ln1: all(&ln1_o),
            qkv: all(&qkv_o),
            prob: all(&prob_o),
            atty: all(&atty_o),
            mid: all(&mid_o),
            ln2: all(&ln2_o),
            fc: all(&fc_o),
            gelu: all(&gelu_o),
            lnf: at(lnf),
            logits: at(logits),
            head_rows,
            tmp: at(tmp),
            da: at(da),
            dres: at(dres),
            dh: at(dh),
            dact: at(dact),
            dqkv: at(dqkv),
            heads: at(heads),
            yh: at(yh),
            dheads: at(dheads),
            dyh: at(dyh),
            dprob: at(dprob),
            dmask: at(dmask),
            lora_u: lora_u.iter().map(|u| u.map(|o| o.map_or(0, at))).collect(),
            lora_du: lora_du.iter().map(|u| u.map(|o| o.map_or(0, at))).collect(),
            lora_x: if self.lora_thr > 0 { at(lora_x) } else { 0 },
            mbits: (0..l)
                .map(|i| wbase + 8 * (16 + i * bits_len) as u64)
                .collect(),
            seed: wbase,
            lse_att: (0..l)
                .map(|i| fbase + 4 * (f_lse_att + i * align(bht)) as u64)
                .collect(),
            fa_scratch: fbase + 4 * f_scratch as u64,
            stats: (0..2 * l + 1)
                .map(|i| fbase + 4 * (f_stats + i * align(2 * n)) as u64)
                .collect(),
            loss: fbase,
            ids: ptr(&ids, &self.stream),
            targets: ptr(&targets, &self.stream),
        };
        self.arena = Some(Arena {
            _bf: bf,
            words,
            f32s,
            ids,
            targets,
            lay,
            graphs: Graphs::default(),
        });
        Ok(())
    }

    /// Copy a pointer table into its persistent device buffer (allocated once; the
    /// pointers are re-read every step, as a resume may swap a weight's storage).
    fn upload_table(&mut self, host: &[u64], axpy: bool) -> Result<u64> {
        let slot = if axpy {
            &mut self.axpy_table
        } else {
            &mut self.cast_table
        };
        if slot.as_ref().is_none_or(|t| t.len() != host.len()) {
            *slot = Some(self.dev.alloc_zeros::<u64>(host.len())?);
        }
        let buf = slot.as_mut().ok_or_else(|| err("pointer table"))?;
        self.stream.memcpy_htod(host, buf).w()?;
        Ok(ptr(buf, &self.stream))
    }

    /// The bf16 compute copy of `var` (None if the step does not own it), for the fused
    /// AdamW to write the updated weight into.
    pub fn weight_copy(&self, var: &Var) -> Option<WeightCopy<'_>> {
        if self.half {
            // The fused AdamW writes bf16 copies; an fp16 step casts its own in `begin`.
            return None;
        }
        let &i = self.by_id.get(&var.as_tensor().id())?;
        Some(WeightCopy {
            addr: self.w(i),
            _step: std::marker::PhantomData,
        })
    }

    /// [`Self::weight_copy`] from element `at` of `var` on (a sharded optimizer's piece).
    pub fn weight_copy_at(&self, var: &Var, at: usize) -> Option<WeightCopy<'_>> {
        let &i = self.by_id.get(&var.as_tensor().id())?;
        (at < self.entries[i].n).then_some(())?;
        let mut c = self.weight_copy(var)?;
        c.addr += 2 * at as u64;
        Some(c)
    }

    /// The flat bf16 buffer of every trainable weight's compute copy, at the gradient
    /// buffer's offsets ([`Self::grad_buffer`]), for a sharded optimizer's all-gather; None
    /// for an fp16 step (which casts its own copies).
    pub fn weight_buffer(&self) -> Option<&Tensor> {
        (!self.half).then_some(&self.wbf)
    }

    /// How many weights the step computes with (each has a bf16 copy).
    pub fn weight_count(&self) -> usize {
        self.entries.iter().filter(|e| !e.frozen).count()
    }

    /// fp32 master weights → the bf16 copies, one multi-tensor launch.
    /// A base stored in bf16 (LoRA on the GPU: the model's `BaseStore`) is
    /// copied as is.
    fn cast_weights(&mut self) -> Result<()> {
        let (f32s, h16s): (Vec<usize>, Vec<usize>) = (0..self.entries.len())
            .filter(|&i| !self.entries[i].ext && self.entries[i].var.is_some())
            .partition(|&i| {
                self.entries[i]
                    .var
                    .as_ref()
                    .is_some_and(|v| !is_16bit(v.dtype()))
            });
        let ts: Vec<&Tensor> = h16s
            .iter()
            .filter_map(|&i| self.entries[i].var.as_ref().map(Var::as_tensor))
            .collect();
        let ptrs = ptrs_16(&ts, self.half)?;
        for (&src, &i) in ptrs.iter().zip(&h16s) {
            // SAFETY: both hold entries[i].n 16-bit values of the step's type (the source
            // is the live var, contiguous).
            unsafe {
                drv::memcpy_dtod_async(
                    self.w(i),
                    src,
                    2 * self.entries[i].n,
                    self.stream.cu_stream(),
                )
            }
            .w()?;
        }
        // The concatenated LoRA groups' base columns ([`Cat`]), from the copies just made or
        // the model's own storage.
        self.copy_blocks(&self.lora_cat_table)?;
        if f32s.is_empty() {
            return Ok(());
        }
        let ts: Vec<&Tensor> = f32s
            .iter()
            .filter_map(|&i| self.entries[i].var.as_ref().map(Var::as_tensor))
            .collect();
        let table = with_f32_ptrs(&ts, |ptrs| {
            let mut table = Vec::with_capacity(3 * ptrs.len());
            for (p, &i) in ptrs.iter().zip(&f32s) {
                table.extend([*p, self.w(i), self.entries[i].n as u64]);
            }
            Ok(table)
        })?;
        let table = self.upload_table(&table, false)?;
        let max_n = f32s.iter().map(|&i| self.entries[i].n).max().unwrap_or(1);
        let count = f32s.len();
        self.timed(self.k.cast.name, || {
            let mut b = self.stream.launch_builder(&self.k.cast.f);
            b.arg(&table);
            // SAFETY: the table holds (f32 source, bf16 destination, length) triples matching
            // the kernel's MultiItem; sources are the live master weights, destinations in wbf.
            unsafe { b.launch(multi_grid(max_n, count)?) }.w()?;
            Ok(())
        })?;
        Ok(())
    }

    /// Start an optimizer step: cast the fp32 masters into the bf16 buffer (unless the last
    /// fused AdamW already wrote them there and nothing changed the weights since), zero the
    /// gradients and the loss accumulator.
    pub fn begin(&mut self, weights_copied: bool) -> Result<()> {
        if !weights_copied {
            self.cast_weights()?;
        }
        let start = self.grad_p + 4 * self.zero_from as u64;
        let bytes = (self.grad.elem_count() - self.zero_from) * 4;
        // SAFETY: from `zero_from` on, the live fp32 gradient buffer holds `bytes` bytes.
        unsafe { drv::memset_d8_async(start, 0, bytes, self.stream.cu_stream()) }.w()?;
        if let Some(a) = &self.arena {
            let n = a.lay.b * self.t;
            // SAFETY: the loss accumulator holds n f32.
            unsafe { drv::memset_d8_async(a.lay.loss, 0, n * 4, self.stream.cu_stream()) }.w()?;
        }
        self.micro = 0;
        Ok(())
    }

    /// Forward and backward of one micro-batch `[b, T]` of token ids and targets; gradients
    /// add into the fp32 buffer scaled by `g` per token (1/(tokens·accum) for a mean loss).
    pub fn micro(&mut self, inputs: &[u32], targets: &[u32], b: usize, g: f32) -> Result<()> {
        let had = self.arena.as_ref().map(|a| a.lay.b);
        self.ensure(b)?;
        if had != Some(b) {
            // A fresh arena: its loss accumulator must start from zero for this step.
            if self.micro > 0 {
                return Err(err(
                    "whole-model step: micro-batch size changed inside an optimizer step",
                ));
            }
            self.zero_loss()?;
        }
        let n = b * self.t;
        if inputs.len() != n || targets.len() != n {
            return Err(err(format!(
                "whole-model step: a micro-batch of {b}×{} needs {n} ids and targets",
                self.t
            )));
        }
        {
            let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
            self.stream.memcpy_htod(inputs, &mut a.ids).w()?;
            self.stream.memcpy_htod(targets, &mut a.targets).w()?;
            if self.drop_thr > 0 {
                // (Read by the kernels from the device: a replayed graph draws new masks.)
                let mut seed = a.words.slice_mut(0..1);
                self.stream.memcpy_htod(&[self.drop_seed], &mut seed).w()?;
            }
        }
        self.run_micro(self.micro == 0, g)?;
        self.micro += 1;
        Ok(())
    }

    /// The forward and backward of the arena's micro-batch: a replay of its captured graph,
    /// a capture (the key's second run), or eager launches.
    fn run_micro(&mut self, first: bool, g: f32) -> Result<()> {
        let key = (first, g.to_bits());
        let replay = self.graphs && self.prof.is_none();
        let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
        if replay {
            if let Some(graph) = a.graphs.ready.get(&key) {
                return graph.launch().w();
            }
        }
        // (The layout is cloned only off the replay path: `fwd_bwd` borrows the step.)
        let lay = a.lay.clone();
        if !replay || a.graphs.seen.insert(key) {
            return self.fwd_bwd(&lay, g, first);
        }
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(mode).w()?;
        let run = self.fwd_bwd(&lay, g, first);
        // End the capture whatever happened, so the stream is usable again.
        let flags = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = self.stream.end_capture(flags);
        run?;
        match graph.w()? {
            Some(graph) => {
                graph.launch().w()?;
                if let Some(a) = self.arena.as_mut() {
                    a.graphs.ready.insert(key, graph);
                }
                Ok(())
            }
            // Nothing was captured: run it eagerly, and keep doing so.
            None => {
                self.graphs = false;
                self.fwd_bwd(&lay, g, first)
            }
        }
    }

    /// The dropout seed of the next micro-batches ([`dropout::micro_seed`]: the candle model
    /// draws the same masks from it).
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.drop_seed = seed;
    }

    /// Rows per chunk of the LM head (None: sized by memory, [`Self::head_rows`]); takes
    /// effect with the next arena (tests use it to split small batches).
    pub fn set_head_chunk_rows(&mut self, rows: Option<usize>) {
        self.head_chunk_rows = rows;
        self.arena = None;
    }

    /// How many micro-batch graphs the current arena holds (for tests and diagnostics).
    pub fn graphs_captured(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.graphs.ready.len())
    }

    fn fwd_bwd(&self, lay: &Lay, g: f32, first: bool) -> Result<()> {
        self.forward(lay, g, first, true)?;
        self.backward(lay, first)
    }

    fn zero_loss(&self) -> Result<()> {
        if let Some(a) = &self.arena {
            let n = a.lay.b * self.t;
            // SAFETY: the loss accumulator holds n f32.
            unsafe { drv::memset_d8_async(a.lay.loss, 0, n * 4, self.stream.cu_stream()) }.w()?;
        }
        Ok(())
    }

    /// The step's mean loss over every token of every micro-batch since [`Self::begin`]
    /// (one read-back; waits for the GPU).
    pub fn loss(&self) -> Result<f64> {
        let v = self.token_losses()?;
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        Ok(sum / (v.len() * self.micro.max(1)) as f64)
    }

    /// The loss accumulator, one sum per token row of the arena (one read-back).
    fn token_losses(&self) -> Result<Vec<f32>> {
        let a = self
            .arena
            .as_ref()
            .ok_or_else(|| err("no micro-batch ran"))?;
        let n = a.lay.b * self.t;
        let rows = a
            .f32s
            .try_slice(0..n)
            .ok_or_else(|| err("loss accumulator out of range"))?;
        self.stream.clone_dtoh(&rows).w()
    }

    /// Each sequence's mean loss in one batch `[b, T]`, by the forward alone (evaluation:
    /// no dropout, no gradient; the LM head's backward is skipped), between optimizer steps:
    /// it reuses the loss accumulator, so read the step's [`Self::loss`] first. The bf16
    /// copies are cast first unless `weights_current` (the last fused AdamW wrote them).
    pub fn eval_losses(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        b: usize,
        weights_current: bool,
    ) -> Result<Vec<f64>> {
        let n = b * self.t;
        if inputs.len() != n || targets.len() != n {
            return Err(err(format!(
                "whole-model step: a batch of {b}×{} needs {n} ids and targets",
                self.t
            )));
        }
        if !weights_current {
            self.cast_weights()?;
        }
        self.ensure(b)?;
        self.zero_loss()?;
        let lay = {
            let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
            self.stream.memcpy_htod(inputs, &mut a.ids).w()?;
            self.stream.memcpy_htod(targets, &mut a.targets).w()?;
            a.lay.clone()
        };
        let thr = std::mem::replace(&mut self.drop_thr, 0);
        let lora_thr = std::mem::replace(&mut self.lora_thr, 0);
        let run = self.forward(&lay, 0.0, false, false);
        self.drop_thr = thr;
        self.lora_thr = lora_thr;
        run?;
        // The loss accumulator holds each token's loss: a mean per sequence.
        let v = self.token_losses()?;
        self.zero_loss()?;
        // (A step's accumulation ends here: the next starts with `begin`.)
        self.micro = 0;
        Ok(v.chunks(self.t)
            .map(|row| row.iter().map(|&x| x as f64).sum::<f64>() / self.t as f64)
            .collect())
    }

    /// `grad(var) += a·var` for each var (the SCU regulariser's gradient), one launch.
    pub fn add_scaled_weights(&mut self, vars: &[&Var], a: f64) -> Result<()> {
        let pieces: Vec<(&Var, usize, usize)> = vars
            .iter()
            .map(|v| (*v, 0, v.as_tensor().elem_count()))
            .collect();
        self.add_scaled_pieces(&pieces, a)
    }

    /// [`Self::add_scaled_weights`] over pieces `(var, first element, elements)` of the
    /// weights (a sharded optimizer's own range).
    pub fn add_scaled_pieces(&mut self, pieces: &[(&Var, usize, usize)], a: f64) -> Result<()> {
        let mut items = Vec::new();
        for &(v, at, n) in pieces {
            match self.by_id.get(&v.as_tensor().id()) {
                Some(&i) if !self.entries[i].frozen && at + n <= self.entries[i].n && n > 0 => {
                    items.push((i, at, n))
                }
                _ => {}
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let ts: Vec<&Tensor> = items
            .iter()
            .filter_map(|&(i, _, _)| self.entries[i].var.as_ref().map(Var::as_tensor))
            .collect();
        let table = with_f32_ptrs(&ts, |ptrs| {
            let mut table = Vec::with_capacity(3 * ptrs.len());
            for (p, &(i, at, n)) in ptrs.iter().zip(&items) {
                let skip = 4 * at as u64;
                table.extend([*p + skip, self.g(i) + skip, n as u64]);
            }
            Ok(table)
        })?;
        let table = self.upload_table(&table, true)?;
        let max_n = items.iter().map(|&(_, _, n)| n).max().unwrap_or(1);
        let a = a as f32;
        self.timed(self.k.axpy.name, || {
            let mut b = self.stream.launch_builder(&self.k.axpy.f);
            b.arg(&table);
            b.arg(&a);
            // SAFETY: the table holds (f32 weight, f32 gradient, length) triples matching the
            // kernel's AxpyItem, all live buffers.
            unsafe { b.launch(multi_grid(max_n, items.len())?) }.w()?;
            Ok(())
        })
    }

    /// The bf16 address of an optional entry (0: none; the kernels take null as absent).
    fn wb(&self, i: Option<usize>) -> u64 {
        i.map_or(0, |i| self.w(i))
    }

    /// The fp32 gradient address of an optional entry (0: none, or frozen).
    fn gb(&self, i: Option<usize>) -> u64 {
        i.and_then(|i| self.gt(i)).unwrap_or(0)
    }

    /// `y = x·wᵀ (+ b)`: the bias as a cuBLASLt epilogue where it runs, else a bias kernel.
    /// Whether the `count` entries from `first` (a packed projection's parts) are one
    /// matrix in memory — not so for a frozen base read in place ([`Entry::ext`]).
    fn packed(&self, (first, count): (usize, usize)) -> bool {
        count == 1 || !(self.entries[first].ext || self.entries[first].nf4.is_some())
    }

    /// [`Self::lin_fwd_bias`] of a packed projection (`parts`: its first entry and how many):
    /// one matmul, or one per part into its columns of `y` when the parts lie apart.
    /// `beta` 1: add to what `y` holds (the adapters' share, [`Self::lora_fwd`]).
    #[allow(clippy::too_many_arguments)]
    fn lin_fwd_parts(
        &self,
        x: u64,
        parts: (usize, usize),
        b: Option<usize>,
        y: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        if self.packed(parts) {
            return self.lin_fwd_bias(x, self.wl(parts.0)?, b, y, d, beta);
        }
        let mut col = 0;
        for i in parts.0..parts.0 + parts.1 {
            let out = self.entries[i].rows;
            let part = Lin::new(d.rows, d.inp, out, d.ldy);
            self.lin_fwd_beta(x, self.wl(i)?, y + 2 * col as u64, part, beta)?;
            col += out;
        }
        if let Some(b) = b {
            self.bias_act(y, self.w(b), y, d.rows, d.out, 0)?;
        }
        Ok(())
    }

    /// [`Self::lin_dx`] of a packed projection: the parts' data gradients summed (one
    /// matmul when they are one matrix); `beta` 1: added to what `dx` holds (the adapters'
    /// share, [`Self::lora_bwd`]).
    fn lin_dx_parts(
        &self,
        dy: u64,
        parts: (usize, usize),
        dx: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        if self.packed(parts) {
            return self.lin_dx_beta(dy, self.wl(parts.0)?, dx, d, beta);
        }
        let mut col = 0;
        for (k, i) in (parts.0..parts.0 + parts.1).enumerate() {
            let out = self.entries[i].rows;
            let mm = Lin::new(d.rows, d.inp, out, d.ldy).dx(dy + 2 * col as u64, self.wl(i)?, dx);
            let beta = if k == 0 { beta } else { 1.0 };
            self.lin_gemm("matmul dgrad", mm, false, beta, None)?;
            col += out;
        }
        Ok(())
    }

    /// `y = x·wᵀ (+ b)` (`wp`: the matrix's address), `beta` as [`Self::lin_fwd_beta`]'s.
    fn lin_fwd_bias(
        &self,
        x: u64,
        wp: u64,
        b: Option<usize>,
        y: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        let Some(b) = b else {
            return self.lin_fwd_beta(x, wp, y, d, beta);
        };
        let bias = Epi::Bias { bias: self.w(b) };
        if !self.lin_fwd_epi(x, wp, y, d, bias, beta)? {
            self.lin_fwd_beta(x, wp, y, d, beta)?;
            self.bias_act(y, self.w(b), y, d.rows, d.out, 0)?;
        }
        Ok(())
    }

    /// The MLP's up projection and activation of layer `l`: `fc[l]` (the pre-activation,
    /// which the backward needs) and `gelu[l]` (the activation's output).
    fn mlp_act_fwd(&self, a: &Lay, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c, f) = (a.b * self.t, self.c, self.hidden);
        if self.swiglu {
            // gate|up = ln2·[Wg; Wu]ᵀ (+ b) as one matmul, then h = silu(gate)·up.
            let gu = Lin::new(n, c, 2 * f, 2 * f);
            self.group_fwd(a, (l, li, G_GU), a.ln2[l], li.up_b, a.fc[l], gu)?;
            return self.launch(
                &self.k.swiglu_fwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(a.gelu[l]),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                ],
            );
        }
        let up = Lin::new(n, c, f, f);
        match li.up_b {
            Some(up_b) if li.lora[UP].is_none() => {
                let gelu = Epi::GeluAuxBias {
                    bias: self.w(up_b),
                    aux: a.fc[l],
                    ld: f,
                };
                if self.lin_fwd_epi(a.ln2[l], self.wl(li.up_w)?, a.gelu[l], up, gelu, 0.0)? {
                    return Ok(());
                }
            }
            _ => {}
        }
        // fc = ln2·Wupᵀ + b (+ the adapter): the pre-activation the backward reads, bias
        // included (as the epilogue's aux), then gelu(fc).
        self.group_fwd(a, (l, li, G_GU), a.ln2[l], li.up_b, a.fc[l], up)?;
        self.bias_act(a.fc[l], 0, a.gelu[l], n, f, 1)
    }

    /// The forward of LoRA group `g` of layer `l` ([`LORA_GROUPS`]; nothing without an
    /// adapter), before the base's matmul: `u = x·[A₁; A₂; …]ᵀ` in one matmul (kept for the
    /// backward), then each adapter's `y[:, col..] = scale·u_k·B_kᵀ` into the projection's
    /// output of row stride `ldy`, the columns no adapter covers zeroed. Returns the beta of
    /// the base's matmul: 1 (add onto that: cuBLAS reads y in its epilogue, where a read of
    /// its own after the base would cost a pass over the output) or 0 (no adapter).
    #[allow(clippy::too_many_arguments)]
    fn lora_fwd(
        &self,
        a: &Lay,
        l: usize,
        li: &LayerIdx,
        g: usize,
        x: u64,
        y: u64,
        ldy: usize,
    ) -> Result<f32> {
        let width = lora_width(li, g);
        let Some(first) = group_first(li, g) else {
            return Ok(0.0);
        };
        let n = a.b * self.t;
        let u = a.lora_u[l][g];
        let down = Lin::new(n, first.inp, width, width);
        let (x, _) = self.lora_input(a, l, g, (x, first.inp), first.inp)?;
        self.mm("lora.xa", down.fwd(x, self.w(first.a), u), false, 1.0, 0.0)?;
        // The group's adapters sit on its output in column order (q, k, v; gate, up): the
        // gaps between them are the columns to zero.
        let zero = |start: usize, end: usize| -> Result<()> {
            if start == end {
                return Ok(());
            }
            // SAFETY: columns start..end ≤ ldy of y's n rows (row pitch ldy) lie inside y;
            // the memset is queued on the step's stream, which owns y.
            unsafe { memset_cols(y + 2 * start as u64, ldy, end - start, n, &self.stream) }
        };
        let bd = self.lora_bd[l][g];
        if bd != 0 {
            debug_assert_eq!(ldy, self.group_out(g));
            // Every adapter at once, through the block-diagonal B: y = scale·u·Bᵀ.
            let up = Lin::new(n, width, ldy, ldy);
            self.mm("lora.ub", up.fwd(u, bd, y), false, first.scale, 0.0)?;
            return Ok(1.0);
        }
        let mut at = 0;
        for ad in LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]) {
            debug_assert!(ad.col >= at && ad.col + ad.out <= ldy);
            zero(at, ad.col)?;
            at = ad.col + ad.out;
            let up = Lin::new(n, ad.r, ad.out, ldy).ldx(width);
            let (u, y) = (u + 2 * ad.ucol as u64, y + 2 * ad.col as u64);
            self.mm("lora.ub", up.fwd(u, self.w(ad.b), y), false, ad.scale, 0.0)?;
        }
        zero(at, ldy)?;
        Ok(1.0)
    }

    /// The backward of LoRA group `g` of layer `l` (nothing without an adapter), from the
    /// projection output's gradient `dy` (row stride `ldy`, in the scratch `buf`), before the
    /// base's data gradient: du_k = scale·dy·B_k (one matmul through the group's block-diagonal
    /// B where it has one), the weight gradients dB_k (+)= scale·dyᵀ·u_k and dA (+)= duᵀ·x —
    /// on the side stream where there is one: they read only `dy` (released after) and what
    /// stays put until the pass ends (this layer's u, du and x) — and `dx = du·[A₁; A₂; …]`
    /// into the input's gradient. Returns the beta of the base's data-gradient matmul (1: add
    /// onto that; 0: no adapter).
    #[allow(clippy::too_many_arguments)]
    fn lora_bwd(
        &self,
        a: &Lay,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        (dy, buf): (u64, Buf),
        ldy: usize,
        dx: u64,
        first: bool,
    ) -> Result<f32> {
        let width = lora_width(li, g);
        let Some(a0) = group_first(li, g) else {
            return Ok(0.0);
        };
        let n = a.b * self.t;
        let (u, du) = (a.lora_u[l][g], a.lora_du[l][g]);
        let beta = if first { 0.0 } else { 1.0 };
        let ads = || LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]);
        // The adapter's columns of dy, u and du, and its shape.
        let part = |ad: LoraIdx| {
            let up = Lin::new(n, ad.r, ad.out, ldy).ldx(width);
            let at = |p: u64, col: usize| p + 2 * col as u64;
            (up, at(dy, ad.col), at(u, ad.ucol), at(du, ad.ucol))
        };
        let bd = self.lora_bd[l][g];
        if bd != 0 {
            debug_assert_eq!(ldy, self.group_out(g));
            let up = Lin::new(n, width, ldy, ldy);
            self.mm("lora.du", up.dx(dy, bd, du), false, a0.scale, 0.0)?;
        } else {
            for ad in ads() {
                let (up, dy, _, du) = part(ad);
                self.mm("lora.du", up.dx(dy, self.w(ad.b), du), false, ad.scale, 0.0)?;
            }
        }
        // (LoRA dropout's dropped input is a scratch shared by every group: one stream then.)
        let side = if self.lora_thr == 0 {
            self.fork()?
        } else {
            None
        };
        for ad in ads() {
            let (up, dy, u, _) = part(ad);
            let mm = up.dw(u, dy, self.g(ad.b));
            self.mm_on("lora.db", mm, (ad.scale, beta), side)?;
        }
        let down = Lin::new(n, a0.inp, width, width);
        let (xd, _) = self.lora_input(a, l, g, (x, a0.inp), a0.inp)?;
        self.mm_on("lora.da", down.dw(xd, du, self.g(a0.a)), (1.0, beta), side)?;
        if side.is_some() {
            self.release(buf)?;
        }
        if self.lora_thr == 0 {
            self.mm("lora.dx", down.dx(du, self.w(a0.a), dx), false, 1.0, 0.0)?;
            return Ok(1.0);
        }
        // dx = mask ⊙ (du·[A₁; A₂; …]), through the scratch that held the dropped input.
        self.mm(
            "lora.dx",
            down.dx(du, self.w(a0.a), a.lora_x),
            false,
            1.0,
            0.0,
        )?;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        self.drop_scaled(a, (a.lora_x, dx), (n, a0.inp), site, drop, false)?;
        Ok(1.0)
    }

    /// The adapters' input of group `g` of layer `l`: `x` itself (rows `ldx` apart), or with
    /// LoRA dropout `x` through its mask into the `lora_x` scratch (`[N, inp]`, dense); the
    /// address and its row stride.
    fn lora_input(
        &self,
        a: &Lay,
        l: usize,
        g: usize,
        (x, ldx): (u64, usize),
        inp: usize,
    ) -> Result<(u64, usize)> {
        if self.lora_thr == 0 {
            return Ok((x, ldx));
        }
        let n = a.b * self.t;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        let io = ((x, ldx), (a.lora_x, inp));
        self.drop_scaled_ld(a, io, (n, inp), site, drop, false)?;
        Ok((a.lora_x, inp))
    }

    /// The projection of LoRA group `g` (q|k|v, or gate|up / the GELU MLP's up) of layer `l`
    /// from its normed input `x` into `y` (`d`: its shape), the bias `b` included: one
    /// `[x | u]·[W | B]ᵀ` after `u` where the group runs concatenated ([`Cat`]), else the
    /// adapters' share ([`Self::lora_fwd`]) and the base's matmul onto it.
    fn group_fwd(
        &self,
        a: &Lay,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        b: Option<usize>,
        y: u64,
        d: Lin,
    ) -> Result<()> {
        let (Some(cat), Some(a0)) = (self.cat(l, g), group_first(li, g)) else {
            let parts = self
                .group_parts(li, g)
                .ok_or_else(|| err("whole-model step: no projection under a LoRA group"))?;
            let beta = self.lora_fwd(a, l, li, g, x, y, d.ldy)?;
            return self.lin_fwd_parts(x, parts, b, y, d, beta);
        };
        let n = a.b * self.t;
        let width = cat.ld - self.c;
        // u = scale·x·[A₁; A₂; …]ᵀ into x's last columns (kept there for the backward).
        let (xa, ldx) = self.lora_input(a, l, g, (x, cat.ld), a0.inp)?;
        let down = Lin::new(n, a0.inp, width, cat.ld).ldx(ldx);
        let u = x + 2 * self.c as u64;
        self.mm(
            "lora.xa",
            down.fwd(xa, self.w(a0.a), u),
            false,
            a0.scale,
            0.0,
        )?;
        let wide = Lin::new(d.rows, cat.ld, d.out, d.ldy);
        self.lin_fwd_bias(x, cat.w, b, y, wide, 0.0)
    }

    /// The backward of group `g`'s projection (as [`Self::group_fwd`]) from its output's
    /// gradient `dy` (in the scratch `buf`; shape `d`): the input's gradient into `da`
    /// and the adapters' weight gradients. Returns `da`'s row stride (the model width, or
    /// a concatenated group's `[dx | du]`).
    fn group_bwd(
        &self,
        a: &Lay,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        (dy, buf): (u64, Buf),
        d: Lin,
        first: bool,
    ) -> Result<usize> {
        let (Some(cat), Some(a0)) = (self.cat(l, g), group_first(li, g)) else {
            let parts = self
                .group_parts(li, g)
                .ok_or_else(|| err("whole-model step: no projection under a LoRA group"))?;
            let beta = self.lora_bwd(a, (l, li, g), x, (dy, buf), d.ldy, a.da, first)?;
            self.lin_dx_parts(dy, parts, a.da, d, beta)?;
            return Ok(self.c);
        };
        let (n, c) = (a.b * self.t, self.c);
        let width = cat.ld - c;
        let beta = if first { 0.0 } else { 1.0 };
        let u = x + 2 * c as u64;
        // dB_k (+)= dyᵀ·u_k (the scale is in u), on the side stream where there is one: it
        // reads `dy` (released after) and this layer's kept input.
        let side = if self.lora_thr == 0 {
            self.fork()?
        } else {
            None
        };
        for ad in LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]) {
            let up = Lin::new(n, ad.r, ad.out, d.ldy).ldx(cat.ld);
            let at = |p: u64, col: usize| p + 2 * col as u64;
            let mm = up.dw(at(u, ad.ucol), at(dy, ad.col), self.g(ad.b));
            self.mm_on("lora.db", mm, (1.0, beta), side)?;
        }
        if side.is_some() {
            self.release(buf)?;
        }
        // [dx | du] = dy·[W | B]: the input's gradient and every adapter's du = dy·B_k at once.
        let wide = Lin::new(n, cat.ld, d.out, d.ldy);
        self.lin_dx_beta(dy, cat.w, a.da, wide, 0.0)?;
        let du = a.da + 2 * c as u64;
        // dA (+)= scale·duᵀ·x and dx += scale·du·[A₁; A₂; …], on the main stream (du lives in
        // `da`, which the next projection's gradient overwrites).
        let (xd, ldx) = self.lora_input(a, l, g, (x, cat.ld), a0.inp)?;
        let down = Lin::new(n, a0.inp, width, cat.ld);
        let da = down.ldx(ldx).dw(xd, du, self.g(a0.a));
        self.mm_on("lora.da", da, (a0.scale, beta), None)?;
        if self.lora_thr == 0 {
            let dx = down.ldx(cat.ld).dx(du, self.w(a0.a), a.da);
            self.mm("lora.dx", dx, false, a0.scale, 1.0)?;
            return Ok(cat.ld);
        }
        // dx += mask ⊙ (scale·du·[A₁; A₂; …]), through the scratch that held the dropped input.
        let dx = down.dx(du, self.w(a0.a), a.lora_x);
        self.mm("lora.dx", dx, false, a0.scale, 0.0)?;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        let io = ((a.lora_x, a0.inp), (a.da, cat.ld));
        self.drop_scaled_ld(a, io, (n, a0.inp), site, drop, true)?;
        Ok(cat.ld)
    }

    /// An adapter's weight-gradient matmul (fp32 C): on `side` through cuBLASLt, or [`Self::mm`]
    /// on the main stream.
    fn mm_on(
        &self,
        name: &'static str,
        mm: Mm,
        (alpha, beta): (f32, f32),
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        match side {
            Some(_) => self.lin_gemm_ab(name, mm, true, (alpha, beta), side),
            None => self.mm(name, mm, true, alpha, beta),
        }
    }

    /// One matmul through cuBLAS with `alpha` (the adapters' small matmuls: on the Llama-style
    /// 114M with LoRA q, v, cuBLASLt's tuned pick was no faster, 1.00 against 1.05 ms a step in all
    /// with the block-diagonal B, its x·Aᵀ and dB slower).
    fn mm(&self, name: &'static str, mm: Mm, c_f32: bool, alpha: f32, beta: f32) -> Result<()> {
        let m = |o: Operand| mat(o.p, o.ld);
        let (a, b, c) = (m(mm.a), m(mm.b), m(mm.c));
        self.gemm_ab(name, mm.t, mm.mnk, (a, b, c), c_f32, (alpha, beta), 1)
    }

    /// The forward, through the loss and its gradient w.r.t. the logits (scaled by `g`).
    /// The forward to the loss; with `grad`, the loss's gradient and the LM head's backward
    /// too (they run with the loss, chunk by chunk: [`Self::head_and_loss`]).
    fn forward(&self, a: &Lay, g: f32, first: bool, grad: bool) -> Result<()> {
        let (b, t, c, f) = (a.b, self.t, self.c, self.hidden);
        let n = b * t;
        let nc = n * c;
        self.lora_blocks()?;
        let (n_i, c_i) = (i32_of(n, "rows")?, i32_of(c, "n_embd")?);
        self.launch(
            &self.k.embed,
            flat_cfg(nc),
            &[
                Arg::P(a.ids),
                Arg::P(self.w(self.wte)),
                Arg::P(self.wpe.map_or(0, |i| self.w(i))),
                Arg::P(a.res[0]),
                Arg::I(n_i),
                Arg::I(i32_of(t, "T")?),
                Arg::I(c_i),
                Arg::I(i32_of(self.vocab, "vocab")?),
            ],
        )?;
        self.embed_scale(a, a.res[0], n)?;
        // LN1 of layer 0 (no residual add before it).
        let l0 = self.layers[0];
        let ln = (l0.ln1_w, l0.ln1_b, a.stats[0]);
        let ln1 = (a.ln1[0], self.ln_ld(0, G_QKV));
        self.residual_norm(a, (a.res[0], 0, 0, None), 0, ln, ln1, n)?;
        for (l, li) in self.layers.iter().enumerate() {
            self.attention(a, l, li)?;
            self.mlp_half_fwd(a, l, li)?;
            // ·Wdownᵀ (+ b) added to the residual, fused with the next layer's norm (or the
            // final one).
            let beta = self.lora_fwd(a, l, li, G_DOWN, a.gelu[l], a.tmp, c)?;
            let down = Lin::new(n, f, c, c);
            self.lin_fwd_beta(a.gelu[l], self.wl(li.down_w)?, a.tmp, down, beta)?;
            let (nw, nb, out) = match self.layers.get(l + 1) {
                Some(next) => (
                    next.ln1_w,
                    next.ln1_b,
                    (a.ln1[l + 1], self.ln_ld(l + 1, G_QKV)),
                ),
                None => (self.lnf.0, self.lnf.1, (a.lnf, c)),
            };
            let ln = (nw, nb, a.stats[2 * l + 2]);
            let y = (
                a.mid[l],
                a.tmp,
                self.wb(li.down_b),
                Some(dropout::site_mlp_out(l)),
            );
            self.residual_norm(a, y, a.res[l + 1], ln, out, n)?;
        }
        self.logit_scale(a, a.lnf, n)?;
        self.head_and_loss(a, g, first, grad)
    }

    /// A block's attention from its normed input `ln1[l]`: qkv = ln1·Wqkvᵀ (+ b) (+ the
    /// adapters), RoPE, attention into `atty[l]`.
    fn attention(&self, a: &Lay, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c) = (a.b * self.t, self.c);
        let qkv = Lin::new(n, c, self.qkv_out, self.qkv_out);
        self.group_fwd(a, (l, li, G_QKV), a.ln1[l], li.qkv_b, a.qkv[l], qkv)?;
        self.rope(a.qkv[l], n, false)?;
        self.attn_fwd(a, l)
    }

    /// Recompute (`model.recompute`): block `l`'s attention half again from its kept input
    /// `res[l]` — the norm (the same arithmetic as the forward's fused add + norm: that one
    /// normalises the rounded sum it stores) and [`Self::attention`]. Dropout masks are
    /// functions of the micro-batch's seed: drawn again the same.
    fn attn_half_fwd(&self, a: &Lay, l: usize, li: &LayerIdx) -> Result<()> {
        let ln = (li.ln1_w, li.ln1_b, a.stats[2 * l]);
        let ln1 = (a.ln1[l], self.ln_ld(l, G_QKV));
        self.residual_norm(a, (a.res[l], 0, 0, None), 0, ln, ln1, a.b * self.t)?;
        self.attention(a, l, li)
    }

    /// A block's middle: mid = res + dropout(atty·Woᵀ (+ bo)), ln2 = Norm2(mid), then the
    /// MLP's activation act(ln2·Wupᵀ (+ b)) into `fc[l]`/`gelu[l]` (the forward, and the
    /// "full" recompute).
    fn mlp_half_fwd(&self, a: &Lay, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c) = (a.b * self.t, self.c);
        let o = Lin::new(n, self.att_c, c, c);
        let beta = self.lora_fwd(a, l, li, G_O, a.atty[l], a.tmp, c)?;
        self.lin_fwd_beta(a.atty[l], self.wl(li.o_w)?, a.tmp, o, beta)?;
        let ln = (li.ln2_w, li.ln2_b, a.stats[2 * l + 1]);
        let y = (
            a.res[l],
            a.tmp,
            self.wb(li.o_b),
            Some(dropout::site_attention_out(l)),
        );
        self.residual_norm(a, y, a.mid[l], ln, (a.ln2[l], self.ln_ld(l, G_GU)), n)?;
        self.mlp_act_fwd(a, l, li)
    }

    /// The LM head and its loss, in chunks of rows so that the logits never exist whole:
    /// per chunk, logits = lnf·headᵀ (rows of stride vpad), then per-row CE, whose gradient
    /// (scaled by g) overwrites the logits in the same pass, then at once the head's backward
    /// for those rows (`da` = dlogits·head, the head's gradient += dlogitsᵀ·lnf).
    fn head_and_loss(&self, a: &Lay, g: f32, first: bool, grad: bool) -> Result<()> {
        let (n, c, v) = (a.b * self.t, self.c, self.vocab);
        let head = self.head.unwrap_or(self.wte);
        // A row in registers where it fits (kernels.cu: 512 threads × CE_REG 16-byte chunks).
        let ce = if v / 8 <= 512 * 13 {
            &self.k.ce_reg
        } else {
            &self.k.ce
        };
        let mut start = 0;
        while start < n {
            let rows = a.head_rows.min(n - start);
            let d = Lin::new(rows, c, v, self.vpad);
            let x = a.lnf + 2 * (start * c) as u64;
            self.lin_fwd(x, self.w(head), a.logits, d)?;
            self.launch(
                ce,
                LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (512, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.logits),
                    Arg::P(a.targets + 4 * start as u64),
                    Arg::P(a.loss + 4 * start as u64),
                    Arg::F(g),
                    Arg::I(i32_of(rows, "rows")?),
                    Arg::I(i32_of(v, "vocab")?),
                    Arg::I(i32_of(self.vpad, "vocab")?),
                ],
            )?;
            if !grad {
                start += rows;
                continue;
            }
            self.lin_dx(a.logits, self.w(head), a.da + 2 * (start * c) as u64, d)?;
            if let Some(gh) = self.gt(head) {
                self.lin_dw(x, a.logits, gh, d, first && start == 0)?;
            }
            start += rows;
        }
        Ok(())
    }

    /// The backward from the logits' gradient (written by the forward's CE kernel).
    /// The bias gradients of the attention-out and MLP-down projections are column sums of
    /// the residual stream's gradient, which the LayerNorm backward that writes it adds up
    /// as it goes (where its v8 kernels run; else a column-sum kernel). `first`: the step's
    /// first micro-batch, whose weight-gradient matmuls overwrite the (unzeroed) matrices'
    /// gradients; later ones add.
    fn backward(&self, a: &Lay, first: bool) -> Result<()> {
        let run = self.backward_streams(a, first);
        if run.is_err() {
            // A pass that failed midway still leaves nothing running on the side stream
            // behind the main stream's back (the caller may free or resize the buffers).
            if let Some(s) = self.side() {
                let _ = s.join();
            }
        }
        run
    }

    /// The MLP activation's backward of layer `l`: from the residual gradient `dy` (in the
    /// scratch `dy_buf`: `dres`, or its dropout-masked copy) through the down projection
    /// (`down`) to the pre-activation's gradient in `dh`; its width (the
    /// up projection's output: F, or 2F for SwiGLU's packed gate|up).
    #[allow(clippy::too_many_arguments)]
    fn mlp_act_bwd(
        &self,
        a: &Lay,
        l: usize,
        li: &LayerIdx,
        (dy, dy_buf): (u64, Buf),
        down: Lin,
        first: bool,
    ) -> Result<usize> {
        let (n, f) = (a.b * self.t, self.hidden);
        let dact = if self.swiglu { a.dact } else { a.dh };
        // The down projection's adapter adds into its input's gradient, before the
        // activation's backward (so no fused GELU backward with one).
        let adapted = li.lora[DOWN].is_some();
        if self.swiglu {
            let beta = self.lora_bwd(
                a,
                (l, li, G_DOWN),
                a.gelu[l],
                (dy, dy_buf),
                self.c,
                dact,
                first,
            )?;
            self.lin_dx_beta(dy, self.wl(li.down_w)?, dact, down, beta)?;
            self.launch(
                &self.k.swiglu_bwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(dact),
                    Arg::P(a.dh),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                ],
            )?;
            return Ok(2 * f);
        }
        // The GELU backward fused into the down projection's data gradient (its variant with
        // the bias gradient, DGELU_BGRAD, has no fp32 bias output and ran 3× slower in bf16:
        // the column sum stays).
        let dgelu = Epi::DGelu {
            aux: a.fc[l],
            ld: f,
        };
        let wd = self.wl(li.down_w)?;
        let mm = down.dx(dy, wd, a.dh);
        if adapted || !self.lin_lt("matmul dgrad+dgelu", mm, false, 0.0, dgelu)? {
            let dyb = (dy, dy_buf);
            let beta = self.lora_bwd(a, (l, li, G_DOWN), a.gelu[l], dyb, self.c, a.dh, first)?;
            self.lin_dx_beta(dy, wd, a.dh, down, beta)?;
            // (fc holds the pre-activation with its bias: no bias here)
            self.launch(
                &self.k.gelu_bwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(0),
                    Arg::P(a.dh),
                    Arg::P(a.dh),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                ],
            )?;
        }
        Ok(f)
    }

    /// A projection's weight and bias gradients from its output gradient `dy` (in the
    /// scratch buffer `buf`, row stride `d.out`): the bias's column sum (unless `bias_done`:
    /// the norm backward summed it) and the weight-gradient matmul, on the side stream where
    /// there is one (which then releases `buf`); nothing for a frozen weight and bias.
    fn proj_grads(
        &self,
        (x, dy, buf): (u64, u64, Buf),
        (w, b, bias_done): (usize, Option<usize>, bool),
        d: Lin,
        first: bool,
    ) -> Result<()> {
        let gw = self.gt(w);
        let gbias = if bias_done { 0 } else { self.gb(b) };
        if gw.is_none() && gbias == 0 {
            return Ok(());
        }
        let side = self.fork()?;
        if gbias != 0 {
            self.col_sum_on(side.unwrap_or(&self.stream), dy, gbias, d.rows, d.out)?;
        }
        if let Some(gw) = gw {
            self.lin_dw_on(side, x, dy, gw, d, first)?;
        }
        self.release(buf)
    }

    /// [`Self::backward`]'s launches.
    fn backward_streams(&self, a: &Lay, first: bool) -> Result<()> {
        let (b, t, c, f) = (a.b, self.t, self.c, self.hidden);
        let n = b * t;
        let nc = n * c;
        let n_i = i32_of(n, "rows")?;
        // (The head's backward ran with the loss: `da` holds d(lnf).)
        self.logit_scale(a, a.da, n)?;
        // d(final residual) = the final norm's backward
        let last = self.n_layer;
        // The norm backward sums the residual gradient's columns into the projection bias
        // below it as it goes — unless dropout sits between them.
        let fuse = |g: u64| if self.res_scaled() { 0 } else { g };
        let down_b = |l: usize| fuse(self.layers.get(l).map_or(0, |li| self.gb(li.down_b)));
        let mut down_b_done = self.norm_bwd(
            a.res[last],
            self.lnf,
            (a.da, c),
            a.dres,
            a.stats[2 * last],
            n,
            false,
            down_b(last - 1),
        )?;
        // Weight gradients and bias sums go to the side stream when there is one (`fork`),
        // which marks its reads of each scratch gradient done (`release`) for the main stream
        // to wait on before it rewrites that buffer (`reclaim`); the main stream keeps the
        // chain of data gradients (and the LoRA adapters' small matmuls).
        for (l, li) in self.layers.iter().enumerate().rev() {
            if self.recompute == Recompute::Full {
                self.attn_half_fwd(a, l, li)?;
                self.mlp_half_fwd(a, l, li)?;
            }
            // MLP down projection: res[l+1] = mid + act·Wdownᵀ (+ b)
            let down = Lin::new(n, f, c, c);
            let (dy, dy_buf) = self.drop_grad(a, dropout::site_mlp_out(l))?;
            let bias = (li.down_w, li.down_b, down_b_done);
            self.proj_grads((a.gelu[l], dy, dy_buf), bias, down, first)?;
            self.reclaim(Buf::Dh)?;
            let up_out = self.mlp_act_bwd(a, l, li, (dy, dy_buf), down, first)?;
            let up = Lin::new(n, c, up_out, up_out);
            let bias = (li.up_w, li.up_b, false);
            self.proj_grads((a.ln2[l], a.dh, Buf::Dh), bias, up, first)?;
            let (gate_col, up_col) = (0, if self.swiglu { f } else { 0 });
            debug_assert!(li.lora[GATE].is_none_or(|g| g.col == gate_col));
            debug_assert!(li.lora[UP].is_none_or(|u| u.col == up_col));
            let dh = (a.dh, Buf::Dh);
            let ldg = self.group_bwd(a, (l, li, G_GU), a.ln2[l], dh, up, first)?;
            self.reclaim(Buf::Dres)?;
            let o_b_done = self.norm_bwd(
                a.mid[l],
                (li.ln2_w, li.ln2_b),
                (a.da, ldg),
                a.dres,
                a.stats[2 * l + 1],
                n,
                true,
                fuse(self.gb(li.o_b)),
            )?;
            if self.recompute == Recompute::Attention {
                self.attn_half_fwd(a, l, li)?;
            }
            // attention output projection: mid = res + dropout(atty·Woᵀ (+ bo))
            let o = Lin::new(n, self.att_c, c, c);
            let (dy, dy_buf) = self.drop_grad(a, dropout::site_attention_out(l))?;
            self.proj_grads(
                (a.atty[l], dy, dy_buf),
                (li.o_w, li.o_b, o_b_done),
                o,
                first,
            )?;
            let beta = self.lora_bwd(a, (l, li, G_O), a.atty[l], (dy, dy_buf), c, a.da, first)?;
            self.lin_dx_beta(dy, self.wl(li.o_w)?, a.da, o, beta)?;
            self.reclaim(Buf::Dqkv)?;
            self.attn_bwd(a, l)?;
            self.rope(a.dqkv, n, true)?;
            // qkv projection
            let qkv = Lin::new(n, c, self.qkv_out, self.qkv_out);
            let bias = (li.qkv_w, li.qkv_b, false);
            self.proj_grads((a.ln1[l], a.dqkv, Buf::Dqkv), bias, qkv, first)?;
            let dqkv = (a.dqkv, Buf::Dqkv);
            let ldg = self.group_bwd(a, (l, li, G_QKV), a.ln1[l], dqkv, qkv, first)?;
            self.reclaim(Buf::Dres)?;
            // The residual stream's gradient below this layer: the down projection bias's
            // gradient of the layer below (none under layer 0).
            let below = l.checked_sub(1).map_or(0, down_b);
            down_b_done = self.norm_bwd(
                a.res[l],
                (li.ln1_w, li.ln1_b),
                (a.da, ldg),
                a.dres,
                a.stats[2 * l],
                n,
                true,
                below,
            )?;
            self.send_sums(Some(l))?;
        }
        self.embed_scale(a, a.dres, n)?;
        // embeddings: token rows by an atomic scatter, positions summed over the batch
        if let Some(gw) = self.gt(self.wte) {
            self.launch(
                &self.k.embedding_bwd,
                flat_cfg(nc),
                &[
                    Arg::P(a.ids),
                    Arg::P(a.dres),
                    Arg::P(gw),
                    Arg::I(n_i),
                    Arg::I(i32_of(c, "n_embd")?),
                    Arg::I(i32_of(self.vocab, "vocab")?),
                ],
            )?;
        }
        if let Some(gp) = self.wpe.and_then(|i| self.gt(i)) {
            self.col_sum(a.dres, gp, b, t * c)?;
        }
        self.send_sums(None)?;
        // The optimizer reads every gradient, and a capture must end joined.
        self.side().map_or(Ok(()), Side::join)
    }

    /// Causal self-attention of layer `l`: packed `qkv[l]` → `atty[l]` `[B·T, C]`.
    fn attn_fwd(&self, a: &Lay, l: usize) -> Result<()> {
        let (b, t, c, h) = (a.b, self.t, self.c, self.n_head);
        let hd = self.hd;
        let nc = b * t * c;
        let bh = b * h;
        let scale = self.att_scale;
        if self.flash {
            let fk = self.flash_kernels()?;
            let kern = if self.drop_thr > 0 {
                &fk.fwd_drop
            } else {
                &fk.fwd
            };
            return self.launch(
                kern,
                self.flash_grid(b, h, fk.fwd_smem, (128, 64)),
                &[
                    Arg::P(a.qkv[l]),
                    Arg::P(a.atty[l]),
                    Arg::P(a.lse_att[l]),
                    Arg::I(i32_of(b, "B")?),
                    Arg::I(i32_of(t, "T")?),
                    Arg::I(i32_of(h, "H")?),
                    Arg::I(i32_of(self.n_kv_head, "KV heads")?),
                    Arg::F(scale),
                    Arg::P(a.seed),
                    Arg::U(dropout::site_attention(l)),
                    Arg::U(self.drop_thr),
                    Arg::F(self.drop_scale),
                    Arg::P(a.mbits.get(l).copied().unwrap_or(0)),
                ],
            );
        }
        // attention: split heads, S = Q·Kᵀ, P = causal softmax(scale·S), Y = P·V, merge
        let (q, k, v) = (a.heads, a.heads + 2 * nc as u64, a.heads + 4 * nc as u64);
        self.launch(
            &self.k.qkv_split,
            flat_cfg(3 * nc),
            &[
                Arg::P(a.qkv[l]),
                Arg::P(q),
                Arg::P(k),
                Arg::P(v),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(hd, "hd")?),
            ],
        )?;
        self.gemm(
            "attention matmul",
            (true, false),
            (t, t, hd),
            bmat(k, hd, t * hd),
            bmat(q, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            false,
            0.0,
            bh,
        )?;
        self.softmax(&self.k.softmax_fwd, &[a.prob[l], a.prob[l]], bh * t, scale)?;
        self.gemm(
            "attention matmul",
            (false, false),
            (hd, t, t),
            bmat(v, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            bmat(a.yh, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        self.heads(&self.k.heads_merge, a.yh, a.atty[l], b, c, 0)?;
        Ok(())
    }

    /// The attention backward of layer `l`: `da` (d atty) → `dqkv`.
    fn attn_bwd(&self, a: &Lay, l: usize) -> Result<()> {
        let (b, t, c, h) = (a.b, self.t, self.c, self.n_head);
        let hd = self.hd;
        // (the dq accumulator at the scratch's start holds [B·T, n_head·head_dim])
        let nc = b * t * self.att_c;
        let bh = b * h;
        let scale = self.att_scale;
        if self.flash {
            let (bi, ti, hi) = (i32_of(b, "B")?, i32_of(t, "T")?, i32_of(h, "H")?);
            let kvi = i32_of(self.n_kv_head, "KV heads")?;
            let delta = a.fa_scratch + 4 * nc as u64;
            let rows = b * t * h;
            let fk = self.flash_kernels()?;
            self.launch(
                &fk.pre,
                LaunchConfig {
                    grid_dim: (rows.div_ceil(32) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.atty[l]),
                    Arg::P(a.da),
                    Arg::P(delta),
                    Arg::P(a.fa_scratch),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                ],
            )?;
            self.launch(
                &fk.bwd,
                self.flash_grid(b, self.n_kv_head, fk.bwd_smem, fk.bwd_block),
                &[
                    Arg::P(a.qkv[l]),
                    Arg::P(a.da),
                    Arg::P(a.lse_att[l]),
                    Arg::P(delta),
                    Arg::P(a.fa_scratch),
                    Arg::P(a.dqkv),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                    Arg::I(kvi),
                    Arg::F(scale),
                    Arg::U(self.drop_thr),
                    Arg::F(self.drop_scale),
                    Arg::P(a.mbits.get(l).copied().unwrap_or(0)),
                ],
            )?;
            return self.launch(
                &fk.dq,
                LaunchConfig {
                    grid_dim: ((rows * hd / 4).div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.fa_scratch),
                    Arg::P(a.dqkv),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                    Arg::I(kvi),
                    Arg::F(scale),
                ],
            );
        }
        // attention core, from the saved probabilities
        let (q, k, vv) = (a.heads, a.heads + 2 * nc as u64, a.heads + 4 * nc as u64);
        let (dq, dk, dv) = (a.dheads, a.dheads + 2 * nc as u64, a.dheads + 4 * nc as u64);
        self.launch(
            &self.k.qkv_split,
            flat_cfg(3 * nc),
            &[
                Arg::P(a.qkv[l]),
                Arg::P(q),
                Arg::P(k),
                Arg::P(vv),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(hd, "hd")?),
            ],
        )?;
        self.heads(&self.k.heads_split, a.da, a.dyh, b, c, 0)?;
        // dP = dY·Vᵀ
        self.gemm(
            "attention matmul",
            (true, false),
            (t, t, hd),
            bmat(vv, hd, t * hd),
            bmat(a.dyh, hd, t * hd),
            bmat(a.dprob, t, t * t),
            false,
            0.0,
            bh,
        )?;
        // dV = Pᵀ·dY
        self.gemm(
            "attention matmul",
            (false, true),
            (hd, t, t),
            bmat(a.dyh, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            bmat(dv, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        // dS = softmax backward (scale folded in), in place
        self.softmax(
            &self.k.softmax_bwd,
            &[a.prob[l], a.dprob, a.dprob],
            bh * t,
            scale,
        )?;
        // dQ = dS·K, dK = dSᵀ·Q
        self.gemm(
            "attention matmul",
            (false, false),
            (hd, t, t),
            bmat(k, hd, t * hd),
            bmat(a.dprob, t, t * t),
            bmat(dq, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        self.gemm(
            "attention matmul",
            (false, true),
            (hd, t, t),
            bmat(q, hd, t * hd),
            bmat(a.dprob, t, t * t),
            bmat(dk, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        for (i, p) in [dq, dk, dv].into_iter().enumerate() {
            self.heads(&self.k.heads_merge, p, a.dqkv, b, 3 * c, i)?;
        }
        Ok(())
    }

    /// Flash attention's grid: (B·heads, blocks of `rows` queries or keys), `threads` a block;
    /// the forward runs a block per query head, the backward per key/value head.
    fn flash_grid(
        &self,
        b: usize,
        heads: usize,
        smem: u32,
        (threads, rows): (u32, usize),
    ) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((b * heads) as u32, self.t.div_ceil(rows) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        }
    }

    /// The flash kernels of this model's head dim (one of [`FLASH_HEAD_DIMS`]).
    fn flash_kernels(&self) -> Result<&Flash> {
        if self.hd == 64 {
            return Ok(&self.k.flash64);
        }
        self.k.flash128.as_ref().ok_or_else(|| {
            err("flash attention at head dim 128 needs more shared memory a block than this GPU has")
        })
    }

    /// The output gradient of a projection whose output went through dropout at `site` into
    /// the residual stream: `dres` through the mask (into `dmask`), or `dres` itself without
    /// dropout; and the scratch buffer that is ([`Buf`], for the side stream's reads).
    fn drop_grad(&self, a: &Lay, site: u32) -> Result<(u64, Buf)> {
        if !self.res_scaled() {
            return Ok((a.dres, Buf::Dres));
        }
        self.reclaim(Buf::Dmask)?;
        let (rows, scale) = (a.b * self.t, self.keep_scale() * self.res_mult);
        let drop = (self.drop_thr, scale);
        self.drop_scaled(a, (a.dres, a.dmask), (rows, self.c), site, drop, false)?;
        Ok((a.dmask, Buf::Dmask))
    }

    /// A kept element's dropout scale: 1 while dropout is off (an evaluation's forward).
    fn keep_scale(&self) -> f32 {
        if self.drop_thr > 0 {
            self.drop_scale
        } else {
            1.0
        }
    }

    /// Whether a mask or a scale sits between a block's output projections and the residual
    /// stream (dropout, Granite's residual multiplier).
    fn res_scaled(&self) -> bool {
        self.drop_thr > 0 || self.res_mult != 1.0
    }

    /// The embedding's dropout and Granite's multiplier, in place on `x` (`[n, C]`), in the
    /// forward and on its gradient in the backward.
    fn embed_scale(&self, a: &Lay, x: u64, n: usize) -> Result<()> {
        if self.drop_thr == 0 && self.emb_mult == 1.0 {
            return Ok(());
        }
        let (site, scale) = (dropout::site_embedding(), self.keep_scale() * self.emb_mult);
        self.drop_scaled(a, (x, x), (n, self.c), site, (self.drop_thr, scale), false)
    }

    /// Granite's 1/logits_scaling, in place on the final norm's output `[n, C]` (forward) and
    /// on its gradient (backward): the logits and the head's gradients scale with it.
    fn logit_scale(&self, a: &Lay, x: u64, n: usize) -> Result<()> {
        if self.logit_mult == 1.0 {
            return Ok(());
        }
        self.drop_scaled(a, (x, x), (n, self.c), 0, (0, self.logit_mult), false)
    }

    /// `y = scale·mask(x)` over `[rows, cols]` at `site` (`thr` 0: no mask, only the scale),
    /// or `y += scale·mask(x)` with `acc`.
    #[allow(clippy::too_many_arguments)]
    fn drop_scaled(
        &self,
        a: &Lay,
        (x, y): (u64, u64),
        (rows, cols): (usize, usize),
        site: u32,
        drop: (u32, f32),
        acc: bool,
    ) -> Result<()> {
        self.drop_scaled_ld(a, ((x, cols), (y, cols)), (rows, cols), site, drop, acc)
    }

    /// [`Self::drop_scaled`] between matrices whose rows lie `ldx` and `ldy` apart (multiples
    /// of 8; the columns of a LoRA group's `[x | u]` or `[dx | du]`: [`Cat`]).
    fn drop_scaled_ld(
        &self,
        a: &Lay,
        ((x, ldx), (y, ldy)): ((u64, usize), (u64, usize)),
        (rows, cols): (usize, usize),
        site: u32,
        (thr, scale): (u32, f32),
        acc: bool,
    ) -> Result<()> {
        let total8 = rows * cols / 8;
        self.launch(
            &self.k.dropout_rows,
            flat_cfg(total8),
            &[
                Arg::P(x),
                Arg::P(y),
                Arg::P(total8 as u64),
                Arg::I(i32_of(cols / 8, "cols")?),
                Arg::P(a.seed),
                Arg::U(site),
                Arg::U(thr),
                Arg::F(scale),
                Arg::I(acc as i32),
                Arg::I(i32_of(ldx / 8, "row stride")?),
                Arg::I(i32_of(ldy / 8, "row stride")?),
            ],
        )
    }

    /// RoPE in place on the q and k heads of packed projections `[rows, (H + 2·KV)·hd]`
    /// (`inverse`: rotate back, for their gradients).
    fn rope(&self, qkv: u64, rows: usize, inverse: bool) -> Result<()> {
        let Some(table) = &self.rope else {
            return Ok(());
        };
        let nh = self.n_head + self.n_kv_head;
        // (kernels.cu: four pairs a thread where hd/2 is a multiple of 4)
        let half = self.hd / 2;
        let per = if half.is_multiple_of(4) {
            half / 4
        } else {
            half
        };
        self.launch(
            &self.k.rope,
            flat_cfg(rows * nh * per),
            &[
                Arg::P(qkv),
                Arg::I(i32_of(rows, "rows")?),
                Arg::I(i32_of(self.t, "T")?),
                Arg::I(i32_of(nh, "heads")?),
                Arg::I(i32_of(self.hd, "hd")?),
                Arg::I(i32_of(self.qkv_out, "ld")?),
                Arg::P(ptr(table, &self.stream)),
                Arg::F(if inverse { -1.0 } else { 1.0 }),
            ],
        )
    }

    /// `res = x + dropout(y (+ bias))` (y = 0: res is x; the dropout at `site` where the model
    /// has one), `out = Norm(res)` with the weight and bias entries of `ln`, whose third part
    /// receives the rows' statistics for the backward.
    fn residual_norm(
        &self,
        a: &Lay,
        (x, y, bias, site): (u64, u64, u64, Option<u32>),
        res: u64,
        (w, bn, stats): (usize, Option<usize>, u64),
        (out, ldo): (u64, usize),
        n: usize,
    ) -> Result<()> {
        let (thr, scale) = site.map_or((0, 1.0), |_| {
            (self.drop_thr, self.keep_scale() * self.res_mult)
        });
        let mut args = vec![
            Arg::P(x),
            Arg::P(y),
            Arg::P(bias),
            Arg::P(res),
            Arg::P(self.w(w)),
            Arg::P(self.wb(bn)),
            Arg::P(out),
        ];
        let tail = [
            Arg::I(i32_of(n, "rows")?),
            Arg::I(i32_of(self.c, "n_embd")?),
            Arg::F(self.eps),
            Arg::I(self.rms as i32),
            Arg::P(a.seed),
            Arg::U(site.unwrap_or(0)),
            Arg::U(thr),
            Arg::F(scale),
            Arg::I(i32_of(ldo, "row stride")?),
        ];
        match &self.k.norm_v8 {
            Some(v8) => {
                let cfg = LaunchConfig {
                    grid_dim: (v8.grid.min(n.div_ceil(8).max(1) as u32), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                args.push(Arg::P(stats));
                args.extend(tail);
                self.launch(&v8.fwd, cfg, &args)
            }
            None => {
                args.extend(tail);
                self.launch(&self.k.residual_norm, row_cfg(n), &args)
            }
        }
    }

    /// `y[n, c] = x + b` (`mode` 0) or `gelu(x + b)` (`mode` 1); c a multiple of 8, y may
    /// be x.
    fn bias_act(&self, x: u64, b: u64, y: u64, n: usize, c: usize, mode: i32) -> Result<()> {
        self.launch(
            &self.k.bias_act,
            flat_cfg(n * c / 8),
            &[
                Arg::P(x),
                Arg::P(b),
                Arg::P(y),
                Arg::P((n * c / 8) as u64),
                Arg::I(i32_of(c / 8, "cols")?),
                Arg::I(mode),
            ],
        )
    }

    /// Causal softmax forward (`ptrs` = x, y) or backward (`ptrs` = y, dy, dx) over
    /// `rows` rows of T.
    fn softmax(&self, f: &Kern, ptrs: &[u64], rows: usize, scale: f32) -> Result<()> {
        let t = i32_of(self.t, "T")?;
        let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::P(p)).collect();
        args.extend([
            Arg::I(i32_of(rows, "rows")?),
            Arg::I(t),
            Arg::I(t),
            Arg::F(scale),
        ]);
        self.launch(f, row_cfg(rows), &args)
    }

    /// Heads `[B, H, T, hd]` ↔ columns `part·C ..` of a `[B, T, ld]` buffer (merge: src
    /// heads → dst buffer; split: src buffer → dst heads).
    #[allow(clippy::too_many_arguments)]
    fn heads(&self, f: &Kern, src: u64, dst: u64, b: usize, ld: usize, part: usize) -> Result<()> {
        let (h, c) = (self.n_head, self.c);
        self.launch(
            f,
            flat_cfg(b * self.t * c),
            &[
                Arg::P(src),
                Arg::P(dst),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(self.t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(c / h, "hd")?),
                Arg::I(i32_of(ld, "ld")?),
                Arg::I(i32_of(part * c, "offset")?),
            ],
        )
    }
}

/// The columns of LoRA group `g`'s `x·Aᵀ` in layer `li` (Σ r over its adapters; 0: none).
/// Zeroes `cols` 16-bit columns of `rows` rows from `p` (row pitch `ld` elements), queued on
/// `stream`.
///
/// # Safety
/// The columns must lie inside an allocation that `stream` may write.
unsafe fn memset_cols(
    p: u64,
    ld: usize,
    cols: usize,
    rows: usize,
    stream: &CudaStream,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // SAFETY: the caller's contract; the driver checks the pitch and extent.
    unsafe { sys::cuMemsetD2D16Async(p, 2 * ld, 0, cols, rows, stream.cu_stream()) }
        .result()
        .w()
}

/// The first adapter of LoRA group `g` of a layer (the group's stacked A and its scale).
fn group_first(li: &LayerIdx, g: usize) -> Option<LoraIdx> {
    LORA_GROUPS[g].iter().find_map(|&j| li.lora[j])
}

fn lora_width(li: &LayerIdx, g: usize) -> usize {
    LORA_GROUPS[g]
        .iter()
        .filter_map(|&j| li.lora[j])
        .map(|ad| ad.r)
        .sum()
}
