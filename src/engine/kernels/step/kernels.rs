//! Loading the step's kernels, launching them, and timing launches when profiling.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute},
    CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use super::{Arg, ModelStep};
use crate::engine::events::KernelTime;
use crate::engine::kernels::cuda::{err, load_function};
use crate::engine::spec::FLASH_SOFTCAP_HEAD_DIM;

/// A timed launch: its group name and the events before and after it.
pub(super) type Mark = (&'static str, CudaEvent, CudaEvent);

/// A loaded kernel and the name its GPU time is reported under.
pub(super) struct Kern {
    pub(super) f: CudaFunction,
    pub(super) name: &'static str,
}

pub(super) struct Kernels {
    /// The device's multiprocessor count (grid sizes).
    pub(super) sms: usize,
    pub(super) cast: Kern,
    pub(super) axpy: Kern,
    pub(super) lora_blocks: Kern,
    pub(super) embed: Kern,
    pub(super) residual_norm: Kern,
    pub(super) norm_bwd: Kern,
    pub(super) norm_bwd_add: Kern,
    /// Row-in-registers LayerNorm kernels for the model's width (n_embd ≤ 1024).
    pub(super) norm_v8: Option<NormV8>,
    pub(super) ce: Kern,
    pub(super) ce_reg: Kern,
    pub(super) bias_act: Kern,
    pub(super) gelu_bwd: Kern,
    pub(super) col_sum: Kern,
    pub(super) qkv_split: Kern,
    pub(super) heads_merge: Kern,
    pub(super) heads_split: Kern,
    /// Grouped-query key/value gradients summed per key/value head (materialised attention).
    pub(super) kv_grads_merge: Kern,
    pub(super) softmax_fwd: Kern,
    pub(super) softmax_bwd: Kern,
    pub(super) embedding_bwd: Kern,
    pub(super) rope: Kern,
    pub(super) qk_norm_fwd: Kern,
    pub(super) qk_norm_bwd: Kern,
    /// QK-norm over the whole projection (OLMo 2).
    pub(super) qk_whole_fwd: Kern,
    pub(super) qk_whole_bwd: Kern,
    pub(super) swiglu_fwd: Kern,
    pub(super) swiglu_bwd: Kern,
    pub(super) dropout_rows: Kern,
    pub(super) nf4_dequant: Kern,
    pub(super) ggml_dequant: Kern,
    /// The Mamba-2 mixer's kernels (mamba.cuh and its family, step/mamba_*.cuh).
    pub(super) mamba: MambaKernels,
    pub(super) moe: MoeKernels,
    /// Flash attention for head dims 64, 128 and 256.
    pub(super) flash64: Flash,
    /// None where the GPU's shared memory per block is too small for them (128: a T4's 64 KB;
    /// 256: below Hopper's 227 KB; [`crate::engine::kernels::flash_fits`] keeps such models
    /// off flash attention).
    pub(super) flash128: Option<Flash>,
    pub(super) flash256: Option<Flash>,
}

/// flash.cu's kernels for one head dim, and the dynamic shared memory the forward and the
/// backward's main kernel launch with (0 where the kernel's memory is static).
pub(super) struct Flash {
    pub(super) fwd: Kern,
    pub(super) fwd_drop: Kern,
    pub(super) pre: Kern,
    pub(super) bwd: Kern,
    pub(super) dq: Kern,
    /// `dq` reads flash_sm90.cu's slabs (a block of 256 threads each; flash_bwd_ws), not rows.
    pub(super) dq_slabs: bool,
    pub(super) fwd_smem: u32,
    pub(super) bwd_smem: u32,
    /// The forward's block: threads, and queries it owns (the grid's second dimension covers T
    /// in steps of it).
    pub(super) fwd_block: (u32, usize),
    /// The backward's block: threads, and keys it owns (the grid's second dimension covers T
    /// in steps of it).
    pub(super) bwd_block: (u32, usize),
    /// The backward takes one query head a block (head dim 256), not a key/value head's
    /// group: `kv_sum` then adds the heads' dK, dV shares up where heads share one.
    pub(super) per_head: bool,
    pub(super) kv_sum: Option<Kern>,
}

impl Flash {
    /// `hopper`: the kernels are the compute_90a build, whose forward and backward run on
    /// warpgroup tensor-core instructions (flash_sm90.cu) at head dims 64 and 128 (256's are
    /// flash.cu's on every build).
    pub(super) fn load(
        named: &dyn Fn(&str, &'static str) -> Result<Kern>,
        hd: usize,
        hopper: bool,
    ) -> Result<Self> {
        let sfx = match hd {
            64 => "",
            128 => "_d128",
            _ => "_d256",
        };
        let k = |base: &str, group: &'static str| named(&format!("{base}{sfx}_bf16"), group);
        let (mut fwd_smem, mut bwd_smem) = crate::engine::kernels::spec::flash_smem(hd);
        // (head dim 256: 8 warps over 64 keys, two a key group, each half of the columns)
        let mut bwd_block = if hd == 256 { (256, 64) } else { (128, 64) };
        let hopper = hopper && hd != 256;
        let bwd = if hopper {
            // Three warpgroups over 128 keys (flash_sm90.cu's flash_bwd_ws[_d128]_bf16).
            bwd_smem = crate::engine::kernels::spec::FLASH_BWD_WS_SMEM;
            bwd_block = (384, 128);
            named(&format!("flash_bwd_ws{sfx}_bf16"), "flash_bwd_ws")?
        } else {
            k("flash_bwd", "flash_bwd")?
        };
        // (the mma.sync forward and the head-dim-64 wgmma one: one warpgroup over 64 queries)
        let mut fwd_block = (128, 64);
        let (fwd, fwd_drop) = if hopper && hd == 128 {
            // Two MMA warpgroups and a copy warpgroup over 128 queries (flash_sm90.cu's
            // flash_fwd_ws_d128_bf16).
            fwd_smem = crate::engine::kernels::spec::FLASH_FWD_WS_SMEM;
            fwd_block = (384, 128);
            (
                named("flash_fwd_ws_d128_bf16", "flash_fwd_ws")?,
                named("flash_fwd_drop_ws_d128_bf16", "flash_fwd_ws")?,
            )
        } else if hopper {
            // (head dim 64: static shared memory)
            (
                named("flash_fwd_wg_bf16", "flash_fwd_wg")?,
                named("flash_fwd_drop_wg_bf16", "flash_fwd_wg")?,
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
            dq: if hopper {
                named(
                    &format!("flash_bwd_dq_convert_ws{sfx}_bf16"),
                    "flash_bwd_dq_convert",
                )?
            } else {
                k("flash_bwd_dq_convert", "flash_bwd_dq_convert")?
            },
            dq_slabs: hopper,
            fwd_smem,
            bwd_smem,
            fwd_block,
            bwd_block,
            per_head: hd == 256,
            kv_sum: (hd == 256)
                .then(|| named("flash_bwd_kv_sum_d256_bf16", "flash_bwd_kv_sum"))
                .transpose()?,
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
pub(super) struct NormV8 {
    pub(super) fwd: Kern,
    /// The backward's dx pass (per width) and its column-sum pass.
    pub(super) bwd: Kern,
    pub(super) bwd_wb: Kern,
    /// One wave of the forward (blocks).
    pub(super) grid: u32,
    /// One wave of the backward's dx pass.
    pub(super) bwd_grid: u32,
}

impl Kernels {
    /// `half`: the fp16 build of the kernels (same names).
    pub(super) fn load(
        dev: &CudaDevice,
        stream: &CudaStream,
        c: usize,
        half: bool,
    ) -> Result<Self> {
        let named = |name: &str, group: &'static str| -> Result<Kern> {
            let f = load_function(dev, name, half)?;
            Ok(Kern { f, name: group })
        };
        let hopper = crate::engine::kernels::cuda::kernel_build(dev) == "sm90";
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
            qkv_split: f("qkv_split_gqa_bf16")?,
            heads_merge: f("heads_merge_bf16")?,
            heads_split: f("heads_split_bf16")?,
            kv_grads_merge: f("kv_grads_merge_bf16")?,
            softmax_fwd: f("step_softmax_fwd_bf16")?,
            softmax_bwd: f("step_softmax_bwd_bf16")?,
            embedding_bwd: f("embedding_bwd_bf16")?,
            rope: f("rope_qkv_bf16")?,
            qk_norm_fwd: f("qk_norm_fwd_bf16")?,
            qk_norm_bwd: f("qk_norm_bwd_bf16")?,
            qk_whole_fwd: f("qk_norm_whole_fwd_bf16")?,
            qk_whole_bwd: f("qk_norm_whole_bwd_bf16")?,
            swiglu_fwd: f("swiglu_fwd_v8_bf16")?,
            swiglu_bwd: f("swiglu_bwd_v8_bf16")?,
            dropout_rows: f("dropout_rows_v8_bf16")?,
            nf4_dequant: f("nf4_dequant_bf16")?,
            ggml_dequant: f("ggml_dequant_bf16")?,
            mamba: MambaKernels::load(&named)?,
            moe: MoeKernels::load(&named)?,
            flash64: Flash::load(&named, 64, hopper)?,
            flash128: crate::engine::kernels::cuda::flash_fits(dev, 128)
                .then(|| Flash::load(&named, 128, hopper))
                .transpose()?,
            flash256: crate::engine::kernels::cuda::flash_fits(dev, 256)
                .then(|| Flash::load(&named, 256, hopper))
                .transpose()?,
        })
    }
}

impl ModelStep {
    pub(super) fn launch(&self, k: &Kern, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        self.launch_on(&self.stream, k, cfg, args)
    }

    /// [`Self::launch`] on `stream` (the step's, or the side stream).
    pub(super) fn launch_on(
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
            unsafe { b.launch(cfg) }.map_err(|e| {
                // (the launch's shape in the error: a grid past the GPU's limits says which)
                err(format!(
                    "launching {} (grid {:?}, block {:?}, {} bytes of shared memory): {e:?}",
                    k.name, cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes
                ))
            })?;
            Ok(())
        })
    }

    /// Run `f` (launches on the stream) between two timing events when profiling.
    pub(super) fn timed(&self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
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

    /// The flash kernels of this model's head dim (one of [`crate::engine::spec::FLASH_HEAD_DIMS`]).
    pub(super) fn flash_kernels(&self) -> Result<&Flash> {
        let kernels = match self.hd {
            64 => return Ok(&self.k.flash64),
            128 => &self.k.flash128,
            256 => &self.k.flash256,
            hd => return Err(err(format!("no flash attention kernels at head dim {hd}"))),
        };
        kernels.as_ref().ok_or_else(|| {
            err(format!(
                "flash attention at head dim {} needs more shared memory a block than this GPU has",
                self.hd
            ))
        })
    }

    /// The attention soft-cap the flash kernels take (0: none); soft-capped flash attention
    /// exists at [`FLASH_SOFTCAP_HEAD_DIM`] only (the spec keeps other head dims off flash).
    pub(super) fn flash_cap(&self) -> Result<f32> {
        if self.attn_cap > 0.0 && self.hd != FLASH_SOFTCAP_HEAD_DIM {
            return Err(err(format!(
                "flash attention has no soft-cap at head dim {}",
                self.hd
            )));
        }
        Ok(self.attn_cap)
    }

    /// The flash backward writes each query head's share of dK, dV for a sum after it (head
    /// dim 256, whose backward takes a query head a block, with heads sharing key/value heads).
    pub(super) fn fa_per_head_kv(&self) -> bool {
        self.hd == 256 && self.n_head != self.n_kv_head
    }

    /// f32 words of the flash backward's dq accumulator for `b` sequences: [B·T, n_head·head_dim]
    /// with T rounded up to 16 (the Hopper backward adds 16-query slabs whole: flash_sm90.cu).
    pub(super) fn dq_acc_len(&self, b: usize) -> usize {
        b * self.t.next_multiple_of(16) * self.att_c
    }
}

/// Shared memory (bytes) of the chunk kernels: 64 × 72 tiles of 16-bit values (mamba.cuh's
/// MB_LDH) and per-position f32 vectors (the backward's for each of up to `MAMBA_HB` heads a
/// block: mamba.cuh's MB_HB).
pub(super) const TILE: u32 = 64 * 72 * 2;
pub(super) const MAMBA_HB: usize = 8;
/// The state walk over `ns` tiles of the state a block: a ring of three stages of 1 + ns
/// tiles (x, B) and two vectors (lam, dtv).
pub(super) const fn walk_smem(ns: u32) -> u32 {
    3 * ((1 + ns) * TILE + 2 * 64 * 4)
}
/// Its backward: two stages of 1 + 2·ns tiles (exp(lam)·dy, C, S), and a vector.
pub(super) const fn walk_bwd_smem(ns: u32) -> u32 {
    2 * (1 + 2 * ns) * TILE + 64 * 4
}
/// The chunk scan for state size `s` and `hb` heads a block: M and x, the step's S and the
/// chunk's C (64 state columns a tile each), and two vectors a head.
pub(super) const fn scan_smem(s: usize, hb: usize) -> u32 {
    (2 + 2 * s.div_ceil(64) as u32) * TILE + hb as u32 * 2 * 64 * 4
}
/// The scan's backward for `hb` heads a block: six tiles (C·Bᵀ's M, C, two buffers each of dy
/// and of x or S) and eight vectors a head (mamba.cuh's MB_SV).
pub(super) const fn scan_bwd_smem(hb: usize) -> u32 {
    6 * TILE + hb as u32 * 8 * 64 * 4
}
/// The scan's backward with the chunk states' share through x (its `down`) for state size
/// `s`: also the chunk's B and a step's R, a tile per 64 columns of the state each.
pub(super) const fn scan_bwd_fused_smem(hb: usize, s: usize) -> u32 {
    scan_bwd_smem(hb) + 2 * s.div_ceil(64) as u32 * TILE
}
/// The chunk states' backward for state size `s`: six tiles (two buffers of three), two vectors
/// a head and, where `summed` (more than one head a block), dB summed over the block's heads (64
/// rows of s + 4 f32).
pub(super) const fn state_bwd_smem(s: usize, summed: bool) -> u32 {
    let sum = if summed { 64 * (s as u32 + 4) * 4 } else { 0 };
    6 * TILE + MAMBA_HB as u32 * 2 * 64 * 4 + sum
}
/// The chunk states' dB alone (`MambaKernels::state_db`): two buffers of x and R's tile, or
/// where a head is one tile and the state two (`pair`: mamba_state.cuh's) of x and R's two, and
/// a vector a head.
pub(super) const fn state_db_smem(pair: bool) -> u32 {
    (if pair { 6 } else { 4 }) * TILE + MAMBA_HB as u32 * 64 * 4
}
pub(super) const CB_SMEM: u32 = 2 * TILE;
/// mamba_conv4s_bwd's shared memory (mamba_conv.cuh's MB_CONV_SCH channels × MB_CONV_SROWS
/// rows): its rows' inputs with 3 before and after them (bf16), their dxc with 3 after (f32).
pub(super) const CONV_SMEM: u32 = 128 * ((64 + 6) * 2 + (64 + 3) * 4);
/// mamba_conv4s_fwd's: its rows' inputs with the 3 before them.
pub(super) const CONV_FWD_SMEM: u32 = 128 * (64 + 3) * 2;

/// The kernels of mamba.cuh and its family (step/mamba_*.cuh; launched by mamba.rs). The chunk
/// scan's (forward 55 KB of shared memory a block at state 128, backward 56 KB with one head a
/// block, the chunk states' backward 58 KB with one; the state walks' 56 and 55 KB) are None on
/// a GPU that cannot give a block that much: `ModelStep::mamba_fwd` then says so.
pub(super) struct MambaKernels {
    /// The conv and its backward with a window of 4 taps (d_conv ≤ 4) and of 8 (d_conv ≤ 8),
    /// a channel a thread (mamba_conv.cuh's MB_CONV_BWD builds).
    pub(super) conv4_fwd: Kern,
    /// The forward with 4 taps through shared memory (`mamba_conv4s_fwd`).
    pub(super) conv4s_fwd: Kern,
    pub(super) conv4_bwd: Kern,
    /// The backward with 4 taps through shared memory (`mamba_conv4s_bwd`), where the GPU
    /// gives a block [`CONV_SMEM`].
    pub(super) conv4s_bwd: Option<Kern>,
    pub(super) conv_fwd: Kern,
    pub(super) dt_fwd: Kern,
    pub(super) chunk_cb: Kern,
    /// The chunks' start states (their own contributions and the passing, one walk), a
    /// block per 64 columns of the state; and, where the GPU gives a block the shared memory
    /// for it, per 128 columns (`walk2`: x read once for both, with its backward).
    pub(super) state_walk: Kern,
    pub(super) walk2: Option<(Kern, Kern)>,
    /// The chunk scan, its backward and the chunk states' backward (the last two more than 48
    /// KB of shared memory a block).
    pub(super) scan: Option<(Kern, Kern, Kern)>,
    /// The largest state (`mamba_d_state`) the chunk scan's shared memory allows (256, 128 or
    /// 64: 128 on Turing's 64 KB).
    pub(super) scan_state: usize,
    /// The most heads a block of the scan's backward the GPU's shared memory allows (8, 4, 2
    /// or 1: 4 on Turing's 64 KB).
    pub(super) scan_bwd_hb: usize,
    /// The largest state (`mamba_d_state`: 128 or 64; 0 none) for which the scan's backward
    /// takes the chunk states' share through x as well (`scan_bwd_fused_smem`) at as many
    /// blocks an SM as without it, with `scan_bwd_hb` heads a block.
    pub(super) fused_state: usize,
    /// The chunk states' backward's dB alone, beside the fused scan's backward.
    pub(super) state_db: Kern,
    /// The largest state (`mamba_d_state`, 256 at most) for which the chunk states' backward
    /// has the shared memory to sum dB over several heads a block (0: none); past it its
    /// blocks take one head each.
    pub(super) head_sum_state: usize,
    pub(super) gnorm_fwd: Kern,
    pub(super) gnorm_bwd: Kern,
    pub(super) zero: Kern,
    /// The state passing's backward (one walk over the chunks from the last).
    pub(super) state_walk_bwd: Kern,
    pub(super) dt_bwd: Kern,
    pub(super) conv_bwd: Kern,
}

impl MambaKernels {
    pub(super) fn load(named: &dyn Fn(&str, &'static str) -> Result<Kern>) -> Result<Self> {
        let allow = |k: &Kern, bytes: u32| -> bool {
            k.f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .is_ok()
        };
        let scan = named("mamba_chunk_scan_bf16", "mamba_scan")?;
        let scan_bwd = named("mamba_chunk_scan_bwd_bf16", "mamba_scan_bwd")?;
        let state_bwd = named("mamba_chunk_state_bwd_bf16", "mamba_chunk_state_bwd")?;
        let head_sum_state = [256, 128, 64]
            .into_iter()
            .find(|&s| allow(&state_bwd, state_bwd_smem(s, true)))
            .unwrap_or(0);
        let state_walk = named("mamba_state_walk_bf16", "mamba_state_walk")?;
        let scan_bwd_hb = [MAMBA_HB, 4, 2, 1]
            .into_iter()
            .find(|&hb| allow(&scan_bwd, scan_bwd_smem(hb)))
            .unwrap_or(0);
        let state_db = named("mamba_chunk_state_db_bf16", "mamba_chunk_state_db")?;
        let blocks = |smem: u32| {
            scan_bwd
                .f
                .occupancy_max_active_blocks_per_multiprocessor(256, smem as usize, None)
                .unwrap_or(0)
        };
        let fused_state = [128, 64]
            .into_iter()
            .find(|&s| {
                let fused = scan_bwd_fused_smem(scan_bwd_hb, s);
                scan_bwd_hb > 0
                    && allow(&state_db, state_db_smem(true))
                    && allow(&scan_bwd, fused)
                    && blocks(fused) >= blocks(scan_bwd_smem(scan_bwd_hb)).max(1)
            })
            .unwrap_or(0);
        let scan_state = [256, 128, 64]
            .into_iter()
            .find(|&s| allow(&scan, scan_smem(s, MAMBA_HB)))
            .unwrap_or(0);
        let state_walk_bwd = named("mamba_state_walk_bwd_bf16", "mamba_state_walk_bwd")?;
        let walk2 = (
            named("mamba_state_walk2_bf16", "mamba_state_walk")?,
            named("mamba_state_walk2_bwd_bf16", "mamba_state_walk_bwd")?,
        );
        let walk2 =
            (allow(&walk2.0, walk_smem(2)) && allow(&walk2.1, walk_bwd_smem(2))).then_some(walk2);
        let fits = allow(&state_walk, walk_smem(1))
            && allow(&state_walk_bwd, walk_bwd_smem(1))
            && scan_state > 0
            && scan_bwd_hb > 0
            && (head_sum_state > 0 || allow(&state_bwd, state_bwd_smem(0, false)));
        let scan = fits.then_some((scan, scan_bwd, state_bwd));
        let conv4s_bwd = named("mamba_conv4s_bwd_bf16", "mamba_conv_bwd")?;
        let conv4s_bwd = allow(&conv4s_bwd, CONV_SMEM).then_some(conv4s_bwd);
        Ok(Self {
            conv4_fwd: named("mamba_conv4_fwd_bf16", "mamba_conv")?,
            conv4s_fwd: named("mamba_conv4s_fwd_bf16", "mamba_conv")?,
            conv4_bwd: named("mamba_conv4_bwd_bf16", "mamba_conv_bwd")?,
            conv4s_bwd,
            conv_fwd: named("mamba_conv_fwd_bf16", "mamba_conv")?,
            dt_fwd: named("mamba_dt_fwd_bf16", "mamba_dt")?,
            chunk_cb: named("mamba_chunk_cb_bf16", "mamba_cb")?,
            state_walk,
            walk2,
            scan,
            scan_state,
            scan_bwd_hb,
            fused_state,
            state_db,
            head_sum_state,
            gnorm_fwd: named("mamba_gnorm_fwd_bf16", "mamba_gated_norm")?,
            gnorm_bwd: named("mamba_gnorm_bwd_bf16", "mamba_gated_norm_bwd")?,
            zero: named("mamba_zero_cols_f32", "mamba_zero")?,
            state_walk_bwd,
            dt_bwd: named("mamba_dt_bwd_bf16", "mamba_dt_bwd")?,
            conv_bwd: named("mamba_conv_bwd_bf16", "mamba_conv_bwd")?,
        })
    }

    /// The state walk and its backward for a state of `state` columns, and how many tiles of
    /// 64 state columns a block takes: two where they come in pairs and the GPU has the
    /// pair's kernels, else one.
    pub(super) fn walks(&self, state: usize) -> (&Kern, &Kern, usize) {
        match &self.walk2 {
            Some((f, b)) if state.is_multiple_of(128) => (f, b, 2),
            _ => (&self.state_walk, &self.state_walk_bwd, 1),
        }
    }

    /// The conv's forward for `d_conv` taps: the 4-tap window where it fits, through shared
    /// memory where `vec` (as [`Self::conv_backward`]'s), else a channel a thread.
    pub(super) fn conv_forward(&self, d_conv: usize, vec: bool) -> ConvKern<'_> {
        match (d_conv <= 4, vec) {
            (true, true) => ConvKern {
                k: &self.conv4s_fwd,
                threads: 128,
                walkers: 1,
                rows: 64,
                smem: CONV_FWD_SMEM,
            },
            (true, false) => ConvKern::one(&self.conv4_fwd),
            _ => ConvKern::one(&self.conv_fwd),
        }
    }

    /// The conv's backward for `d_conv` taps: the 4-tap window where it fits, through shared
    /// memory where `vec` (the channels, row strides and addresses take its 16-byte copies:
    /// mamba.rs's `conv_vec`) and the GPU gives the block its rows, else a channel a thread.
    pub(super) fn conv_backward(&self, d_conv: usize, vec: bool) -> ConvKern<'_> {
        match (d_conv <= 4, vec, &self.conv4s_bwd) {
            (true, true, Some(k)) => ConvKern {
                k,
                threads: 256,
                walkers: 2,
                rows: 64,
                smem: CONV_SMEM,
            },
            (true, ..) => ConvKern::one(&self.conv4_bwd),
            _ => ConvKern::one(&self.conv_bwd),
        }
    }
}

/// A conv kernel and its launch shape: threads a block, rows a block and
/// shared memory (a channel a thread over 128 × 128: mamba_conv.cuh's MB_CONV_ROWS, or the
/// shared-memory builds' MB_CONV_SCH channels × MB_CONV_SROWS rows).
#[derive(Clone, Copy)]
pub(super) struct ConvKern<'a> {
    pub(super) k: &'a Kern,
    pub(super) threads: u32,
    /// Threads a channel (each over its share of the block's rows: mamba_conv.cuh's
    /// MB_CONV_SPLIT).
    pub(super) walkers: u32,
    pub(super) rows: usize,
    /// Dynamic shared memory a block.
    pub(super) smem: u32,
}

impl<'a> ConvKern<'a> {
    /// A channel a thread, 128 threads over 128 rows (mamba_conv.cuh's MB_CONV_ROWS).
    fn one(k: &'a Kern) -> Self {
        Self {
            k,
            threads: 128,
            walkers: 1,
            rows: 128,
            smem: 0,
        }
    }
}

/// The routed experts' kernels (moe.cuh; launched by moe.rs).
pub(super) struct MoeKernels {
    pub(super) route: Kern,
    pub(super) sort: Kern,
    pub(super) gather: Kern,
    pub(super) combine: Kern,
    pub(super) pair_bwd: Kern,
    pub(super) router_bwd: Kern,
}

impl MoeKernels {
    pub(super) fn load(named: &dyn Fn(&str, &'static str) -> Result<Kern>) -> Result<Self> {
        Ok(Self {
            route: named("moe_route", "moe_route")?,
            sort: named("moe_sort", "moe_sort")?,
            gather: named("moe_gather", "moe_gather")?,
            combine: named("moe_combine", "moe_combine")?,
            pair_bwd: named("moe_pair_bwd", "moe_pair_bwd")?,
            router_bwd: named("moe_router_bwd", "moe_router_bwd")?,
        })
    }
}
