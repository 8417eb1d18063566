//! Gemma 3 as llama.cpp's `gemma3` architecture. Its converter stores every RMSNorm weight
//! as `1 + w` (llama.cpp's RMSNorm multiplies by the weight as stored), so export adds 1 and
//! import takes it off. The block's four norms are `attn_norm`, `post_attention_norm`,
//! `ffn_norm` (before the MLP) and `post_ffw_norm`; the per-head q/k norms `attn_q_norm` and
//! `attn_k_norm`. The embedding scale √hidden is implied by the architecture. llama.cpp reads
//! the window from `attention.sliding_window`, which layers slide from
//! `attention.sliding_window_pattern` (a period: every p-th layer full; 6 where absent), the
//! sliding layers' RoPE θ from `rope.freq_base_swa` (10000 where absent) and the logit
//! soft-cap from `final_logit_softcapping`; the score scale it derives from the shape
//! (1/√head_dim; 1/√(hidden/heads) at 62 layers, Gemma 3 27B), so cockpit writes its own in
//! `attention.scale` as well and reads it back where present.
//!
//! Gemma 2 is llama.cpp's `gemma2`: the same tensors but the q/k norms, one RoPE θ, every other
//! layer sliding (the even ones; no pattern key), `attn_logit_softcapping` and
//! `final_logit_softcapping`, and the score scale 1/√head_dim (1/√(hidden/heads) at 46 layers,
//! Gemma 2 27B).

use super::reader::{Gguf, Meta};
use super::writer::Value;
use crate::config::ModelConfig;
use candle_core::Tensor;
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

/// Gemma 3's block norms under llama.cpp's names (before the Llama table).
pub const NAMES: &[(&str, &str)] = &[
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
];

/// The sliding layers' RoPE θ and the layer period llama.cpp assumes where a file says none.
const DEFAULT_LOCAL_THETA: f64 = 10_000.0;
const DEFAULT_PERIOD: usize = 6;

/// The score scale llama.cpp computes for a `gemma3` (or `gemma2`) file without
/// `attention.scale`.
pub fn llama_cpp_scale(
    arch: &str,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    head_dim: usize,
) -> f64 {
    let big = if arch == "gemma2" { 46 } else { 62 };
    let d = if n_layer == big {
        n_embd / n_head.max(1)
    } else {
        head_dim
    };
    1.0 / (d.max(1) as f64).sqrt()
}

fn scale_of(m: &ModelConfig) -> f64 {
    match m.attention_multiplier {
        0.0 => 1.0 / (m.head_size() as f64).sqrt(),
        a => a,
    }
}

/// Whether layer `i` slides under llama.cpp's period `p` (the last of every `p` is full).
fn slides(i: usize, p: usize) -> bool {
    i % p < p - 1
}

/// The period (1 ..= n_layer + 1) whose rule gives each layer's kind, if one does.
fn period(kinds: &[bool]) -> Option<usize> {
    (1..=kinds.len() + 1).find(|&p| kinds.iter().enumerate().all(|(i, &s)| s == slides(i, p)))
}

/// Gemma 3's own `gemma3.*` keys, or Gemma 2's `gemma2.*` (beside the common ones); `context`
/// positions.
pub fn hyperparameters(arch: &str, m: &ModelConfig, context: usize) -> Vec<(String, Value)> {
    let l = &m.layout;
    let k = |s: &str| format!("{arch}.{s}");
    let kinds: Vec<bool> = (0..m.n_layer).map(|i| l.window_of(i).is_some()).collect();
    let pattern = match period(&kinds) {
        Some(p) => Value::U32(p as u32),
        None => Value::Bools(kinds),
    };
    // (No sliding layer: a window of the whole context, which any reader computes as full.)
    let window = if l.has_sliding() { l.window } else { context };
    let local = if l.local_rope_theta > 0.0 {
        l.local_rope_theta
    } else {
        m.rope_theta
    };
    let mut kv = vec![
        (k("attention.sliding_window"), Value::U32(window as u32)),
        (k("attention.scale"), Value::F32(scale_of(m) as f32)),
    ];
    if arch == "gemma2" {
        if l.attn_softcap > 0.0 {
            kv.push((
                k("attn_logit_softcapping"),
                Value::F32(l.attn_softcap as f32),
            ));
        }
    } else {
        kv.push((k("attention.sliding_window_pattern"), pattern));
        kv.push((k("rope.freq_base_swa"), Value::F32(local as f32)));
    }
    if l.final_softcap > 0.0 {
        kv.push((
            k("final_logit_softcapping"),
            Value::F32(l.final_softcap as f32),
        ));
    }
    kv
}

/// What llama.cpp computes otherwise than cockpit for this model (as `arch`).
pub fn notes(arch: &str, m: &ModelConfig) -> Vec<String> {
    let mut notes = Vec::new();
    let ours = scale_of(m);
    let theirs = llama_cpp_scale(arch, m.n_layer, m.n_embd, m.n_head, m.head_size());
    if (ours - theirs).abs() > 1e-6 * theirs {
        notes.push(format!(
            "the attention scale {ours:.6} (query_pre_attn_scalar {:.4}) is written as {arch}.attention.scale; llama.cpp ignores that key and scales by {theirs:.6}, so it computes another model",
            1.0 / (ours * ours)
        ));
    }
    let l = &m.layout;
    if arch == "gemma2"
        && l.has_sliding()
        && (0..m.n_layer).any(|i| l.window_of(i).is_some() != slides(i, 2))
    {
        notes.push("llama.cpp's gemma2 slides every other layer (the even ones), which this model's layer_types do not: it computes another model".into());
    }
    if arch == "gemma3" && l.attn_softcap > 0.0 {
        notes.push(format!(
            "llama.cpp's gemma3 has no attention soft-cap (this model's is {}): it computes another model",
            l.attn_softcap
        ));
    }
    notes
}

/// Every RMSNorm weight plus `by` (export: +1, import: −1).
pub fn shift_norms(
    tensors: impl IntoIterator<Item = (String, Tensor)>,
    by: f64,
) -> Result<Vec<(String, Tensor)>, String> {
    tensors
        .into_iter()
        .map(|(n, t)| {
            if n.ends_with("norm.weight") {
                let s = (&t + by).map_err(|e| format!("{n}: {e}"))?;
                Ok((n, s))
            } else {
                Ok((n, t))
            }
        })
        .collect()
}

/// [`shift_norms`] in place on a map of tensors.
pub fn shift_norms_in(by_name: &mut HashMap<String, Tensor>, by: f64) -> Result<(), String> {
    let all: Vec<(String, Tensor)> = by_name.drain().collect();
    by_name.extend(shift_norms(all, by)?);
    Ok(())
}

/// A `gemma3` (or `gemma2`) file's config.json keys beyond the Llama ones in `c` (as
/// `gemma3_text`, or `gemma2`).
pub fn config(
    arch: &str,
    g: &Gguf,
    c: &mut Map<String, Json>,
    n_layer: usize,
) -> Result<(), String> {
    let get = |s: &str| g.get(&format!("{arch}.{s}"));
    let n = |s: &str| c.get(s).and_then(Json::as_u64).unwrap_or(0) as usize;
    let (n_embd, n_head, hd) = (n("hidden_size"), n("num_attention_heads"), n("head_dim"));
    let scale = get("attention.scale")
        .and_then(Meta::as_f64)
        .unwrap_or_else(|| llama_cpp_scale(arch, n_layer, n_embd, n_head, hd));
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(format!(
            "{arch}.attention.scale = {scale}: expected a positive number"
        ));
    }
    let window = get("attention.sliding_window")
        .and_then(Meta::as_usize)
        .unwrap_or(0);
    let kinds: Vec<bool> = match get("attention.sliding_window_pattern") {
        _ if window == 0 => vec![false; n_layer],
        _ if arch == "gemma2" => (0..n_layer).map(|i| slides(i, 2)).collect(),
        None => (0..n_layer).map(|i| slides(i, DEFAULT_PERIOD)).collect(),
        Some(Meta::Array(a)) if a.len() == n_layer => a
            .iter()
            .map(|b| match b {
                Meta::Bool(b) => Ok(*b),
                other => Err(format!(
                    "{arch}.attention.sliding_window_pattern: {other:?} is no true/false"
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => match v.as_usize().filter(|p| *p > 0) {
            Some(p) => (0..n_layer).map(|i| slides(i, p)).collect(),
            None => {
                return Err(format!(
                "{arch}.attention.sliding_window_pattern = {v:?}: expected a period or one true/false per layer ({n_layer})"
            ))
            }
        },
    };
    let types: Vec<&str> = kinds
        .iter()
        .map(|&s| match s {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    let local = get("rope.freq_base_swa")
        .and_then(Meta::as_f64)
        .unwrap_or(DEFAULT_LOCAL_THETA);
    // query_pre_attn_scalar = scale⁻², the integer it is within f32's rounding
    let scalar = 1.0 / (scale * scale);
    let scalar = if (scalar - scalar.round()).abs() < 1e-6 * scalar {
        scalar.round()
    } else {
        scalar
    };
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    c.insert("layer_types".into(), json!(types));
    c.insert("sliding_window".into(), json!(window.max(1)));
    // (null where the file has none: transformers' Gemma 2 defaults would set caps)
    let cap = get("final_logit_softcapping").and_then(Meta::as_f64);
    c.insert("final_logit_softcapping".into(), json!(cap));
    if arch == "gemma2" {
        let cap = get("attn_logit_softcapping").and_then(Meta::as_f64);
        c.insert("attn_logit_softcapping".into(), json!(cap));
    } else {
        c.insert("rope_local_base_freq".into(), json!(local));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_llama_cpps() {
        // Gemma 3's published pattern: five sliding layers, then a full one.
        let g: Vec<bool> = (0..12).map(|i| (i + 1) % 6 != 0).collect();
        assert_eq!(period(&g), Some(6));
        assert_eq!(period(&[true, false, true, false]), Some(2));
        assert_eq!(period(&[false, false]), Some(1));
        assert_eq!(period(&[true, true, true]), Some(4));
        assert_eq!(period(&[false, true, true]), None);
        let scale = |a, l, e, h, d| llama_cpp_scale(a, l, e, h, d);
        assert!((scale("gemma3", 62, 5376, 32, 128) - 1.0 / 168f64.sqrt()).abs() < 1e-12);
        assert!((scale("gemma3", 26, 1152, 4, 256) - 1.0 / 16.0).abs() < 1e-12);
        // Gemma 2 27B (46 layers, 4608 / 32 heads = 144) and 9B (head dim 256)
        assert!((scale("gemma2", 46, 4608, 32, 128) - 1.0 / 12.0).abs() < 1e-12);
        assert!((scale("gemma2", 42, 3584, 16, 256) - 1.0 / 16.0).abs() < 1e-12);
    }
}
