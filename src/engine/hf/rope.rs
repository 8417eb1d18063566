//! RoPE θ and scaling of a config.json (`rope_theta` + `rope_scaling`, or `rope_parameters`).

use super::config_keys::Keys;
use crate::config::RopeScaling;
use serde_json::Value;
use std::collections::HashSet;

/// RoPE θ and scaling from `rope_theta` + `rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5).
/// Also `partial_rotary_factor` (top level, or in `rope_parameters` as transformers 5 writes
/// it; 1 where absent).
pub(super) fn rope(k: &mut Keys, default_theta: f64) -> Result<(f64, RopeScaling, f64), String> {
    let legacy_theta = k.f64("rope_theta", default_theta)?;
    let legacy_partial = k.f64("partial_rotary_factor", 1.0)?;
    let (obj, name) = match (k.get("rope_parameters"), k.get("rope_scaling")) {
        (Some(p), _) => (p, "rope_parameters"),
        (None, Some(s)) => (s, "rope_scaling"),
        (None, None) => return Ok((legacy_theta, RopeScaling::None, legacy_partial)),
    };
    let map = obj
        .as_object()
        .ok_or_else(|| format!("{name} = {obj}: expected an object"))?;
    let mut used = HashSet::new();
    let mut num = |key: &'static str| -> Result<Option<f64>, String> {
        used.insert(key);
        match map.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("{name}.{key} = {v}: expected a number")),
        }
    };
    let theta = num("rope_theta")?.unwrap_or(legacy_theta);
    let partial = num("partial_rotary_factor")?.unwrap_or(legacy_partial);
    let need = |v: Option<f64>, key: &str| v.ok_or_else(|| format!("{name}.{key}: missing"));
    let kind = map
        .get("rope_type")
        .or_else(|| map.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_string();
    let scaling = match kind.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: need(num("factor")?, "factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need(num("factor")?, "factor")?,
            low_freq_factor: need(num("low_freq_factor")?, "low_freq_factor")?,
            high_freq_factor: need(num("high_freq_factor")?, "high_freq_factor")?,
            original_max_position_embeddings: need(
                num("original_max_position_embeddings")?,
                "original_max_position_embeddings",
            )? as usize,
        },
        other => {
            return Err(format!(
                "{name}.rope_type = {other:?}: not supported (supported: default, linear, llama3)"
            ))
        }
    };
    for key in map.keys() {
        if !used.contains(key.as_str()) && key != "rope_type" && key != "type" {
            return Err(format!(
                "{name}.{key} = {}: not supported with rope_type {kind:?}",
                map[key]
            ));
        }
    }
    Ok((theta, scaling, partial))
}
