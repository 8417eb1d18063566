//! `model.layout`: what a model family changes in the Llama block (set by the Hugging Face
//! import of Qwen3, OLMo 2 and Phi-3; written into checkpoints only where it is not the plain block).

use serde::{Deserialize, Serialize};

/// RMSNorm on q and k before RoPE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QkNorm {
    #[default]
    None,
    /// Each head's q and k normalized on its own, one `[head_dim]` scale shared by the heads
    /// (Qwen3, Gemma 3).
    Head,
    /// q and k normalized over the whole projection, `[n_head·head_dim]` and
    /// `[n_kv_head·head_dim]` scales (OLMo 2).
    Whole,
}

/// The block's arrangement beyond the Llama one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlockLayout {
    /// "none", "head" (Qwen3) or "whole" (OLMo 2): RMSNorm on q and k before RoPE
    /// (weights `self_attn.q_norm`, `self_attn.k_norm`).
    pub qk_norm: QkNorm,
    /// OLMo 2: the block's norms apply to the attention and MLP outputs before each residual
    /// add (`post_attention_layernorm`, `post_feedforward_layernorm`), not to their inputs.
    pub post_norm: bool,
    /// Phi-3: RoPE rotates the first `rotary_dim` dims of each head and passes the rest
    /// (`partial_rotary_factor`); 0 = the whole head.
    pub rotary_dim: usize,
}

impl BlockLayout {
    /// The Llama block: no QK-norm, pre-norm.
    pub fn is_plain(&self) -> bool {
        *self == Self::default()
    }
}
