//! Qwen3 (dense): the Llama block with RMSNorm on each head's q and k before RoPE
//! (`self_attn.q_norm`, `self_attn.k_norm`, `[head_dim]`), an explicit head_dim, no biases.

use super::config_keys::{full_attention_only, Keys};
use crate::config::{BlockLayout, ModelConfig, QkNorm};
use serde_json::{Map, Value};

pub(super) const ARCHITECTURE: &str = "Qwen3ForCausalLM";

/// Qwen3Config's default head_dim (not hidden_size / num_attention_heads).
pub(super) const DEFAULT_HEAD_DIM: usize = 128;

/// The block Qwen3's keys describe (and refusals of what cockpit does not compute).
pub(super) fn layout(k: &mut Keys) -> Result<BlockLayout, String> {
    let bias = k.bool("attention_bias", false)?;
    k.require(
        "attention_bias",
        bias,
        false,
        "cockpit has no Qwen3 attention biases (q, k, v and o)",
    )?;
    full_attention_only(k)?;
    Ok(BlockLayout {
        qk_norm: QkNorm::Head,
        ..BlockLayout::PLAIN
    })
}

/// Whether Qwen3 computes `m` (a Llama-like model, no biases or multipliers checked by the
/// caller): per-head QK-norm, pre-norm.
pub(super) fn fits(m: &ModelConfig) -> bool {
    m.layout
        == BlockLayout {
            qk_norm: QkNorm::Head,
            ..BlockLayout::PLAIN
        }
}

/// Qwen3's own config.json keys.
pub(super) fn config_json(o: &mut Map<String, Value>) {
    o.insert("attention_bias".into(), Value::Bool(false));
    o.insert("use_sliding_window".into(), Value::Bool(false));
}
