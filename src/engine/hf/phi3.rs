//! Phi-3 (and Phi-4-mini's layout): the Llama block with q|k|v fused in `self_attn.qkv_proj`
//! and gate|up fused in `mlp.gate_up_proj` (split on load, joined on export), RoPE on the first
//! `partial_rotary_factor` of each head, no biases. `longrope` scaling is refused by the RoPE
//! reader (its frequencies switch with the sequence length; cockpit does not compute it).

use super::config_keys::Keys;
use super::{corrupt, HfInfo};
use crate::config::ModelConfig;
use crate::engine::checkpoint::CheckpointError;
use candle_core::Tensor;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::Path;

pub(super) const ARCHITECTURE: &str = "Phi3ForCausalLM";

/// The rotated dims of a head for `partial_rotary_factor` (transformers: `int(head_dim ·
/// factor)`), even and at least 2.
pub(super) fn rotary_dim(head_dim: usize, partial: f64) -> Result<usize, String> {
    let r = (head_dim as f64 * partial) as usize;
    if !(partial > 0.0 && partial <= 1.0) || r < 2 || !r.is_multiple_of(2) {
        return Err(format!(
            "partial_rotary_factor = {partial}: RoPE needs an even number of dims of the head ({head_dim}·{partial} = {r})"
        ));
    }
    Ok(if r == head_dim { 0 } else { r })
}

/// Phi-3's attention window (`sliding_window`; none where null or absent): cockpit refuses
/// sequences longer than it, where it would change the attention. Also reads the keys that
/// only longrope scaling (refused) would use.
pub(super) fn window(k: &mut Keys) -> Result<Option<usize>, String> {
    k.get("original_max_position_embeddings");
    let w = match k.get("sliding_window") {
        None => None,
        Some(_) => Some(k.usize("sliding_window", None)?),
    };
    Ok(w)
}

/// Whether Phi-3 computes `m` (a Llama-like model, no biases or multipliers checked by the
/// caller): no QK-norm, pre-norm, heads that add up to the width (Phi3Config has no head_dim).
pub(super) fn fits(m: &ModelConfig) -> bool {
    m.layout.qk_norm == crate::config::QkNorm::None
        && !m.layout.post_norm
        && m.head_size() * m.n_head == m.n_embd
}

/// Phi-3's own config.json keys.
pub(super) fn config_json(m: &ModelConfig, base: Option<&HfInfo>, o: &mut Map<String, Value>) {
    o.remove("head_dim");
    let hd = m.head_size();
    let rotary = match m.layout.rotary_dim {
        0 => hd,
        r => r,
    };
    o.insert(
        "partial_rotary_factor".into(),
        serde_json::json!(rotary as f64 / hd as f64),
    );
    // Phi3Config's default pad_token_id (32000) lies outside small vocabularies: say none
    // (the base's own, when it has one, is written after this).
    o.insert("pad_token_id".into(), Value::Null);
    let w = base.and_then(|b| b.sliding_window);
    o.insert("sliding_window".into(), serde_json::json!(w));
}

/// Phi-3's fused weights split into cockpit's (Llama) names: `qkv_proj` rows are q, then k,
/// then v; `gate_up_proj` rows gate, then up.
pub(super) fn split_fused(
    tensors: HashMap<String, Tensor>,
    m: &ModelConfig,
    dir: &Path,
) -> Result<HashMap<String, Tensor>, CheckpointError> {
    let (q, kv) = (m.n_head * m.head_size(), m.kv_heads() * m.head_size());
    let hidden = crate::engine::spec::mlp_width(m.n_embd, m.mlp_ratio);
    let mut out = HashMap::new();
    for (name, t) in tensors {
        let parts: &[(&str, usize)] = if name.ends_with(".self_attn.qkv_proj.weight") {
            &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        } else if name.ends_with(".mlp.gate_up_proj.weight") {
            &[("gate_proj", hidden), ("up_proj", hidden)]
        } else {
            out.insert(name, t);
            continue;
        };
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let n = t.dim(0).map_err(|e| corrupt(dir, format!("{name}: {e}")))?;
        if n != rows {
            return Err(corrupt(
                dir,
                format!("{name}: {n} rows, the config makes {rows}"),
            ));
        }
        // `model.layers.N.self_attn` of `model.layers.N.self_attn.qkv_proj.weight`.
        let prefix = name.rsplitn(3, '.').nth(2).unwrap_or_default().to_string();
        let mut at = 0;
        for (part, width) in parts {
            let piece = t
                .narrow(0, at, *width)
                .and_then(|p| p.contiguous())
                .map_err(|e| corrupt(dir, format!("{name}: {e}")))?;
            out.insert(format!("{prefix}.{part}.weight"), piece);
            at += width;
        }
    }
    Ok(out)
}

/// cockpit's tensors under Phi-3's names: q|k|v and gate|up joined.
pub(super) fn to_hf_names(
    tensors: Vec<(String, Tensor)>,
    n_layer: usize,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let mut out = Vec::new();
    for i in 0..n_layer {
        for (block, parts, fused) in [
            ("self_attn", &["q_proj", "k_proj", "v_proj"][..], "qkv_proj"),
            ("mlp", &["gate_proj", "up_proj"][..], "gate_up_proj"),
        ] {
            let p = format!("model.layers.{i}.{block}");
            let pieces = parts
                .iter()
                .map(|n| {
                    let key = format!("{p}.{n}.weight");
                    by_name
                        .remove(&key)
                        .ok_or_else(|| candle_core::Error::Msg(format!("{key}: missing")))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            out.push((format!("{p}.{fused}.weight"), Tensor::cat(&pieces, 0)?));
        }
    }
    let mut rest: Vec<(String, Tensor)> = by_name.into_iter().collect();
    rest.sort_by(|a, b| a.0.cmp(&b.0));
    out.extend(rest);
    Ok(out)
}
