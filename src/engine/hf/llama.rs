//! The Llama family: `llama`, `mistral`, `qwen2` and `granite` (RMSNorm, RoPE, SwiGLU,
//! grouped-query attention), and the families built on it.

use super::config_keys::{full_attention_only, Keys};
use super::rope::rope;
use super::HfInfo;
use crate::config::{Activation, Arch, BlockLayout, ModelConfig, Norm, PosEncoding, RopeScaling};
use serde_json::{Map, Value};

/// A Llama-like config.json into the model cockpit computes (and Mistral's window).
pub(super) fn parse(
    k: &mut Keys,
    sliding_window: &mut Option<usize>,
) -> Result<ModelConfig, String> {
    let model_type = k.model_type;
    let map = k.map;
    let act = k.str("hidden_act", "silu")?;
    k.require(
        "hidden_act",
        act.as_str(),
        "silu",
        "cockpit's gated MLP is SwiGLU",
    )?;
    let (default_eps, default_tie, default_max) = match model_type {
        "llama" => (1e-6, false, 2048),
        "mistral" => (1e-6, false, 4096 * 32),
        "qwen2" | "qwen3" => (1e-6, false, 32768),
        "olmo2" => (1e-5, false, 2048),
        "phi3" => (1e-5, false, 4096),
        _ => (1e-6, false, 2048),
    };
    let n_embd = k.usize("hidden_size", None)?;
    let n_head = k.usize("num_attention_heads", None)?;
    let n_kv = k.usize("num_key_value_heads", Some(n_head))?;
    let hidden = k.usize("intermediate_size", None)?;
    if n_head == 0 || n_kv == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(format!(
            "num_key_value_heads = {n_kv}: must divide num_attention_heads ({n_head})"
        ));
    }
    let default_head_dim = match model_type {
        "qwen3" => super::qwen3::DEFAULT_HEAD_DIM,
        _ => n_embd / n_head,
    };
    let head_dim = k.usize("head_dim", Some(default_head_dim))?;
    let (theta, scaling, partial) = rope(k, 10000.0)?;
    let rotary_dim = if partial == 1.0 {
        0
    } else if model_type == "phi3" {
        super::phi3::rotary_dim(head_dim, partial)?
    } else {
        return Err(format!(
            "partial_rotary_factor = {partial}: not supported for {model_type} (supported: 1; RoPE on whole heads)"
        ));
    };
    let max_pos = k.usize("max_position_embeddings", Some(default_max))?;
    if let RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    } = &scaling
    {
        let pairs = (if rotary_dim == 0 {
            head_dim
        } else {
            rotary_dim
        }) / 2;
        let name = if map.contains_key("rope_parameters") {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        for (key, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if f.len() != pairs {
                return Err(format!(
                    "{name}.{key}: {} factors, the model rotates {pairs} pairs of dims a head",
                    f.len()
                ));
            }
        }
    }
    let (mut bias, mut qkv_bias) = (false, false);
    let mut layout = BlockLayout::default();
    match model_type {
        "qwen3" => layout = super::qwen3::layout(k)?,
        "phi3" => *sliding_window = super::phi3::window(k)?,
        "olmo2" => layout = super::olmo2::layout(k)?,
        "llama" | "granite" => {
            let attn = k.bool("attention_bias", false)?;
            let mlp = k.bool("mlp_bias", false)?;
            if attn != mlp {
                return Err(format!(
                    "attention_bias = {attn} with mlp_bias = {mlp}: not supported (cockpit puts biases on every linear layer or on none)"
                ));
            }
            bias = attn;
        }
        "qwen2" => {
            qkv_bias = true;
            full_attention_only(k)?;
        }
        "mistral" => {
            // MistralConfig's default window is 4096 when the key is absent.
            k.get("sliding_window");
            *sliding_window = match map.get("sliding_window") {
                None => Some(4096),
                Some(Value::Null) => None,
                Some(_) => Some(k.usize("sliding_window", None)?),
            };
        }
        _ => {}
    }
    let mut m = ModelConfig {
        arch: Arch::Llama,
        vocab_size: k.usize("vocab_size", None)?,
        n_layer: k.usize("num_hidden_layers", None)?,
        n_head,
        n_kv_head: n_kv,
        n_embd,
        seq_len: max_pos,
        mlp_ratio: hidden as f64 / n_embd as f64,
        norm: Norm::RmsNorm,
        norm_eps: k.f64("rms_norm_eps", default_eps)?,
        pos: PosEncoding::Rope,
        rope_theta: theta,
        activation: Activation::SwiGlu,
        tie_embeddings: k.bool("tie_word_embeddings", default_tie)?,
        bias,
        head_dim,
        qkv_bias,
        rope_scaling: scaling,
        layout: BlockLayout {
            rotary_dim,
            ..layout
        },
        ..ModelConfig::default()
    };
    if model_type == "granite" {
        m.embedding_multiplier = k.f64("embedding_multiplier", 1.0)?;
        m.attention_multiplier = k.f64("attention_multiplier", 1.0)?;
        m.residual_multiplier = k.f64("residual_multiplier", 1.0)?;
        m.logits_scaling = k.f64("logits_scaling", 1.0)?;
    }
    Ok(m)
}

/// The config.json keys of a Llama-like `model_type` for `m`.
pub(super) fn config_json(
    m: &ModelConfig,
    model_type: &str,
    hidden: usize,
    base: Option<&HfInfo>,
    o: &mut Map<String, Value>,
) {
    let head_dim = m.head_size();
    let kv = m.kv_heads();
    let arch = match model_type {
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "granite" => "GraniteForCausalLM",
        "qwen3" => super::qwen3::ARCHITECTURE,
        "olmo2" => super::olmo2::ARCHITECTURE,
        "phi3" => super::phi3::ARCHITECTURE,
        _ => "LlamaForCausalLM",
    };
    o.insert("architectures".into(), serde_json::json!([arch]));
    for (k, v) in [
        ("hidden_size", serde_json::json!(m.n_embd)),
        ("intermediate_size", serde_json::json!(hidden)),
        ("num_hidden_layers", serde_json::json!(m.n_layer)),
        ("num_attention_heads", serde_json::json!(m.n_head)),
        ("num_key_value_heads", serde_json::json!(kv)),
        ("head_dim", serde_json::json!(head_dim)),
        ("hidden_act", serde_json::json!("silu")),
        (
            "max_position_embeddings",
            serde_json::json!(m.seq_len.max(m.n_positions)),
        ),
        ("rms_norm_eps", serde_json::json!(m.norm_eps)),
        ("rope_theta", serde_json::json!(m.rope_theta)),
    ] {
        o.insert(k.into(), v);
    }
    if let RopeScaling::LongRope {
        original_max_position_embeddings,
        ..
    } = &m.rope_scaling
    {
        // Phi3Config takes the original context from the top level first.
        o.insert(
            "original_max_position_embeddings".into(),
            serde_json::json!(original_max_position_embeddings),
        );
    }
    let scaling = rope_scaling_json(&m.rope_scaling);
    o.insert("rope_scaling".into(), scaling);
    match model_type {
        "qwen2" => {
            o.insert("use_sliding_window".into(), Value::Bool(false));
        }
        "qwen3" => super::qwen3::config_json(o),
        "olmo2" => super::olmo2::config_json(o),
        "phi3" => super::phi3::config_json(m, base, o),
        "mistral" => {
            let w = base.and_then(|b| b.sliding_window);
            o.insert("sliding_window".into(), serde_json::json!(w));
        }
        _ => {
            o.insert("attention_bias".into(), Value::Bool(m.bias));
            o.insert("mlp_bias".into(), Value::Bool(m.bias));
        }
    }
    if model_type == "granite" {
        let att = if m.attention_multiplier == 0.0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            m.attention_multiplier
        };
        o.insert(
            "embedding_multiplier".into(),
            serde_json::json!(m.embedding_multiplier),
        );
        o.insert("attention_multiplier".into(), serde_json::json!(att));
        o.insert(
            "residual_multiplier".into(),
            serde_json::json!(m.residual_multiplier),
        );
        o.insert("logits_scaling".into(), serde_json::json!(m.logits_scaling));
    }
}

/// `rope_scaling` as config.json says it (null: none).
pub(super) fn rope_scaling_json(scaling: &RopeScaling) -> Value {
    match scaling {
        RopeScaling::None => Value::Null,
        RopeScaling::Linear { factor } => {
            serde_json::json!({"rope_type": "linear", "type": "linear", "factor": factor})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => serde_json::json!({
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => serde_json::json!({
                "rope_type": "longrope", "type": "longrope", "short_factor": short_factor,
                "long_factor": long_factor, "attention_factor": attention_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
        }),
    }
}
