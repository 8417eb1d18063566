//! Phi-3 as llama.cpp's `phi3` architecture: q|k|v fused in `attn_qkv` and gate|up in
//! `ffn_up` (gate first: llama.cpp's SwiGLU splits the fused rows in halves), the rotated dims
//! of a head in `rope.dimension_count`, the attention window in `attention.sliding_window` (0:
//! none), and LongRoPE as llama.cpp's converter writes it: the `rope_factors_long` and
//! `rope_factors_short` tensors, `rope.scaling.attn_factor` and
//! `rope.scaling.original_context_length`.

use super::reader::{Gguf, Meta};
use super::writer::Value;
use crate::config::{ModelConfig, RopeScaling};
use crate::engine::hf::HfInfo;
use candle_core::Tensor;
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

pub const LONG: &str = "rope_factors_long.weight";
pub const SHORT: &str = "rope_factors_short.weight";

/// The dims RoPE rotates in each head.
pub fn rotated(m: &ModelConfig) -> usize {
    match m.layout.rotary_dim {
        0 => m.head_size(),
        r => r,
    }
}

/// Phi-3's own `phi3.*` keys (beside the common ones): the window and LongRoPE's.
pub fn hyperparameters(m: &ModelConfig, hf: Option<&HfInfo>) -> Vec<(String, Value)> {
    let window = hf.and_then(|h| h.sliding_window).unwrap_or(0);
    let mut kv = vec![(
        "phi3.attention.sliding_window".to_string(),
        Value::U32(window as u32),
    )];
    if let RopeScaling::LongRope {
        original_max_position_embeddings,
        attention_factor,
        ..
    } = &m.rope_scaling
    {
        kv.push((
            "phi3.rope.scaling.attn_factor".into(),
            Value::F32(*attention_factor as f32),
        ));
        kv.push((
            "phi3.rope.scaling.original_context_length".into(),
            Value::U32(*original_max_position_embeddings as u32),
        ));
    }
    kv
}

/// LongRoPE's per-frequency factors as llama.cpp's tensors (none without LongRoPE).
pub fn rope_factors(m: &ModelConfig) -> Vec<(&'static str, Vec<f32>)> {
    match &m.rope_scaling {
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } => {
            let f32s = |v: &[f64]| v.iter().map(|x| *x as f32).collect();
            vec![(LONG, f32s(long_factor)), (SHORT, f32s(short_factor))]
        }
        _ => Vec::new(),
    }
}

/// Phi-3's fused matrices out of cockpit's separate ones.
pub fn fuse_layers(by_name: &mut HashMap<String, Tensor>, n_layer: usize) -> Result<(), String> {
    for i in 0..n_layer {
        super::fuse::fuse(
            by_name,
            i,
            &["attn_q", "attn_k", "attn_v"],
            "attn_qkv",
            "weight",
        )?;
        super::fuse::fuse(by_name, i, &["ffn_gate", "ffn_up"], "ffn_up", "weight")?;
    }
    Ok(())
}

/// A `phi3` file's own config.json keys (beside the Llama ones in `c`): the partial rotary,
/// the window and LongRoPE back as Hugging Face's `rope_scaling`.
pub fn config(
    g: &Gguf,
    c: &mut Map<String, Json>,
    head_dim: usize,
    context: usize,
) -> Result<(), String> {
    let rd = g
        .get("phi3.rope.dimension_count")
        .and_then(Meta::as_usize)
        .unwrap_or(head_dim);
    c.insert(
        "partial_rotary_factor".into(),
        json!(rd as f64 / head_dim.max(1) as f64),
    );
    let window = g
        .get("phi3.attention.sliding_window")
        .and_then(Meta::as_usize)
        .filter(|w| *w > 0);
    c.insert("sliding_window".into(), json!(window));
    // llama.cpp's own default for the original context is the trained one.
    let original = g
        .get("phi3.rope.scaling.original_context_length")
        .and_then(Meta::as_usize)
        .unwrap_or(context);
    c.insert("original_max_position_embeddings".into(), json!(original));
    let find = |n: &str| g.tensors.iter().find(|t| t.name == n);
    match (find(LONG), find(SHORT)) {
        (None, None) => {}
        (Some(l), Some(s)) => {
            let long = g.decode(l).map_err(|e| format!("{LONG}: {e}"))?;
            let short = g.decode(s).map_err(|e| format!("{SHORT}: {e}"))?;
            let mut scaling = json!({
                "rope_type": "longrope",
                "long_factor": long,
                "short_factor": short,
            });
            if let Some(a) = g
                .get("phi3.rope.scaling.attn_factor")
                .and_then(Meta::as_f64)
            {
                scaling["attention_factor"] = json!(a);
            }
            c.insert("rope_scaling".into(), scaling);
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(format!(
                "{LONG} and {SHORT}: LongRoPE needs both factor tensors, the file has one"
            ))
        }
    }
    Ok(())
}

/// Whether a tensor of a `phi3` file is read into the config (its LongRoPE factors).
pub fn is_config_tensor(name: &str) -> bool {
    name == LONG || name == SHORT
}

/// A `phi3` file's `ffn_up` (gate|up, `2·ff` rows) as cockpit's gate and up, under layer
/// `i`'s cockpit names; None for any other tensor.
pub fn split_ffn_up(
    name: &str,
    v: &Tensor,
    ff: usize,
) -> Option<Result<Vec<(String, Tensor)>, String>> {
    let i = name
        .strip_prefix("blk.")?
        .strip_suffix(".ffn_up.weight")?
        .to_string();
    let rows = v.dims().first().copied().unwrap_or(0);
    if rows != 2 * ff {
        return Some(Err(format!(
            "{name}: {rows} rows, phi3's gate|up has {}",
            2 * ff
        )));
    }
    let split = || -> candle_core::Result<Vec<(String, Tensor)>> {
        Ok(vec![
            (
                format!("model.layers.{i}.mlp.gate_proj.weight"),
                v.narrow(0, 0, ff)?.contiguous()?,
            ),
            (
                format!("model.layers.{i}.mlp.up_proj.weight"),
                v.narrow(0, ff, ff)?.contiguous()?,
            ),
        ])
    };
    Some(split().map_err(|e| format!("{name}: {e}")))
}

/// llama.cpp gives special tokens of a model whose `general.name` says phi-3 or phi3 their
/// attributes by text, and fails to load where one of them (`</s>`, `<unk>`, `<s>`,
/// `<|endoftext|>`) is not in the vocabulary: the first such token where `name` would trip it.
pub fn name_llama_cpp_trips_on(name: &str, tokenizer: &[(String, Value)]) -> Option<&'static str> {
    let lower = name.to_lowercase();
    if !lower.contains("phi-3") && !lower.contains("phi3") {
        return None;
    }
    let tokens = tokenizer.iter().find_map(|(k, v)| match v {
        Value::Strs(t) if k == "tokenizer.ggml.tokens" => Some(t),
        _ => None,
    })?;
    ["</s>", "<unk>", "<s>", "<|endoftext|>"]
        .into_iter()
        .find(|t| !tokens.iter().any(|have| have == t))
}
