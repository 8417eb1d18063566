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
    rope_dict(k, obj, name, legacy_theta, legacy_partial)
}

/// One RoPE dict (`name` = its key path, for errors): θ, scaling and partial rotary, the
/// top-level values where it has none.
pub(super) fn rope_dict(
    k: &mut Keys,
    obj: &Value,
    name: &str,
    legacy_theta: f64,
    legacy_partial: f64,
) -> Result<(f64, RopeScaling, f64), String> {
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
        // Phi3Config reads the older "su" and "yarn" as longrope.
        "longrope" | "su" | "yarn" if k.model_type == "phi3" => {
            let factor = num("factor")?;
            let attention_factor = num("attention_factor")?;
            longrope(k, map, name, factor, attention_factor)?
        }
        "longrope" => {
            return Err(format!(
                "{name}.rope_type = \"longrope\": not supported for {} (cockpit computes LongRoPE for phi3, whose generation recomputes the cache where the factors switch, as cockpit's does)",
                k.model_type
            ))
        }
        other => {
            let longrope = if k.model_type == "phi3" { ", longrope" } else { "" };
            return Err(format!(
                "{name}.rope_type = {other:?}: not supported (supported: default, linear, llama3{longrope})"
            ));
        }
    };
    for key in map.keys() {
        let longrope_key = matches!(scaling, RopeScaling::LongRope { .. })
            && [
                "short_factor",
                "long_factor",
                "original_max_position_embeddings",
            ]
            .contains(&key.as_str());
        if !used.contains(key.as_str()) && key != "rope_type" && key != "type" && !longrope_key {
            return Err(format!(
                "{name}.{key} = {}: not supported with rope_type {kind:?}",
                map[key]
            ));
        }
    }
    Ok((theta, scaling, partial))
}

/// Phi-3's LongRoPE: short and long factors, the original context (the top-level
/// `original_max_position_embeddings`, 4096 where absent, as transformers' Phi3Config reads
/// it) and the attention factor (given, or transformers'
/// `sqrt(1 + ln(factor) / ln(original))` with `factor` given or `max_position_embeddings /
/// original`; 1 where the factor is at most 1).
fn longrope(
    k: &mut Keys,
    map: &serde_json::Map<String, Value>,
    name: &str,
    factor: Option<f64>,
    attention_factor: Option<f64>,
) -> Result<RopeScaling, String> {
    let factors = |key: &str| -> Result<Vec<f64>, String> {
        let v = map
            .get(key)
            .ok_or_else(|| format!("{name}.{key}: missing (needed for longrope)"))?;
        v.as_array()
            .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
            .filter(|f| f.iter().all(|x| *x > 0.0 && x.is_finite()))
            .ok_or_else(|| format!("{name}.{key} = {v}: expected a list of positive numbers"))
    };
    let (short_factor, long_factor) = (factors("short_factor")?, factors("long_factor")?);
    let max_pos = k.usize("max_position_embeddings", Some(4096))?;
    // Phi3Config always has a top-level original_max_position_embeddings (4096 by default)
    // and it replaces the dict's: a dict that says otherwise is refused.
    let original = k.usize("original_max_position_embeddings", Some(4096))?;
    if let Some(v) = map.get("original_max_position_embeddings") {
        if v.as_u64() != Some(original as u64) {
            return Err(format!(
                "{name}.original_max_position_embeddings = {v}: transformers' phi3 reads the top-level original_max_position_embeddings ({original}) instead; make them agree"
            ));
        }
    }
    if original == 0 {
        return Err(
            "original_max_position_embeddings = 0: longrope needs the original context".into(),
        );
    }
    let factor = factor.unwrap_or(max_pos as f64 / original as f64);
    let attention_factor = attention_factor.unwrap_or_else(|| {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt()
        }
    });
    Ok(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings: original,
        attention_factor,
    })
}
