//! Granite 4.0 hybrid (`granitemoehybrid`): Mamba-2 layers and attention layers (with RoPE or
//! none, NoPE) as `layer_types` says, a shared SwiGLU MLP in every layer, routed experts where
//! `num_local_experts` > 0, Granite's multipliers. Mamba and attention weights keep their
//! names; the experts are stored as `block_sparse_moe.input_linear` / `output_linear` /
//! `router.layer` (the published layout) and renamed to transformers' in-memory names
//! (`experts.gate_up_proj`, `experts.down_proj`, `router.weight`) on load, back on export.

use super::config_keys::Keys;
use super::corrupt;
use super::rope::rope;
use crate::config::{Activation, Arch, HybridConfig, MixerKind, ModelConfig, Norm, PosEncoding};
use crate::engine::checkpoint::CheckpointError;
use candle_core::Tensor;
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::Path;

pub(super) const MODEL_TYPE: &str = "granitemoehybrid";
const ARCHITECTURE: &str = "GraniteMoeHybridForCausalLM";

/// Published expert names → cockpit's (transformers' in-memory ones).
const EXPERT_NAMES: [(&str, &str); 3] = [
    (
        ".block_sparse_moe.input_linear.weight",
        ".block_sparse_moe.experts.gate_up_proj",
    ),
    (
        ".block_sparse_moe.output_linear.weight",
        ".block_sparse_moe.experts.down_proj",
    ),
    (
        ".block_sparse_moe.router.layer.weight",
        ".block_sparse_moe.router.weight",
    ),
];

/// A `granitemoehybrid` config.json into the model cockpit computes.
pub(super) fn parse(k: &mut Keys) -> Result<ModelConfig, String> {
    let act = k.str("hidden_act", "silu")?;
    k.require(
        "hidden_act",
        act.as_str(),
        "silu",
        "cockpit's shared MLP and experts are SwiGLU",
    )?;
    let bias = k.bool("attention_bias", false)?;
    k.require(
        "attention_bias",
        bias,
        false,
        "cockpit has no attention biases for this model type",
    )?;
    let n_embd = k.usize("hidden_size", None)?;
    let n_layer = k.usize("num_hidden_layers", None)?;
    let n_head = k.usize("num_attention_heads", None)?;
    let n_kv = k.usize("num_key_value_heads", Some(n_head))?;
    if n_head == 0 || n_kv == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(format!(
            "num_key_value_heads = {n_kv}: must divide num_attention_heads ({n_head})"
        ));
    }
    let head_dim = k.usize("head_dim", Some(n_embd / n_head))?;
    let (theta, scaling, partial) = rope(k, 10000.0)?;
    if partial != 1.0 {
        return Err(format!(
            "partial_rotary_factor = {partial}: not supported for {MODEL_TYPE} (supported: 1)"
        ));
    }
    let rope_on = match k.get("position_embedding_type") {
        None => false,
        Some(Value::String(s)) if s == "nope" => false,
        Some(Value::String(s)) if s == "rope" => true,
        Some(v) => {
            return Err(format!(
                "position_embedding_type = {v}: not supported for {MODEL_TYPE} (supported: null or \"nope\", \"rope\")"
            ))
        }
    };
    let hybrid = hybrid_keys(k, n_embd, n_layer, rope_on)?;
    let shared = k.usize("shared_intermediate_size", Some(1024))?;
    let mut m = ModelConfig {
        arch: Arch::Llama,
        vocab_size: k.usize("vocab_size", None)?,
        n_layer,
        n_head,
        n_kv_head: n_kv,
        n_embd,
        seq_len: k.usize("max_position_embeddings", Some(2048))?,
        mlp_ratio: shared as f64 / n_embd.max(1) as f64,
        norm: Norm::RmsNorm,
        norm_eps: k.f64("rms_norm_eps", 1e-6)?,
        pos: PosEncoding::Rope,
        rope_theta: theta,
        activation: Activation::SwiGlu,
        tie_embeddings: k.bool("tie_word_embeddings", false)?,
        bias: false,
        head_dim,
        rope_scaling: scaling,
        hybrid: Some(hybrid),
        ..ModelConfig::default()
    };
    m.embedding_multiplier = k.f64("embedding_multiplier", 1.0)?;
    m.attention_multiplier = k.f64("attention_multiplier", 1.0)?;
    m.residual_multiplier = k.f64("residual_multiplier", 1.0)?;
    m.logits_scaling = k.f64("logits_scaling", 1.0)?;
    Ok(m)
}

/// The keys of the Mamba layers, the layer kinds and the experts.
fn hybrid_keys(
    k: &mut Keys,
    n_embd: usize,
    n_layer: usize,
    rope: bool,
) -> Result<HybridConfig, String> {
    let types = match k.get("layer_types") {
        Some(v) => Some(("layer_types", v)),
        None => k.get("layers_block_type").map(|v| ("layers_block_type", v)),
    };
    let layers = match types {
        None => vec![MixerKind::Mamba; n_layer],
        Some((key, v)) => {
            let a = v
                .as_array()
                .ok_or_else(|| format!("{key} = {v}: expected a list of layer types"))?;
            if a.len() != n_layer {
                return Err(format!(
                    "{key} = {v}: {} entries, num_hidden_layers is {n_layer}",
                    a.len()
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("mamba" | "linear_attention") => Ok(MixerKind::Mamba),
                    Some("attention" | "full_attention") => Ok(MixerKind::Attention),
                    _ => Err(format!(
                        "{key}[{i}] = {t}: not supported for {MODEL_TYPE} (supported: \"mamba\" or \"linear_attention\", \"attention\" or \"full_attention\")"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let heads = k.usize("mamba_n_heads", Some(128))?;
    let expand = k.usize("mamba_expand", Some(2))?;
    let inner = expand * n_embd;
    let d_head = match k.get("mamba_d_head") {
        None => inner / heads.max(1),
        Some(Value::String(s)) if s == "auto" => inner / heads.max(1),
        Some(_) => k.usize("mamba_d_head", None)?,
    };
    if heads == 0 || d_head * heads != inner {
        return Err(format!(
            "mamba_d_head = {d_head}: mamba_n_heads ({heads}) heads of it must make mamba_expand · hidden_size = {inner}"
        ));
    }
    let (dt_min, dt_max) = time_step_limit(k)?;
    let experts = k.usize("num_local_experts", Some(8))?;
    let top_k = k.usize("num_experts_per_tok", Some(2))?;
    let expert_hidden = k.usize("intermediate_size", Some(11008))?;
    let output_router_logits = k.bool("output_router_logits", false)?;
    let coef = k.f64("router_aux_loss_coef", 0.001)?;
    let h = HybridConfig {
        layers,
        rope,
        mamba_n_heads: heads,
        mamba_d_head: d_head,
        mamba_d_state: k.usize("mamba_d_state", Some(256))?,
        mamba_n_groups: k.usize("mamba_n_groups", Some(1))?,
        mamba_d_conv: k.usize("mamba_d_conv", Some(4))?,
        mamba_chunk_size: k.usize("mamba_chunk_size", Some(256))?,
        mamba_conv_bias: k.bool("mamba_conv_bias", true)?,
        mamba_proj_bias: k.bool("mamba_proj_bias", false)?,
        dt_min,
        dt_max,
        experts,
        experts_top_k: if experts > 0 { top_k } else { 0 },
        expert_hidden: if experts > 0 { expert_hidden } else { 0 },
        router_aux_loss_coef: if experts > 0 && output_router_logits {
            coef
        } else {
            0.0
        },
    };
    if let Some((key, value, why)) = h.problem(n_layer) {
        let key = key.trim_start_matches("model.hybrid.");
        return Err(format!("{key} = {value}: {why}"));
    }
    Ok(h)
}

/// `time_step_limit` `[min, max]`; transformers writes ∞ as `{"__float__": "Infinity"}`.
fn time_step_limit(k: &mut Keys) -> Result<(f64, Option<f64>), String> {
    let Some(v) = k.get("time_step_limit") else {
        return Ok((0.0, None));
    };
    let bound = |x: &Value| -> Option<f64> {
        match x {
            Value::Number(n) => n.as_f64(),
            Value::Object(o) => o.get("__float__").and_then(Value::as_str).and_then(inf),
            Value::String(s) => inf(s),
            _ => None,
        }
    };
    let pair = v.as_array().filter(|a| a.len() == 2);
    match pair.map(|a| (bound(&a[0]), bound(&a[1]))) {
        Some((Some(lo), Some(hi))) if lo >= 0.0 && hi > lo => {
            Ok((lo, hi.is_finite().then_some(hi)))
        }
        _ => Err(format!(
            "time_step_limit = {v}: expected [min, max] with 0 ≤ min < max"
        )),
    }
}

fn inf(s: &str) -> Option<f64> {
    matches!(s, "Infinity" | "inf").then_some(f64::INFINITY)
}

/// Whether `granitemoehybrid` computes `m`: a hybrid stack (the caller checked the rest).
pub(super) fn fits(m: &ModelConfig) -> bool {
    m.hybrid
        .as_ref()
        .is_some_and(|h| h.mamba_inner().is_multiple_of(m.n_embd.max(1)))
        && !m.bias
        && !m.qkv_bias
        && m.layout.is_plain()
        && m.rope_scaling.is_none()
}

/// The published expert names renamed to cockpit's.
pub(super) fn from_published(tensors: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    tensors
        .into_iter()
        .map(|(name, t)| {
            for (published, ours) in EXPERT_NAMES {
                if let Some(p) = name.strip_suffix(published) {
                    return (format!("{p}{ours}"), t);
                }
            }
            (name, t)
        })
        .collect()
}

/// A base whose Mamba conv weights lack the `[channels, 1, width]` layout is refused naming
/// the tensor (the other shapes are checked against the model when it loads them).
pub(super) fn check(
    tensors: &HashMap<String, Tensor>,
    m: &ModelConfig,
    dir: &Path,
) -> Result<(), CheckpointError> {
    let Some(h) = &m.hybrid else { return Ok(()) };
    for (l, kind) in h.layers.iter().enumerate() {
        if *kind != MixerKind::Mamba {
            continue;
        }
        let name = format!("model.layers.{l}.mamba.conv1d.weight");
        if let Some(t) = tensors.get(&name) {
            let want = [h.conv_dim(), 1, h.mamba_d_conv];
            if t.dims() != want {
                return Err(corrupt(
                    dir,
                    format!(
                        "{name}: shape {:?}, the config makes {want:?} (mamba_n_heads · mamba_d_head + 2 · mamba_n_groups · mamba_d_state channels, mamba_d_conv wide)",
                        t.dims()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// cockpit's tensors under the published names.
pub(super) fn to_hf_names(tensors: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    tensors
        .into_iter()
        .map(|(name, t)| {
            for (published, ours) in EXPERT_NAMES {
                if let Some(p) = name.strip_suffix(ours) {
                    return (format!("{p}{published}"), t);
                }
            }
            (name, t)
        })
        .collect()
}

/// The config.json keys of `m` (a hybrid) as `granitemoehybrid`.
pub(super) fn config_json(m: &ModelConfig, hidden: usize, o: &mut Map<String, Value>) {
    let Some(h) = &m.hybrid else { return };
    let kinds: Vec<&str> = h
        .layers
        .iter()
        .map(|k| match k {
            MixerKind::Mamba => "mamba",
            MixerKind::Attention => "attention",
        })
        .collect();
    let att = if m.attention_multiplier == 0.0 {
        1.0 / (m.head_size() as f64).sqrt()
    } else {
        m.attention_multiplier
    };
    let inner = h.mamba_inner();
    let limit = match h.dt_max {
        Some(max) => serde_json::json!([h.dt_min, max]),
        None => serde_json::json!([h.dt_min, {"__float__": "Infinity"}]),
    };
    let pe = if h.rope {
        Value::from("rope")
    } else {
        Value::Null
    };
    for (key, v) in [
        ("architectures", serde_json::json!([ARCHITECTURE])),
        ("hidden_size", m.n_embd.into()),
        ("num_hidden_layers", m.n_layer.into()),
        ("num_attention_heads", m.n_head.into()),
        ("num_key_value_heads", m.kv_heads().into()),
        ("hidden_act", "silu".into()),
        (
            "max_position_embeddings",
            m.seq_len.max(m.n_positions).into(),
        ),
        ("rms_norm_eps", m.norm_eps.into()),
        ("rope_theta", m.rope_theta.into()),
        ("position_embedding_type", pe),
        ("attention_bias", false.into()),
        ("shared_intermediate_size", hidden.into()),
        ("intermediate_size", h.expert_hidden.max(1).into()),
        ("num_local_experts", h.experts.into()),
        ("num_experts_per_tok", h.experts_top_k.into()),
        (
            "output_router_logits",
            (h.router_aux_loss_coef > 0.0).into(),
        ),
        ("router_aux_loss_coef", h.router_aux_loss_coef.into()),
        ("layer_types", serde_json::json!(kinds)),
        ("mamba_n_heads", h.mamba_n_heads.into()),
        ("mamba_d_head", h.mamba_d_head.into()),
        ("mamba_d_state", h.mamba_d_state.into()),
        ("mamba_n_groups", h.mamba_n_groups.into()),
        ("mamba_d_conv", h.mamba_d_conv.into()),
        ("mamba_expand", (inner / m.n_embd.max(1)).into()),
        ("mamba_chunk_size", h.mamba_chunk_size.into()),
        ("mamba_conv_bias", h.mamba_conv_bias.into()),
        ("mamba_proj_bias", h.mamba_proj_bias.into()),
        ("time_step_limit", limit),
        ("embedding_multiplier", m.embedding_multiplier.into()),
        ("attention_multiplier", att.into()),
        ("residual_multiplier", m.residual_multiplier.into()),
        ("logits_scaling", m.logits_scaling.into()),
    ] {
        o.insert(key.into(), v);
    }
    if m.head_size() * m.n_head != m.n_embd {
        o.insert("head_dim".into(), m.head_size().into());
    }
}
