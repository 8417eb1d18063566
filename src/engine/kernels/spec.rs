//! What the whole-model CUDA step is built from ([`StepWeights`]): the model's weights and the
//! shape switches, handed over by `Model::step_weights` — the model depends on this module,
//! not the other way round.

use crate::config::Recompute;
use crate::engine::kernels::nf4::Nf4;
use candle_core::Var;
use std::sync::Arc;

/// A weight and its optional bias (norms) for the whole-model step.
pub type WeightBias = (Var, Option<Var>);

/// A linear layer's matrix for the whole-model step: a parameter, or a frozen LoRA base
/// matrix in NF4 (`lora.base_dtype = "nf4"`), which the step dequantizes where it is used.
#[derive(Clone, Debug)]
pub enum StepMatrix {
    Var(Var),
    Nf4(Arc<Nf4>),
}

impl StepMatrix {
    /// Output features.
    pub fn rows(&self) -> candle_core::Result<usize> {
        match self {
            StepMatrix::Var(v) => v.as_tensor().dim(0),
            StepMatrix::Nf4(q) => Ok(q.out),
        }
    }
}

/// A linear layer's matrix and optional bias.
pub type LinearWB = (StepMatrix, Option<Var>);

/// A LoRA adapter for the whole-model step: `y += scale·(x·Aᵀ)·Bᵀ`.
#[derive(Clone, Debug)]
pub struct StepLora {
    pub a: Var,
    pub b: Var,
    pub scale: f64,
}

/// The head dims flash.cu has kernels for; other head dims materialise the attention
/// probabilities (multi-head attention without dropout only).
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];

/// The dynamic shared memory (bytes) flash.cu's forward and backward kernels for head dim `hd`
/// launch with (its FA_FWD_D128_SMEM and FA_BWD_D128_SMEM; 0 where the memory is static, at
/// most 48 KB).
pub fn flash_smem(hd: usize) -> (u32, u32) {
    if hd == 64 {
        (0, 0)
    } else {
        (
            5 * 64 * 128 * 2,
            (2 * 64 * 128 + 4 * 64 * 128 + 64 * 64) * 2,
        )
    }
}

/// Dynamic shared memory of the Hopper (wgmma) forward for head dim `hd`: the mma.sync
/// forward's, and 1 KB to start the tiles on a 1024-byte boundary where it is dynamic (head dim
/// 64's is static: 0).
pub fn flash_fwd_wg_smem(hd: usize) -> u32 {
    match flash_smem(hd).0 {
        0 => 0,
        bytes => bytes + 1024,
    }
}

/// Dynamic shared memory of the warp-specialized Hopper backward for head dim 64 (flash_sm90.cu's
/// FA_WS_SMEM: K and V of 128 keys, two ring slots of Q and dO, two slots of dS^T for 128 keys —
/// twelve 64 x 64 bf16 tiles — the 64 x 64 fp32 dQ staging tile, and 1 KB to align them).
pub const FLASH_BWD_WS_SMEM: u32 = 12 * 64 * 64 * 2 + 64 * 64 * 4 + 1024;

/// Dynamic shared memory of the Hopper backward for head dim 128 (flash_sm90.cu's
/// FA_WG_D128_SMEM: K, V and two buffers of Q and dO as 64 x 128 bf16 tiles, dS^T 64 x 64, and
/// 1 KB to align them to 1024 bytes; two blocks an SM).
pub const FLASH_BWD_WG_D128_SMEM: u32 = 6 * 64 * 128 * 2 + 64 * 64 * 2 + 1024;

/// The projections a LoRA adapter can sit on, as indices of [`StepLayer::lora`].
pub const LORA_TARGETS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// The group of each of [`LORA_TARGETS`]: adapters that read the same input (q, k, v: the
/// normed block input; gate, up: the normed MLP input) form one group, whose A matrices the
/// step stacks into one matmul and whose input one LoRA-dropout mask covers.
pub const LORA_TARGET_GROUP: [usize; 7] = [0, 0, 0, 1, 2, 2, 3];

/// One transformer block's weights for the whole-model step.
#[derive(Clone, Debug)]
pub struct StepLayer {
    pub ln1: WeightBias,
    pub q: LinearWB,
    pub k: LinearWB,
    pub v: LinearWB,
    pub o: LinearWB,
    pub ln2: WeightBias,
    /// SwiGLU's gate projection (None: a GELU MLP).
    pub gate: Option<LinearWB>,
    pub up: LinearWB,
    pub down: LinearWB,
    /// LoRA adapters on q k v o gate up down ([`LORA_TARGETS`]' order).
    pub lora: [Option<StepLora>; 7],
}

/// A model's weights and shape for the whole-model CUDA step (`Model::step_weights`): any
/// family the model's `Shape` describes — LayerNorm or RMSNorm, GELU or SwiGLU, biases or none,
/// multi-head or grouped-query attention, learned positions or RoPE, tied or untied head.
#[derive(Clone, Debug)]
pub struct StepWeights {
    /// fp16 activations and operands (the fp16 build of the kernels; the gradients carry the
    /// loss scale) instead of bf16.
    pub half: bool,
    pub wte: Var,
    /// Learned positions, or None with RoPE.
    pub wpe: Option<Var>,
    /// RoPE's inverse frequencies per rotated pair (head_dim / 2), None with learned positions.
    pub rope_inv_freq: Option<Vec<f64>>,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub seq_len: usize,
    /// RMSNorm (else LayerNorm).
    pub rms: bool,
    /// Causal flash attention (head dim 64 or 128); otherwise the probabilities are materialised
    /// (multi-head attention only).
    pub flash: bool,
    /// Bias, GELU and bias gradients fused into the matmuls (cuBLASLt epilogues); otherwise
    /// separate kernels.
    pub epilogues: bool,
    /// Time cuBLASLt's candidate algorithms per matmul shape once and keep the fastest.
    pub autotune: bool,
    /// Replay each micro-batch as a captured CUDA graph.
    pub graphs: bool,
    /// Weight gradients and bias sums on a second stream in the backward.
    pub overlap: bool,
    /// Dropout probability (embedding, attention probabilities, block outputs; needs flash
    /// attention), masks from the dropout module's Philox as the candle model draws them.
    pub dropout: f64,
    /// Dropout on the LoRA adapters' input (`lora.dropout`), one mask per layer and
    /// [`LORA_TARGET_GROUP`] at the dropout module's `site_lora`.
    pub lora_dropout: f64,
    /// Each LoRA group on a 16-bit base's q|k|v and gate|up as one `[W | B]` matrix
    /// (`kernels.lora_concat`).
    pub lora_concat: bool,
    /// Granite's multipliers (1, 1, 1 elsewhere): on the embedding, on each block's attention
    /// and MLP output before the residual add, and the logits' divisor.
    pub embedding_multiplier: f64,
    pub residual_multiplier: f64,
    pub logits_scaling: f64,
    /// The attention scores' scale: 1/√head_dim, or Granite's attention multiplier.
    pub attention_scale: f64,
    pub layers: Vec<StepLayer>,
    /// LoRA fine-tuning: every base weight is frozen (one bf16 copy, no gradient, no
    /// optimizer state); only the adapters train.
    pub frozen_base: bool,
    /// Which activations the backward recomputes instead of keeping.
    pub recompute: Recompute,
    pub ln_f: WeightBias,
    /// The untied LM head, or None when it is `wte`.
    pub head: Option<Var>,
    /// Data-parallel ranks the flat gradient buffer is split over (ZeRO-1's reduce-scatter
    /// needs its length to be a multiple of them); 1 otherwise.
    pub shards: usize,
    pub eps: f64,
}
