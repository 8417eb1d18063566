//! `model.layout`: what a model family changes in the Llama block (set by the Hugging Face
//! import of Qwen3, OLMo 2, Phi-3 and Gemma 2/3; written into checkpoints only where it is not
//! the plain block).

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

/// What one layer's attention sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Every earlier position (causal).
    #[default]
    Full,
    /// The `window` positions ending at the query's own (Gemma 2/3's local layers).
    Sliding,
}

/// The block's arrangement beyond the Llama one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlockLayout {
    /// "none", "head" (Qwen3, Gemma 3) or "whole" (OLMo 2): RMSNorm on q and k before RoPE
    /// (weights `self_attn.q_norm`, `self_attn.k_norm`).
    pub qk_norm: QkNorm,
    /// OLMo 2: the block's norms apply to the attention and MLP outputs before each residual
    /// add (`post_attention_layernorm`, `post_feedforward_layernorm`), not to their inputs.
    pub post_norm: bool,
    /// Phi-3: RoPE rotates the first `rotary_dim` dims of each head and passes the rest
    /// (`partial_rotary_factor`); 0 = the whole head.
    pub rotary_dim: usize,
    /// Gemma 2/3: norms on both the inputs and the outputs of attention and MLP
    /// (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
    /// `post_feedforward_layernorm`).
    #[serde(skip_serializing_if = "is_false")]
    pub sandwich_norm: bool,
    /// Gemma: every RMSNorm scales by `1 + w` (its weights start at zero).
    #[serde(skip_serializing_if = "is_false")]
    pub norm_plus_one: bool,
    /// Each layer's attention, "full" or "sliding" (empty: every layer full).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layer_types: Vec<LayerKind>,
    /// The sliding layers' window in positions, the query's own included (`sliding_window`).
    #[serde(skip_serializing_if = "is_zero")]
    pub window: usize,
    /// Gemma 3: the sliding layers' RoPE θ (`rope_local_base_freq`; no `rope_scaling` on
    /// them); 0 = they rotate as the full layers do.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub local_rope_theta: f64,
    /// Gemma 2: attention scores become `cap·tanh(scores/cap)` before the mask; 0 = none.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub attn_softcap: f64,
    /// Gemma 2: logits become `cap·tanh(logits/cap)`; 0 = none.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub final_softcap: f64,
}

fn is_false(v: &bool) -> bool {
    !*v
}
fn is_zero(v: &usize) -> bool {
    *v == 0
}
fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

impl BlockLayout {
    /// The Llama block (usable in consts: `..BlockLayout::PLAIN`).
    pub const PLAIN: BlockLayout = BlockLayout {
        qk_norm: QkNorm::None,
        post_norm: false,
        rotary_dim: 0,
        sandwich_norm: false,
        norm_plus_one: false,
        layer_types: Vec::new(),
        window: 0,
        local_rope_theta: 0.0,
        attn_softcap: 0.0,
        final_softcap: 0.0,
    };

    /// The Llama block: no QK-norm, pre-norm.
    pub fn is_plain(&self) -> bool {
        *self == Self::default()
    }

    /// Layer `l`'s attention window (None: full causal attention).
    pub fn window_of(&self, l: usize) -> Option<usize> {
        (self.layer_types.get(l) == Some(&LayerKind::Sliding)).then_some(self.window)
    }

    /// Whether some layer attends through a sliding window.
    pub fn has_sliding(&self) -> bool {
        self.layer_types.contains(&LayerKind::Sliding)
    }

    /// Why this layout cannot describe an `n_layer`-layer model, as (key, value, why) (None:
    /// it can).
    pub fn problem(&self, n_layer: usize) -> Option<(&'static str, String, String)> {
        if !self.layer_types.is_empty() && self.layer_types.len() != n_layer {
            return Some((
                "model.layout.layer_types",
                format!("{} entries", self.layer_types.len()),
                format!("one per layer (model.n_layer = {n_layer})"),
            ));
        }
        if self.has_sliding() && self.window == 0 {
            return Some((
                "model.layout.window",
                "0".into(),
                "sliding layers need a window".into(),
            ));
        }
        if self.sandwich_norm && self.post_norm {
            return Some((
                "model.layout.sandwich_norm",
                "true".into(),
                "not with post_norm = true (a block has one arrangement)".into(),
            ));
        }
        for (key, v) in [
            ("model.layout.attn_softcap", self.attn_softcap),
            ("model.layout.final_softcap", self.final_softcap),
            ("model.layout.local_rope_theta", self.local_rope_theta),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Some((key, v.to_string(), "must be 0 (off) or positive".into()));
            }
        }
        None
    }
}
