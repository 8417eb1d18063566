//! OLMo 2: post-norm blocks (RMSNorm on the attention and MLP outputs before each residual
//! add: `post_attention_layernorm`, `post_feedforward_layernorm`; none on their inputs) and
//! RMSNorm over the whole q and k projections before RoPE (`self_attn.q_norm`
//! `[n_head·head_dim]`, `self_attn.k_norm` `[n_kv_head·head_dim]`), no biases.

use super::config_keys::Keys;
use crate::config::{BlockLayout, ModelConfig, QkNorm};
use serde_json::{Map, Value};

pub(super) const ARCHITECTURE: &str = "Olmo2ForCausalLM";

fn olmo2_layout() -> BlockLayout {
    BlockLayout {
        qk_norm: QkNorm::Whole,
        post_norm: true,
        ..BlockLayout::PLAIN
    }
}

/// The block OLMo 2's keys describe (and refusals of what cockpit does not compute).
pub(super) fn layout(k: &mut Keys) -> Result<BlockLayout, String> {
    let bias = k.bool("attention_bias", false)?;
    k.require(
        "attention_bias",
        bias,
        false,
        "cockpit has no OLMo 2 attention biases (q, k, v and o)",
    )?;
    Ok(olmo2_layout())
}

/// Whether OLMo 2 computes `m` (a Llama-like model, no biases or multipliers checked by the
/// caller): QK-norm over the whole projections, post-norm.
pub(super) fn fits(m: &ModelConfig) -> bool {
    m.layout == olmo2_layout() && m.head_size() * m.n_head == m.n_embd
}

/// OLMo 2's own config.json keys (Olmo2Config has no head_dim: it is hidden / heads).
pub(super) fn config_json(o: &mut Map<String, Value>) {
    o.remove("head_dim");
    o.insert("attention_bias".into(), Value::Bool(false));
}
