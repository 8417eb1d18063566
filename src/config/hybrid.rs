//! `[model.hybrid]`: a Granite 4.0 hybrid stack (transformers' `granitemoehybrid`): Mamba-2
//! layers with an attention layer here and there, a shared SwiGLU MLP in every layer (width
//! `model.mlp_ratio`, weights `shared_mlp.input_linear` = gate | up and
//! `shared_mlp.output_linear`), and optionally routed experts beside it.

use serde::{Deserialize, Serialize};

/// What a layer of the hybrid stack mixes the sequence with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixerKind {
    /// A Mamba-2 state-space layer (`mamba.*` weights).
    Mamba,
    /// Causal self-attention (`self_attn.*` weights).
    Attention,
}

/// The hybrid stack's own keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HybridConfig {
    /// One kind per layer (`model.n_layer` of them).
    pub layers: Vec<MixerKind>,
    /// RoPE in the attention layers (`position_embedding_type = "rope"`); false: no position
    /// encoding at all (NoPE, Granite 4.0's own).
    pub rope: bool,
    /// Mamba-2 heads, the width of each (heads · head width = the inner width), the state size,
    /// the groups sharing B and C, the causal conv's width and the scan's chunk length.
    pub mamba_n_heads: usize,
    pub mamba_d_head: usize,
    pub mamba_d_state: usize,
    pub mamba_n_groups: usize,
    pub mamba_d_conv: usize,
    pub mamba_chunk_size: usize,
    /// A bias on the causal conv; biases on in_proj and out_proj.
    pub mamba_conv_bias: bool,
    pub mamba_proj_bias: bool,
    /// The time step's limits (`time_step_limit`): dt is clamped to [dt_min, dt_max].
    pub dt_min: f64,
    /// None: no upper limit.
    pub dt_max: Option<f64>,
    /// Routed experts (`num_local_experts`; 0: the shared MLP alone), how many each token
    /// uses (`num_experts_per_tok`) and their width (`intermediate_size`).
    pub experts: usize,
    pub experts_top_k: usize,
    pub expert_hidden: usize,
    /// The load-balancing loss's weight in the training loss (transformers'
    /// `router_aux_loss_coef`, where `output_router_logits` is on; 0: not added).
    pub router_aux_loss_coef: f64,
}

impl Default for HybridConfig {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            rope: false,
            mamba_n_heads: 8,
            mamba_d_head: 16,
            mamba_d_state: 16,
            mamba_n_groups: 1,
            mamba_d_conv: 4,
            mamba_chunk_size: 256,
            mamba_conv_bias: true,
            mamba_proj_bias: false,
            dt_min: 0.0,
            dt_max: None,
            experts: 0,
            experts_top_k: 0,
            expert_hidden: 0,
            router_aux_loss_coef: 0.0,
        }
    }
}

impl HybridConfig {
    /// The Mamba mixer's inner width: heads · head width.
    pub fn mamba_inner(&self) -> usize {
        self.mamba_n_heads * self.mamba_d_head
    }

    /// The causal conv's channels: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.mamba_inner() + 2 * self.mamba_n_groups * self.mamba_d_state
    }

    /// in_proj's output: the gate z, x | B | C, and dt per head.
    pub fn in_proj_width(&self) -> usize {
        self.mamba_inner() + self.conv_dim() + self.mamba_n_heads
    }

    /// Whether layer `l` is a Mamba layer.
    pub fn is_mamba(&self, l: usize) -> bool {
        self.layers.get(l) == Some(&MixerKind::Mamba)
    }

    /// What is wrong with these keys for a model of `n_layer` layers of width `n_embd`
    /// (`(key, value, why)`), if anything.
    pub fn problem(&self, n_layer: usize) -> Option<(&'static str, String, String)> {
        if self.layers.len() != n_layer {
            return Some((
                "model.hybrid.layers",
                format!("{} entries", self.layers.len()),
                format!("needs one kind per layer (model.n_layer = {n_layer})"),
            ));
        }
        for (key, v) in [
            ("model.hybrid.mamba_n_heads", self.mamba_n_heads),
            ("model.hybrid.mamba_d_head", self.mamba_d_head),
            ("model.hybrid.mamba_d_state", self.mamba_d_state),
            ("model.hybrid.mamba_n_groups", self.mamba_n_groups),
            ("model.hybrid.mamba_d_conv", self.mamba_d_conv),
            ("model.hybrid.mamba_chunk_size", self.mamba_chunk_size),
        ] {
            if v == 0 {
                return Some((key, "0".into(), "must be at least 1".into()));
            }
        }
        if !self.mamba_n_heads.is_multiple_of(self.mamba_n_groups) {
            return Some((
                "model.hybrid.mamba_n_groups",
                self.mamba_n_groups.to_string(),
                format!("must divide mamba_n_heads ({})", self.mamba_n_heads),
            ));
        }
        if self.experts > 0 && (self.experts_top_k == 0 || self.experts_top_k > self.experts) {
            return Some((
                "model.hybrid.experts_top_k",
                self.experts_top_k.to_string(),
                format!("must be in 1..={} (model.hybrid.experts)", self.experts),
            ));
        }
        if self.experts > 0 && self.expert_hidden == 0 {
            return Some((
                "model.hybrid.expert_hidden",
                "0".into(),
                "routed experts need a width".into(),
            ));
        }
        let ordered = self.dt_min >= 0.0 && self.dt_max.is_none_or(|m| m > self.dt_min);
        if !ordered {
            return Some((
                "model.hybrid.dt_min",
                format!("{} (dt_max {:?})", self.dt_min, self.dt_max),
                "needs 0 ≤ dt_min < dt_max".into(),
            ));
        }
        None
    }
}
