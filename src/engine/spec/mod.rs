//! The one description of a model ([`ModelSpec`]): derived once from the config (or from a
//! Hugging Face `config.json`: `hf::spec`), read by both executors — the
//! candle model (`engine::model`) and the whole-model CUDA step (`engine::kernels`) — and by
//! everything that reasons about the model before it exists: the memory check, the run
//! header, the parameter count, the SCU penalty, resuming and `cockpit check`.
//!
//! Nothing here touches a device: what a GPU can do comes in as [`StepFacts`].

use crate::config::{
    Activation, Arch, BlockLayout, Config, HybridConfig, KernelsConfig, ModelConfig, Norm,
    PosEncoding, QkNorm, Recompute, RopeScaling,
};

pub use count::ParamCount;
pub use mamba_flops::MambaFlops;

mod count;
mod decode_memory;
mod layers;
mod mamba_flops;
mod resume;
mod rope;
mod support;

pub use resume::ResumeKey;
pub use rope::{RopeFreqs, RopeKey};
pub use support::{NoFlash, Reason, StepFacts, FLASH_HEAD_DIMS, FLASH_SOFTCAP_HEAD_DIM};

/// LoRA adapters on the model (`[lora]` with `enabled = true`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub r: usize,
    pub alpha: f64,
    /// Short names: q k v o up down gate.
    pub targets: Vec<String>,
    /// Dropout probability on the adapters' input while training.
    pub dropout: f64,
}

/// Everything that fixes the model: its family, shape, arithmetic and adapters.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// The family the config names (`model.arch`) and the notes of what resolved it
    /// (`model.arch_notes`: a Hugging Face `model_type`, overridden keys).
    pub arch: Arch,
    pub arch_notes: Vec<String>,
    pub vocab_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_embd: usize,
    pub seq_len: usize,
    /// The MLP's inner width ([`mlp_width`]).
    pub hidden: usize,
    pub norm: Norm,
    pub norm_eps: f64,
    pub pos: PosEncoding,
    pub rope_theta: f64,
    pub activation: Activation,
    pub tie_embeddings: bool,
    pub bias: bool,
    /// Dropout probability at every site of [`crate::engine::dropout`] (embedding, attention
    /// probabilities, block outputs).
    pub dropout: f64,
    pub init_std: f64,
    /// Which fused CUDA kernels the forward/backward uses (ignored on the CPU).
    pub kernels: KernelsConfig,
    /// Width of one head (n_head · head_dim may differ from n_embd).
    pub head_dim: usize,
    /// Biases on q, k and v even when `bias` is off (Qwen2).
    pub qkv_bias: bool,
    /// Rows of the learned position table (≥ seq_len; generation may use them all).
    pub n_positions: usize,
    /// RoPE frequency scaling; see `model::rope_inv_freq`.
    pub rope_scaling: RopeScaling,
    /// Granite: token embeddings × this.
    pub embedding_multiplier: f64,
    /// Granite: the attention score scale in place of 1/sqrt(head_dim).
    pub attention_multiplier: Option<f64>,
    /// Granite: attention and MLP outputs × this before each residual add.
    pub residual_multiplier: f64,
    /// Granite: logits ÷ this.
    pub logits_scaling: f64,
    /// QK-norm and post-norm blocks (Qwen3, OLMo 2), Gemma's sandwich norms, sliding layers
    /// and soft-capping ([`layers`]).
    pub layout: BlockLayout,
    /// A Granite 4.0 hybrid stack (Mamba-2 and attention layers, shared MLP, experts).
    pub hybrid: Option<HybridConfig>,
    /// What the fast step recomputes in the backward (the per-op path keeps autograd's).
    /// Not part of [`Self::resume_key`]: it changes what the step keeps, not the model.
    pub recompute: Recompute,
    /// LoRA adapters, when `lora.enabled`.
    pub lora: Option<LoraSpec>,
    /// SCU's Gaussian prior width (`scu.prior_sigma`): the penalty's scale
    /// ([`Self::scu_coefficient`]).
    pub prior_sigma: f64,
}

/// The MLP's inner width for `model.mlp_ratio`: `round(n_embd · ratio)`, at least 1. The one
/// place it is computed (the model, a base's key check, the Hugging Face export).
pub fn mlp_width(n_embd: usize, mlp_ratio: f64) -> usize {
    ((n_embd as f64 * mlp_ratio).round() as usize).max(1)
}

impl ModelSpec {
    /// The spec of `c`'s model with a vocabulary of `vocab_size` (the data's, when
    /// `model.vocab_size` is 0).
    pub fn from_config(c: &Config, vocab_size: usize) -> Self {
        let mut s = Self::from_model(&c.model, vocab_size);
        s.kernels = c.kernels;
        s.lora = c.lora.enabled.then(|| LoraSpec {
            r: c.lora.r,
            alpha: c.lora.alpha,
            targets: c.lora.targets.clone(),
            dropout: c.lora.dropout,
        });
        s.prior_sigma = c.scu.prior_sigma;
        s
    }

    /// The spec of a `[model]` table alone (default kernels, no LoRA): what a Hugging Face
    /// config or a checkpoint's model describes.
    pub fn from_model(m: &ModelConfig, vocab_size: usize) -> Self {
        let defaults = Config::default();
        Self {
            arch: m.arch,
            arch_notes: m.arch_notes.clone(),
            vocab_size,
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: m.kv_heads(),
            n_embd: m.n_embd,
            seq_len: m.seq_len,
            hidden: mlp_width(m.n_embd, m.mlp_ratio),
            norm: m.norm,
            norm_eps: m.norm_eps,
            pos: m.pos,
            rope_theta: m.rope_theta,
            activation: m.activation,
            tie_embeddings: m.tie_embeddings,
            bias: m.bias,
            dropout: m.dropout,
            init_std: m.init_std,
            kernels: defaults.kernels,
            head_dim: m.head_size(),
            qkv_bias: m.qkv_bias,
            n_positions: m.n_positions.max(m.seq_len),
            rope_scaling: m.rope_scaling.clone(),
            embedding_multiplier: m.embedding_multiplier,
            attention_multiplier: (m.attention_multiplier != 0.0).then_some(m.attention_multiplier),
            residual_multiplier: m.residual_multiplier,
            logits_scaling: m.logits_scaling,
            layout: m.layout.clone(),
            hybrid: m.hybrid.clone(),
            recompute: m.recompute,
            lora: None,
            prior_sigma: defaults.scu.prior_sigma,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The attention score scale: Granite's multiplier, else 1/sqrt(head_dim).
    pub fn attention_scale(&self) -> f64 {
        self.attention_multiplier
            .unwrap_or_else(|| 1.0 / (self.head_dim as f64).sqrt())
    }

    /// Whether the attention layers rotate q and k (RoPE; a hybrid's attention may have no
    /// position encoding at all).
    pub fn rope(&self) -> bool {
        self.pos == PosEncoding::Rope && self.hybrid.as_ref().is_none_or(|h| h.rope)
    }

    /// A gated MLP (SwiGLU or GeGLU), else GELU.
    pub fn gated_mlp(&self) -> bool {
        self.activation.gated()
    }

    /// The width of the attention's q (and output projection's input): n_head · head_dim.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The widths of the q and k norms' scales, when the block has QK-norm: one head's
    /// (Qwen3), or the whole q and k projections' (OLMo 2).
    pub fn qk_norm_widths(&self) -> Option<(usize, usize)> {
        match self.layout.qk_norm {
            QkNorm::None => None,
            QkNorm::Head => Some((self.head_dim, self.head_dim)),
            QkNorm::Whole => Some((self.q_width(), self.kv_width())),
        }
    }

    /// The width of k and of v: n_kv_head · head_dim.
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// The factor on λ·Σw² in the SCU-regularized loss: `1 / (2σ² · tokens per epoch)` (a
    /// Gaussian prior of width `scu.prior_sigma`, spread over an epoch's tokens).
    pub fn scu_coefficient(&self, tokens_per_epoch: f64) -> f64 {
        1.0 / (2.0 * self.prior_sigma.powi(2) * tokens_per_epoch)
    }

    /// The family for the run header: the arch, what it resolved to, and the notes of any
    /// explicit key that overrode the family's default.
    pub fn family(&self) -> String {
        let kv = if self.n_kv_head == self.n_head {
            String::new()
        } else {
            format!(" GQA {}/{}", self.n_head, self.n_kv_head)
        };
        let mut out = format!(
            "{:?} ({:?} {:?} {:?}{}{}{})",
            self.arch,
            self.norm,
            self.pos,
            self.activation,
            if self.bias { " bias" } else { " no-bias" },
            if self.tie_embeddings {
                " tied"
            } else {
                " untied"
            },
            kv,
        )
        .to_lowercase();
        match self.layout.qk_norm {
            QkNorm::None => {}
            QkNorm::Head => out.push_str(" qk-norm/head"),
            QkNorm::Whole => out.push_str(" qk-norm"),
        }
        if self.layout.post_norm {
            out.push_str(" post-norm");
        }
        if self.layout.rotary_dim != 0 {
            out.push_str(&format!(" rope {}/{}", self.rotary_dim(), self.head_dim));
        }
        out.push_str(&self.layers_family());
        if let Some(h) = &self.hybrid {
            let mamba = h
                .layers
                .iter()
                .filter(|k| **k == crate::config::MixerKind::Mamba);
            out.push_str(&format!(
                " hybrid {} mamba/{} layers{}",
                mamba.count(),
                self.n_layer,
                if h.rope { "" } else { " nope" }
            ));
            if h.experts > 0 {
                out.push_str(&format!(" moe {}/{}", h.experts_top_k, h.experts));
            }
        }
        if !self.arch_notes.is_empty() {
            out.push_str(&format!(" [{}]", self.arch_notes.join(", ")));
        }
        out
    }
}

#[cfg(test)]
mod tests;
