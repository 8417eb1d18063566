//! Fused CUDA kernels (CUDA C in `kernels.cu`, compiled to PTX by build.rs with the `cuda`
//! feature) wired in as candle custom ops with their backward passes:
//!
//! - [`causal_softmax`]: scale + causal mask + softmax over attention scores, and its backward;
//! - [`layer_norm`] / [`rms_norm`]: one kernel forward, one backward (dx, dw, db together);
//! - [`cross_entropy_rows`]: softmax cross-entropy straight from the compute-dtype logits
//!   (no f32 copy of the logits; the gradient is written in the compute dtype);
//! - [`bias_add`], [`bias_gelu`]: bias (+ tanh-GELU) over a matmul output, bias grads by a
//!   column-sum kernel instead of a broadcast reduction;
//! - [`sumsq`] and [`adamw_multi`]: the global gradient norm and AdamW over all parameters,
//!   one multi-tensor launch each (a small pointer table goes up per step), AdamW in place on
//!   the fp32 master weights and moments, clipping folded in as a gradient scale;
//! - [`flash_rows`]: flash attention's forward over a batch whose rows skip keys (a
//!   generation's left-padded prefill);
//! - [`decode_attention`]: a generation step's attention, each row's new query against its
//!   cached keys and values (no autograd);
//! - [`mamba_decode`]: a generation step through a hybrid's Mamba-2 layer, from in_proj's
//!   output to the gated norm's, its conv window and scan state carried (no autograd);
//! - [`linear`], [`causal_attention_qkv`], [`embedding`]: whole layers as single autograd
//!   nodes with hand-written backward passes (fewer graph edges: candle's backprop
//!   materialises a zero tensor and an add for every edge).
//!
//! The model and optimizer use them only where [`usable`] says so (a CUDA tensor in f32, bf16
//! or f16) and the `[kernels]` config switch is on; everywhere else the plain candle
//! composition runs, which is also the reference the GPU tests compare against.

use candle_core::{DType, Tensor};
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod buckets;
pub mod ggml;
pub mod nf4;
pub mod quantized;
pub mod spec;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;
#[cfg(feature = "cuda")]
mod lt;
#[cfg(feature = "cuda")]
mod reduce;
#[cfg(feature = "cuda")]
mod side;
#[cfg(feature = "cuda")]
mod step;
#[cfg(feature = "cuda")]
pub use step::{flash_rows, flash_rows_takes, ModelStep};
pub mod rows;
pub use rows::Rows;

/// Which build of the fused kernels a CUDA device loads, and what that means (for the run
/// header and `cockpit check`); None off CUDA.
pub fn build_note(device: &candle_core::Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return Some(match cuda::kernel_build(d) {
            "sm75" => "kernels built for compute_75: the per-op fused kernels, and the \
                       whole-model step in fp16 (flash attention on m16n8k8 tensor cores; bf16 \
                       needs compute capability 8.0)"
                .to_string(),
            "sm90" => "kernels built for compute_90a: flash attention (its backward on Hopper's \
                       warpgroup tensor cores) and the whole-model step"
                .to_string(),
            _ => {
                "kernels built for compute_80: flash attention and the whole-model step".to_string()
            }
        });
    }
    let _ = device;
    None
}

/// Whether the whole-model step can run on this device in `dtype`: a CUDA GPU that loads the
/// compute_80 kernels (bf16 or fp16), or the compute_75 ones in fp16 (flash attention through
/// m16n8k8 tensor-core instructions). Err says why not.
pub fn step_support(device: &candle_core::Device, dtype: DType) -> Result<(), String> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return match (cuda::kernel_build(d), dtype) {
            ("sm75", DType::F16) => Ok(()),
            ("sm75", _) => Err("compute capability below 8.0 runs the step in fp16 only \
                                (bf16 tensor-core instructions need 8.0): precision.dtype = \"f16\""
                .into()),
            _ => Ok(()),
        };
    }
    let _ = (device, dtype);
    Err("not on a CUDA device".into())
}

/// Whether flash attention's kernels for head dim `hd` fit this GPU's shared memory per block
/// (head dim 128 asks 80 KB forward and 104 KB backward: more than a T4's 64 KB).
pub fn flash_fits(device: &candle_core::Device, hd: usize) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return cuda::flash_fits(d, hd);
    }
    let _ = (device, hd);
    true
}

/// Whether the fused kernels can take this tensor: built with CUDA, on a CUDA device, in a
/// floating dtype the kernels are instantiated for.
pub fn usable(t: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && t.device().is_cuda()
        && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// `dst ← src` in `dst`'s dtype, both contiguous 1-D tensors (or views) of one length: the
/// packing of data-parallel gradient sums in bf16 (`distributed.reduce_dtype`). One kernel
/// on CUDA for f32 ↔ bf16, candle's cast elsewhere.
pub fn convert_into(src: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if usable(src)
        && usable(dst)
        && matches!(
            (src.dtype(), dst.dtype()),
            (DType::F32, DType::BF16) | (DType::BF16, DType::F32)
        )
    {
        return cuda::wire_convert(src, dst);
    }
    dst.slice_set(&src.to_dtype(dst.dtype())?, 0, 0)
}

/// Where a decoding row's new query may look ([`decode_attention`]): columns `lo..len` of the
/// cache, those its padding mask leaves at 0; scores `scale·q·k`, soft-capped where
/// `softcap > 0`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSpan {
    pub lo: usize,
    pub len: usize,
    pub scale: f32,
    pub softcap: f32,
}

/// A decode step's columns read from the device at run time ([`decode_attention_at`]): `at`
/// `[2]` (u32) holds the new column and the columns filled after it (the `len` of a
/// [`DecodeSpan`]); a sliding layer's query looks at the last `window` of them. The launch's
/// arguments are the same at every step, as those of a step captured in a CUDA graph must be.
#[derive(Clone, Copy, Debug)]
pub struct DecodeAt<'a> {
    pub at: &'a Tensor,
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: f32,
}

/// The sizes of a hybrid's Mamba-2 layer for [`mamba_decode`]: `heads` of `head_dim`
/// columns, a `state` per head row, B and C in `groups`, a conv of `conv_k` taps; dt
/// clamped to `dt_limits` where given; the gated norm's `eps`.
#[derive(Clone, Copy, Debug)]
pub struct MambaDecode {
    pub heads: usize,
    pub head_dim: usize,
    pub state: usize,
    pub groups: usize,
    pub conv_k: usize,
    pub dt_limits: Option<(f32, f32)>,
    pub eps: f32,
}

/// Scalars of one fused AdamW update ([`adamw_multi`], [`adamw_update`]).
#[derive(Clone, Copy, Debug)]
pub struct AdamWArgs {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `1 − lr·wd`: the factor on parameters with weight decay.
    pub decay: f64,
    /// Bias corrections `1 − βᵗ`.
    pub bc1: f64,
    pub bc2: f64,
    /// Multiplies the gradient first (clipping).
    pub grad_scale: f64,
}

/// The bf16 compute copy of one weight inside a [`ModelStep`] (its device address, valid while
/// the step is borrowed): the fused AdamW writes the updated weight there too, which saves
/// the step its cast pass.
#[derive(Clone, Copy)]
pub struct WeightCopy<'a> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) addr: u64,
    pub(crate) _step: std::marker::PhantomData<&'a ModelStep>,
}

#[cfg(not(feature = "cuda"))]
mod cpu_stubs {
    //! Without CUDA the fused kernels do not exist; [`super::usable`] is always false, so
    //! these are never reached from the model. They fail plainly if called anyway.
    use candle_core::{Result, Tensor};

    fn no_cuda<T>() -> Result<T> {
        Err(candle_core::Error::Msg(
            "fused kernels need a build with the cuda feature".into(),
        ))
    }
    pub fn causal_softmax(_att: &Tensor, _scale: f64) -> Result<Tensor> {
        no_cuda()
    }
    pub fn layer_norm(_x: &Tensor, _w: &Tensor, _b: &Tensor, _eps: f64) -> Result<Tensor> {
        no_cuda()
    }
    pub fn rms_norm(_x: &Tensor, _w: &Tensor, _eps: f64) -> Result<Tensor> {
        no_cuda()
    }
    pub fn cross_entropy_rows(_logits: &Tensor, _targets: &Tensor) -> Result<Tensor> {
        no_cuda()
    }
    pub fn bias_add(_x: &Tensor, _b: &Tensor) -> Result<Tensor> {
        no_cuda()
    }
    pub fn bias_gelu(_x: &Tensor, _b: &Tensor) -> Result<Tensor> {
        no_cuda()
    }
    pub fn copy_multi(_pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        no_cuda()
    }
    pub fn sumsq(_grads: &[Tensor]) -> Result<f64> {
        no_cuda()
    }
    pub fn sum_sq(t: &Tensor) -> Result<Tensor> {
        t.sqr()?.sum_all()
    }
    pub fn linear(_x: &Tensor, _w: &Tensor, _b: Option<&Tensor>) -> Result<Tensor> {
        no_cuda()
    }
    pub fn causal_attention_qkv(_qkv: &Tensor, _n_head: usize, _scale: f64) -> Result<Tensor> {
        no_cuda()
    }
    pub struct AdamItem<'a> {
        pub w: &'a Tensor,
        pub g: &'a Tensor,
        pub m: &'a Tensor,
        pub v: &'a Tensor,
        pub decay: bool,
        pub copy: Option<super::WeightCopy<'a>>,
    }
    pub fn adamw_multi(_items: &[AdamItem], _a: &super::AdamWArgs) -> Result<()> {
        no_cuda()
    }
    pub fn lm_head_cross_entropy(_x: &Tensor, _head: &Tensor, _t: &Tensor) -> Result<Tensor> {
        no_cuda()
    }
    pub fn embedding(_ids: &Tensor, _w: &Tensor) -> Result<Tensor> {
        no_cuda()
    }
    pub fn dropout_mask(
        _device: &candle_core::Device,
        _shape: (usize, usize),
        _seed: u64,
        _site: u32,
        _p: f64,
        _layout: crate::engine::dropout::Layout,
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn nf4_quantize(_w: &Tensor, _bg: (usize, usize)) -> Result<(Tensor, Tensor, Tensor)> {
        no_cuda()
    }
    pub fn nf4_dequantize(
        _parts: (&Tensor, &Tensor, &Tensor),
        _shape: (usize, usize),
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn ggml_dequantize(
        _data: &Tensor,
        _format: (u32, usize, usize),
        _shape: (usize, usize),
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn adamw_update(
        _w: &Tensor,
        _g: &Tensor,
        _m: &Tensor,
        _v: &Tensor,
        _a: &super::AdamWArgs,
    ) -> Result<()> {
        no_cuda()
    }
    pub fn decode_attention_takes(_n_head: usize, _n_kv_head: usize, _hd: usize) -> bool {
        false
    }
    pub fn decode_attention(
        _q: &Tensor,
        _keys: &Tensor,
        _values: &Tensor,
        _mask: &Tensor,
        _span: super::DecodeSpan,
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn flash_rows_takes(_device: &candle_core::Device, _hd: usize, _softcap: f32) -> bool {
        false
    }
    pub fn flash_rows(
        _qkv: &Tensor,
        _starts: &Tensor,
        _n_head: usize,
        _n_kv_head: usize,
        _scale: f32,
        _softcap: f32,
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn decode_attention_at(
        _q: &Tensor,
        _keys: &Tensor,
        _values: &Tensor,
        _mask: &Tensor,
        _at: super::DecodeAt,
    ) -> Result<Tensor> {
        no_cuda()
    }
    pub fn mamba_decode_takes(_d: &super::MambaDecode) -> bool {
        false
    }
    #[allow(clippy::too_many_arguments)]
    pub fn mamba_decode(
        _proj: &Tensor,
        _hist: &Tensor,
        _conv_w: &Tensor,
        _conv_b: Option<&Tensor>,
        _dt_bias: &Tensor,
        _a_log: &Tensor,
        _dskip: &Tensor,
        _norm_w: &Tensor,
        _state: &Tensor,
        _d: &super::MambaDecode,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        no_cuda()
    }
}
#[cfg(not(feature = "cuda"))]
pub use cpu_stubs::*;

#[cfg(not(feature = "cuda"))]
mod step_stub {
    //! Without CUDA there is no whole-model step: `Model::step_weights` is always None on the
    //! CPU, so the trainer never builds one.
    use super::spec::StepWeights;
    use candle_core::{Result, Tensor, Var};

    fn no_cuda<T>() -> Result<T> {
        Err(candle_core::Error::Msg(
            "the whole-model step needs a build with the cuda feature".into(),
        ))
    }

    pub struct ModelStep;

    impl ModelStep {
        pub fn new(_w: &StepWeights) -> Result<Self> {
            no_cuda()
        }
        pub fn grad_of(&self, _var: &Var) -> Result<Option<Tensor>> {
            no_cuda()
        }
        pub fn grad_buffer(&self) -> Option<&Tensor> {
            None
        }
        pub fn begin(&mut self, _weights_copied: bool) -> Result<()> {
            no_cuda()
        }
        pub fn weight_copy(&self, _var: &Var) -> Option<super::WeightCopy<'_>> {
            None
        }
        pub fn weight_copy_at(&self, _var: &Var, _at: usize) -> Option<super::WeightCopy<'_>> {
            None
        }
        pub fn weight_buffer(&self) -> Option<&Tensor> {
            None
        }
        pub fn weight_count(&self) -> usize {
            0
        }
        pub fn graphs_captured(&self) -> usize {
            0
        }
        pub fn micro(&mut self, _i: &[u32], _t: &[u32], _b: usize, _g: f32) -> Result<()> {
            no_cuda()
        }
        pub fn micro_rows(&mut self, _r: &super::Rows, _g: f32) -> Result<()> {
            no_cuda()
        }
        pub fn loss(&self) -> Result<f64> {
            no_cuda()
        }
        pub fn add_scaled_weights(&mut self, _vars: &[&Var], _a: f64) -> Result<()> {
            no_cuda()
        }
        pub fn add_scaled_pieces(&mut self, _p: &[(&Var, usize, usize)], _a: f64) -> Result<()> {
            no_cuda()
        }
        pub fn eval_losses(&mut self, _r: &super::Rows, _w: bool) -> Result<Vec<f64>> {
            no_cuda()
        }
        pub fn set_head_chunk_rows(&mut self, _rows: Option<usize>) {}
        pub fn set_mlp_chunk_rows(&mut self, _rows: Option<usize>) {}
        pub fn set_dropout_seed(&mut self, _seed: u64) {}
        pub fn overlaps_grad_sums(&self) -> bool {
            false
        }
        pub fn set_grad_sum_now(&mut self, _on: bool) {}
        pub fn set_profiling(&mut self, _on: bool) {}
        pub fn take_profile(&self) -> Result<Vec<crate::engine::events::KernelTime>> {
            Ok(Vec::new())
        }
    }
}
#[cfg(not(feature = "cuda"))]
pub use step_stub::ModelStep;
