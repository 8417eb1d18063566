//! The flat parameter buffers: each weight's place in them, its bf16 copy and fp32 gradient
//! addresses, the per-step cast of the masters, and the SCU gradient term.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{result as drv, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor, Var};
use half::bf16;

use super::mamba_bufs::MambaIdx;
use super::moe_bufs::MoeIdx;
use super::{align, ptr, Arg, ModelStep};
use crate::engine::kernels::cuda::{err, multi_grid, with_f32_ptrs, with_ptrs};
use crate::engine::kernels::quantized::Quantized;
use crate::engine::kernels::spec::{LinearWB, StepLora, StepMatrix, LORA_TARGETS};
use crate::engine::kernels::WeightCopy;

/// One parameter's place in the flat buffers (the same element offset in bf16 and f32).
pub(super) struct Entry {
    /// The parameter (None: a quantized base matrix, `quant`).
    pub(super) var: Option<Var>,
    /// A frozen base matrix stored quantized (NF4, or a GGUF file's blocks): dequantized into
    /// the step's scratch where a matmul reads it ([`ModelStep::matmul_weight`]); in no buffer
    /// of the step. `quant_ptrs`: its parts on the device (NF4: codes, block maxima and group
    /// scales; ggml: the blocks).
    pub(super) quant: Option<Arc<Quantized>>,
    pub(super) quant_ptrs: [u64; 3],
    /// Rows (a matrix's output features; a vector's length).
    pub(super) rows: usize,
    pub(super) off: usize,
    pub(super) n: usize,
    /// A frozen weight (LoRA's base): its bf16 copy lives in the frozen buffer (`off` is
    /// there), and it has no gradient.
    pub(super) frozen: bool,
    /// A frozen bf16 matrix the step reads where it is (the model's own storage, at
    /// `ext_ptr`): no copy at all. Packed projections made of such matrices run as one
    /// matmul per part ([`ModelStep::lin_fwd_parts`]).
    pub(super) ext: bool,
    pub(super) ext_ptr: u64,
}

/// A LoRA adapter of one projection: its A `[r, inp]` and B `[out, r]` entries, the scale,
/// and the column where its output starts in the projection's (packed) output.
#[derive(Clone, Copy)]
pub(super) struct LoraIdx {
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) r: usize,
    pub(super) inp: usize,
    pub(super) out: usize,
    pub(super) col: usize,
    pub(super) scale: f32,
    /// Its first column in its group's `x·Aᵀ` ([`LORA_GROUPS`]).
    pub(super) ucol: usize,
}

/// [`LoraIdx`] slots of a layer, in `model::LORA_TARGETS` order.
pub(super) const Q: usize = 0;

pub(super) const K: usize = 1;

pub(super) const V: usize = 2;

pub(super) const O: usize = 3;

pub(super) const GATE: usize = 4;

pub(super) const UP: usize = 5;

pub(super) const DOWN: usize = 6;

/// Adapters that share their input: q, k, v (the normed block input) and gate, up (the normed
/// MLP input). A group's A matrices sit adjacent in the buffers, stacked into one
/// `[count·r, inp]` matrix, so that `u = x·[A₁; A₂; …]ᵀ`, its weight gradient and its data
/// gradient `dx += du·[A₁; A₂; …]` are one matmul each for the whole group.
pub(super) const LORA_GROUPS: [&[usize]; 4] = [&[Q, K, V], &[O], &[GATE, UP], &[DOWN]];

pub(super) const G_QKV: usize = 0;

pub(super) const G_O: usize = 1;

pub(super) const G_GU: usize = 2;

pub(super) const G_DOWN: usize = 3;

/// Entry indices of one transformer layer (None: the model has no such bias). `qkv` is the
/// packed q|k|v projection (a Mamba layer's in_proj), `o` the attention's output projection
/// (a Mamba layer's out_proj), `up` the packed gate|up projection of a SwiGLU MLP (or the GELU
/// MLP's up projection).
#[derive(Clone, Copy)]
pub(super) struct LayerIdx {
    pub(super) ln1_w: usize,
    pub(super) ln1_b: Option<usize>,
    pub(super) qkv_w: usize,
    pub(super) qkv_b: Option<usize>,
    pub(super) o_w: usize,
    pub(super) o_b: Option<usize>,
    pub(super) ln2_w: usize,
    pub(super) ln2_b: Option<usize>,
    pub(super) up_w: usize,
    pub(super) up_b: Option<usize>,
    pub(super) down_w: usize,
    pub(super) down_b: Option<usize>,
    pub(super) lora: [Option<LoraIdx>; 7],
    /// QK-norm per head: q's and k's RMSNorm weights.
    pub(super) qk_norm: Option<(usize, usize)>,
    /// Gemma's sandwich: the attention output's and the MLP output's norm weights.
    pub(super) post: Option<(usize, usize)>,
    /// A hybrid's Mamba layer: its mixer's own entries (None: an attention layer).
    pub(super) mamba: Option<MambaIdx>,
    /// A hybrid's routed experts: their entries (None: no experts).
    pub(super) moe: Option<MoeIdx>,
}

/// The flat buffers' layout as it is built: each entry's offset in the trainable buffers
/// (bf16 copy and fp32 gradient), or, while `frozen` is set, in the frozen bf16 buffer.
#[derive(Default)]
pub(super) struct Layout {
    pub(super) entries: Vec<Entry>,
    pub(super) off: usize,
    pub(super) frozen_off: usize,
    pub(super) frozen: bool,
    /// Frozen 16-bit matrices pushed now are copied into the frozen buffer, not read in
    /// place (a small packed projection: [`PACK_COPY_MAX_BYTES`]).
    pub(super) copy: bool,
}

/// The most bytes a packed projection (q|k|v, gate|up) of a frozen 16-bit base may have for the
/// step to keep its own copy of it as one matrix, rather than read the model's separate
/// matrices in place with one matmul each: on the Llama-style 114M (H100, cuBLASLt tuned, B8
/// T1024) q|k|v as one matmul of 1280 rows took 27.8 µs against 17.7 + 8.9 + 18.3 for its
/// three parts (its data gradient 31.4 against 44.1), gate|up 72.5 against 2 × 40.5; at the 1B
/// and 8B shapes (12–50 MB a projection) the parts are wide enough alone, and a copy of every
/// layer's would cost their memory.
pub(super) const PACK_COPY_MAX_BYTES: usize = 8 << 20;

/// bf16 or fp16: the dtypes a weight the step reads in place (or copies as is) may have.
pub(super) fn is_16bit(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// Device addresses of 16-bit weights in the step's own type: fp16 (`half`) or bf16.
pub(super) fn ptrs_16(ts: &[&Tensor], half: bool) -> Result<Vec<u64>> {
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
    pub(super) fn push(&mut self, v: &Var, pad: bool) -> usize {
        let n = v.as_tensor().elem_count();
        let rows = v.as_tensor().dims().first().copied().unwrap_or(1);
        let ext = self.frozen && !self.copy && is_16bit(v.dtype()) && v.rank() >= 2;
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
            quant: None,
            quant_ptrs: [0; 3],
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
    pub(super) fn adapters(
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

    /// A linear layer's matrix: a parameter ([`Self::push`]) or a frozen quantized one (in
    /// no buffer).
    pub(super) fn push_mat(&mut self, m: &StepMatrix, pad: bool) -> usize {
        match m {
            StepMatrix::Var(v) => self.push(v, pad),
            StepMatrix::Quantized(q) => {
                let (out, inp) = q.dims();
                self.entries.push(Entry {
                    var: None,
                    quant: Some(q.clone()),
                    quant_ptrs: [0; 3],
                    rows: out,
                    off: 0,
                    n: out * inp,
                    frozen: true,
                    ext: false,
                    ext_ptr: 0,
                });
                self.entries.len() - 1
            }
        }
    }

    /// `v` if there is one, aligned.
    pub(super) fn push_opt(&mut self, v: &Option<Var>) -> Option<usize> {
        v.as_ref().map(|v| self.push(v, true))
    }

    /// Weights packed into one matrix (or biases into one vector): the first aligned, the
    /// rest adjacent; the first's index.
    pub(super) fn pack(&mut self, vs: &[&Var]) -> usize {
        let first = self.push(vs[0], true);
        for v in &vs[1..] {
            self.push(v, false);
        }
        first
    }

    /// [`Self::pack`] of linear layers' matrices. Those of a frozen 16-bit base, which the
    /// step reads in place (apart: one matmul a part), are copied into the frozen buffer as
    /// one matrix where the projection is small ([`PACK_COPY_MAX_BYTES`]).
    pub(super) fn pack_mats(&mut self, ms: &[&StepMatrix]) -> usize {
        let bytes: usize = ms
            .iter()
            .map(|m| match m {
                StepMatrix::Var(v) => 2 * v.as_tensor().elem_count(),
                StepMatrix::Quantized(_) => usize::MAX / 8,
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
    pub(super) fn pack_biases(&mut self, parts: &[&LinearWB], what: &str) -> Result<Option<usize>> {
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

/// The first adapter of LoRA group `g` of a layer (the group's stacked A and its scale).
pub(super) fn group_first(li: &LayerIdx, g: usize) -> Option<LoraIdx> {
    LORA_GROUPS[g].iter().find_map(|&j| li.lora[j])
}

/// The columns of LoRA group `g`'s `x·Aᵀ` in layer `li` (Σ r over its adapters; 0: none).
pub(super) fn lora_width(li: &LayerIdx, g: usize) -> usize {
    LORA_GROUPS[g]
        .iter()
        .filter_map(|&j| li.lora[j])
        .map(|ad| ad.r)
        .sum()
}

impl ModelStep {
    /// The 16-bit device address of entry `i` (its compute copy, or the model's own storage
    /// for a frozen matrix read in place). A 4-bit base matrix has none: it is dequantized into
    /// the scratch where a matmul reads it ([`Self::matmul_weight`]); asking for its address is
    /// an error.
    pub(super) fn weight_ptr(&self, i: usize) -> Result<u64> {
        let e = &self.entries[i];
        if e.ext {
            return Ok(e.ext_ptr);
        }
        if e.quant.is_some() {
            return Err(err(format!(
                "whole-model step: entry {i} is a quantized matrix, read only through a \
                 dequantizing matmul (it has no 16-bit address)"
            )));
        }
        Ok((if e.frozen { self.fbf_p } else { self.wbf_p }) + 2 * e.off as u64)
    }

    /// A linear layer's matrix for a matmul launched next on the main stream: its bf16
    /// address, after dequantizing it into the scratch when it is a quantized base matrix.
    pub(super) fn matmul_weight(&self, i: usize) -> Result<u64> {
        let e = &self.entries[i];
        let Some(q) = &e.quant else {
            return self.weight_ptr(i);
        };
        let n8 = e.n / 8;
        let cfg = LaunchConfig {
            grid_dim: (n8.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        match &**q {
            Quantized::Nf4(_) => {
                let [codes, absq, gscale] = e.quant_ptrs;
                self.launch(
                    &self.k.nf4_dequant,
                    cfg,
                    &[
                        Arg::P(codes),
                        Arg::P(absq),
                        Arg::P(gscale),
                        Arg::P(self.quant_p),
                        Arg::L(n8 as i64),
                    ],
                )?;
            }
            Quantized::Ggml(g) => {
                let Some((code, _, block, bytes)) = crate::engine::kernels::ggml::format(g.code)
                else {
                    return Err(err(format!("whole-model step: ggml type {} kept", g.code)));
                };
                self.launch(
                    &self.k.ggml_dequant,
                    cfg,
                    &[
                        Arg::P(e.quant_ptrs[0]),
                        Arg::P(self.quant_p),
                        Arg::I(code as i32),
                        Arg::I(block as i32),
                        Arg::I(bytes as i32),
                        Arg::L(n8 as i64),
                    ],
                )?;
            }
        }
        Ok(self.quant_p)
    }

    /// The fp32 gradient address of a trainable entry (callers skip frozen ones:
    /// [`Self::trained_grad_ptr`]).
    pub(super) fn grad_ptr(&self, i: usize) -> u64 {
        self.grad_p + 4 * self.entries[i].off as u64
    }

    /// The gradient address of entry `i` if it trains (None: frozen).
    pub(super) fn trained_grad_ptr(&self, i: usize) -> Option<u64> {
        (!self.entries[i].frozen).then(|| self.grad_ptr(i))
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

    /// Copy a pointer table into its persistent device buffer (allocated once; the
    /// pointers are re-read every step, as a resume may swap a weight's storage).
    pub(super) fn upload_table(&mut self, host: &[u64], axpy: bool) -> Result<u64> {
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
            addr: self.weight_ptr(i).ok()?,
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
    pub(super) fn cast_weights(&mut self) -> Result<()> {
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
                    self.weight_ptr(i)?,
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
                table.extend([*p, self.weight_ptr(i)?, self.entries[i].n as u64]);
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
                table.extend([*p + skip, self.grad_ptr(i) + skip, n as u64]);
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
    pub(super) fn weight_ptr_or_null(&self, i: Option<usize>) -> Result<u64> {
        i.map_or(Ok(0), |i| self.weight_ptr(i))
    }

    /// The fp32 gradient address of an optional entry (0: none, or frozen).
    pub(super) fn grad_ptr_or_null(&self, i: Option<usize>) -> u64 {
        i.and_then(|i| self.trained_grad_ptr(i)).unwrap_or(0)
    }

    /// Whether the `count` entries from `first` (a packed projection's parts) are one
    /// matrix in memory — not so for a frozen base read in place ([`Entry::ext`]).
    pub(super) fn packed(&self, (first, count): (usize, usize)) -> bool {
        count == 1 || !(self.entries[first].ext || self.entries[first].quant.is_some())
    }
}
