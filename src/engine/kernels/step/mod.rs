//! The whole training step of a decoder-only model as one hand-scheduled CUDA program, built
//! from the model's shape ([`StepWeights`](super::spec::StepWeights)): LayerNorm or RMSNorm, GELU or SwiGLU MLP, biases
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

mod arena;
mod attention;
mod backward;
mod elementwise;
mod flash_rows;
mod forward;
mod gemm;
mod grad_sum;
mod graphs;
mod kernels;
mod lora;
mod mamba;
mod mamba_bufs;
mod moe;
mod moe_bufs;
mod moe_mm;
mod offload;
mod params;
mod run;
mod setup;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublas::CudaBlas;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::{CudaDevice, Result, Tensor, TensorId};
use half::bf16;

use self::arena::Arena;
pub use self::flash_rows::{flash_rows, flash_rows_takes};
use self::kernels::{Kernels, Mark};
use self::lora::Cat;
use self::mamba_bufs::MambaDims;
use self::moe::MoeHost;
use self::moe_bufs::MoeDims;
use self::params::{Entry, LayerIdx};
use super::cuda::err;
use super::lt::Lt;
use super::reduce::Overlap;
use super::side::Side;
use crate::config::Recompute;

/// Elements each sub-buffer is aligned to (256 bytes in bf16): cuBLAS and vector loads like it.
const ALIGN: usize = 128;

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// An error (naming what is wrong, from `what`) unless `ok`: the checks that guard raw device
/// memory — strides, column ranges — hold in release builds too.
fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(err(format!("whole-model step: {}", what())))
    }
}

/// A kernel argument (the launch builder borrows its arguments, so they live in a slice).
enum Arg {
    P(u64),
    I(i32),
    U(u32),
    F(f32),
    L(i64),
}

/// The whole-model step for one [`StepWeights`](super::spec::StepWeights) layout. Build it once per model; it sizes
/// its activation arena for the micro-batch it is given (and re-sizes when that changes).
pub struct ModelStep {
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
    /// A Granite 4.0 hybrid's Mamba dimensions (None: not a hybrid). Its Mamba layers
    /// ([`LayerIdx::mamba`](params::LayerIdx)) sit where attention would: in_proj is the
    /// layer's packed "qkv" projection, out_proj its "o"; its shared MLP's gate | up is one
    /// matrix.
    mamba: Option<MambaDims>,
    /// A hybrid's routed experts (None: none; every layer has them otherwise), the host's copy
    /// of their routing ([`MoeHost`]), the load-balancing loss's coefficient (0: not in the
    /// loss) and the running micro-batch's loss gradient scale for it (1/accum for a mean).
    moe: Option<MoeDims>,
    moe_host: RefCell<MoeHost>,
    moe_aux_coef: f64,
    moe_g: std::cell::Cell<f32>,
    /// The expert product kinds run as one grouped cuBLAS call (a bit a kind, moe_mm.rs; all
    /// of them unless the build lacks it or `COCKPIT_MOE_GROUPED=0`), else one call an expert.
    moe_grouped: std::cell::Cell<u8>,
    /// RMSNorm (else LayerNorm).
    rms: bool,
    /// Gemma's norms: every norm (and QK-norm) scales by 1 + w.
    plus_one: bool,
    /// OLMo 2's post-norm blocks: no norm before attention and MLP, one on each output
    /// ([`LayerIdx::post`](params::LayerIdx) holds them).
    post_norm: bool,
    /// QK-norm over the whole q and k projections (OLMo 2), not per head.
    qk_whole: bool,
    /// SwiGLU MLP (gate|up packed), else GELU.
    swiglu: bool,
    /// The gated MLP's gate is the tanh GELU (Gemma's GeGLU), not SiLU.
    geglu: bool,
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
    /// RoPE's rotations on the device, [T][hd/2] (cos, sin) ([`rope_table`](attention::rope_table); None: learned
    /// positions).
    rope: Option<CudaSlice<f32>>,
    /// Gemma 3's sliding layers' own RoPE table (`rope_local_base_freq`), and which layers
    /// read it.
    rope_local: Option<CudaSlice<f32>>,
    local_rope: Vec<bool>,
    /// The sliding layers' window (positions, the query's own included; 0: no sliding layer),
    /// and which layers slide.
    window: usize,
    sliding: Vec<bool>,
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
    /// The bf16 scratch a quantized base matrix is dequantized into before a matmul reads it.
    _quant_buf: CudaSlice<bf16>,
    quant_p: u64,
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
    /// Dropout: the keep threshold (0: none) and a kept element's scale ([`crate::engine::dropout`]).
    drop_thr: u32,
    /// What the backward recomputes instead of keeping ([`Recompute`]).
    recompute: Recompute,
    /// Rows per LM-head chunk, when set ([`Self::set_head_chunk_rows`]).
    head_chunk_rows: Option<usize>,
    /// Rows per MLP chunk where the MLP is recomputed, when set ([`Self::set_mlp_chunk_rows`]).
    mlp_chunk_rows: Option<usize>,
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
    /// Gemma 2's soft-caps (0: none): the attention scores' (materialised attention's
    /// softmax) and the logits' (the cross-entropy kernels).
    attn_cap: f32,
    final_cap: f32,
    /// The next micro-batch's dropout seed ([`Self::set_dropout_seed`]).
    drop_seed: u64,
    /// RoPE's dims of each head (the head dim; fewer with Phi-3's partial rotary).
    rotary_dim: usize,
    /// The running micro-batch packs several samples a row: attention and RoPE read the
    /// arena's sample starts ([`Self::starts_ptr`]).
    packed: bool,
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
