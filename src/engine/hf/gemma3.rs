//! Gemma 3 (`gemma3_text`: Gemma3ForCausalLM; `gemma3`: the language model of
//! Gemma3ForConditionalGeneration, read from its `text_config`) and Gemma 2 (`gemma2`): the
//! Llama block with a GeGLU MLP (gelu-tanh gate), RMSNorm scaled by `1 + w`, a norm on each
//! input and output of attention and MLP, embeddings × √hidden (in the model's dtype), the
//! score scale `query_pre_attn_scalar^-½`, an explicit head_dim, local sliding-window layers
//! among global ones (`layer_types` or the `sliding_window_pattern`), tied embeddings. Gemma 3
//! adds per-head QK-norm and the local layers' own RoPE θ (`rope_local_base_freq`, no scaling
//! there); Gemma 2 soft-caps the attention scores and the logits.
//!
//! Keys left out of a config take transformers' defaults (Gemma3TextConfig, Gemma2Config):
//! real Gemma 3 `text_config`s name only what differs from them.

use super::config_keys::Keys;
use super::rope::{rope, rope_dict};
use crate::config::{
    Activation, Arch, BlockLayout, LayerKind, ModelConfig, Norm, PosEncoding, QkNorm, RopeScaling,
};
use serde_json::{Map, Value};

/// The `gemma3` wrapper's keys that describe the vision side: read, not computed (the
/// language model alone is loaded); named in the model's notes.
const VISION_KEYS: &[&str] = &[
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
];

/// A `gemma3` (Gemma3ForConditionalGeneration) config: its `text_config` read as a
/// `gemma3_text` one (errors name `text_config.KEY`), the vision keys noted as ignored.
pub(super) fn parse_wrapper(k: &mut Keys) -> Result<ModelConfig, String> {
    let text = match k.get("text_config") {
        Some(Value::Object(t)) => t,
        Some(other) => return Err(format!("text_config = {other}: expected an object")),
        // Gemma3Config's default text_config is Gemma3TextConfig's defaults.
        None => &EMPTY,
    };
    let ignored: Vec<&str> = VISION_KEYS
        .iter()
        .copied()
        .filter(|key| k.get(key).is_some())
        .collect();
    let mut inner = Keys {
        map: text,
        model_type: "gemma3_text",
        used: Default::default(),
    };
    let mut m = parse(&mut inner).map_err(|e| format!("text_config.{e}"))?;
    // The text_config's own bookkeeping (token ids, model_type) and nothing else unknown.
    inner.get("model_type");
    inner.finish().map_err(|e| format!("text_config.{e}"))?;
    // Gemma3ForConditionalGeneration ties its head by the top-level key.
    if let Some(tie) = k.get("tie_word_embeddings") {
        m.tie_embeddings = tie
            .as_bool()
            .ok_or_else(|| format!("tie_word_embeddings = {tie}: expected true or false"))?;
    }
    m.arch_notes.push(format!(
        "gemma3: the language model of text_config{}",
        if ignored.is_empty() {
            String::new()
        } else {
            format!(
                " ({} ignored: vision tower and projector not loaded)",
                ignored.join(", ")
            )
        }
    ));
    Ok(m)
}

static EMPTY: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);

/// A value that may be absent (transformers' default applies), null (off) or a number.
fn nullable(k: &mut Keys, key: &'static str, default: Option<f64>) -> Result<Option<f64>, String> {
    let present = k.map.contains_key(key);
    match k.get(key) {
        None if present => Ok(None),
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| *x > 0.0 && x.is_finite())
            .map(Some)
            .ok_or_else(|| format!("{key} = {v}: expected a positive number or null")),
    }
}

/// A `gemma3_text` or `gemma2` config.json into the model cockpit computes.
pub(super) fn parse(k: &mut Keys) -> Result<ModelConfig, String> {
    let gemma3 = k.model_type != "gemma2";
    let (default_vocab, default_max) = if gemma3 {
        (262_208, 131_072)
    } else {
        (256_000, 8192)
    };
    let n_embd = k.usize("hidden_size", Some(2304))?;
    let hidden = k.usize("intermediate_size", Some(9216))?;
    let n_layer = k.usize("num_hidden_layers", Some(26))?;
    let n_head = k.usize("num_attention_heads", Some(8))?;
    let n_kv = k.usize("num_key_value_heads", Some(4))?;
    let head_dim = k.usize("head_dim", Some(256))?;
    if n_head == 0 || n_kv == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(format!(
            "num_key_value_heads = {n_kv}: must divide num_attention_heads ({n_head})"
        ));
    }
    let act = k.str("hidden_activation", "gelu_pytorch_tanh")?;
    k.require(
        "hidden_activation",
        act.as_str(),
        "gelu_pytorch_tanh",
        "cockpit's Gemma MLP is GeGLU with the tanh GELU",
    )?;
    // transformers' Gemma 2/3 read hidden_activation only (older configs carry both).
    k.get("hidden_act");
    let bias = k.bool("attention_bias", false)?;
    k.require(
        "attention_bias",
        bias,
        false,
        "cockpit has no Gemma attention biases",
    )?;
    let bidirectional = k.bool("use_bidirectional_attention", false)?;
    k.require(
        "use_bidirectional_attention",
        bidirectional,
        false,
        "cockpit's attention is causal",
    )?;
    let scalar = k.f64("query_pre_attn_scalar", 256.0)?;
    if !(scalar > 0.0 && scalar.is_finite()) {
        return Err(format!(
            "query_pre_attn_scalar = {scalar}: must be a positive number"
        ));
    }
    let (layer_types, window) = layers(k, n_layer, gemma3)?;
    let attn_softcap = nullable(k, "attn_logit_softcapping", (!gemma3).then_some(50.0))?;
    if let (true, Some(cap)) = (gemma3, attn_softcap) {
        return Err(format!(
            "attn_logit_softcapping = {cap}: not supported for {} (transformers' Gemma 3 does not apply it; cockpit would compute another model)",
            k.model_type
        ));
    }
    let final_softcap = nullable(k, "final_logit_softcapping", (!gemma3).then_some(30.0))?;
    let (theta, scaling, local_theta) = if gemma3 {
        gemma3_rope(k)?
    } else {
        let (theta, scaling, partial) = rope(k, 10000.0)?;
        whole_heads(partial)?;
        (theta, scaling, 0.0)
    };
    Ok(ModelConfig {
        arch: Arch::Llama,
        vocab_size: k.usize("vocab_size", Some(default_vocab))?,
        n_layer,
        n_head,
        n_kv_head: n_kv,
        n_embd,
        seq_len: k.usize("max_position_embeddings", Some(default_max))?,
        mlp_ratio: hidden as f64 / n_embd as f64,
        norm: Norm::RmsNorm,
        norm_eps: k.f64("rms_norm_eps", 1e-6)?,
        pos: PosEncoding::Rope,
        rope_theta: theta,
        activation: Activation::GeGlu,
        tie_embeddings: k.bool("tie_word_embeddings", true)?,
        bias: false,
        head_dim,
        rope_scaling: scaling,
        // transformers: `embed_scale = hidden_size**0.5` cast to the weights' dtype; cockpit's
        // multiplier is rounded to the compute dtype the same way.
        embedding_multiplier: (n_embd as f64).sqrt(),
        attention_multiplier: scalar.powf(-0.5),
        layout: BlockLayout {
            qk_norm: if gemma3 { QkNorm::Head } else { QkNorm::None },
            sandwich_norm: true,
            norm_plus_one: true,
            layer_types,
            window: window.unwrap_or(0),
            local_rope_theta: local_theta,
            attn_softcap: attn_softcap.unwrap_or(0.0),
            final_softcap: final_softcap.unwrap_or(0.0),
            ..BlockLayout::PLAIN
        },
        ..ModelConfig::default()
    })
}

fn whole_heads(partial: f64) -> Result<(), String> {
    if partial != 1.0 {
        return Err(format!(
            "partial_rotary_factor = {partial}: not supported for gemma (supported: 1; RoPE on whole heads)"
        ));
    }
    Ok(())
}

/// Each layer's attention and the sliding layers' window: `layer_types`, else transformers'
/// pattern (every `sliding_window_pattern`-th layer full, 6 in Gemma 3; every other one in
/// Gemma 2).
fn layers(
    k: &mut Keys,
    n_layer: usize,
    gemma3: bool,
) -> Result<(Vec<LayerKind>, Option<usize>), String> {
    let pattern = if gemma3 {
        k.usize("sliding_window_pattern", Some(6))?
    } else {
        2
    };
    let types: Vec<LayerKind> = match k.get("layer_types") {
        Some(v) => {
            let a = v
                .as_array()
                .ok_or_else(|| format!("layer_types = {v}: expected a list"))?;
            if a.len() != n_layer {
                return Err(format!(
                    "layer_types = {v}: {} entries for {n_layer} layers",
                    a.len()
                ));
            }
            a.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    _ => Err(format!(
                        "layer_types = {v}: {t} is not a layer type cockpit computes (supported: \"full_attention\", \"sliding_attention\")"
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        None if pattern == 0 => {
            return Err("sliding_window_pattern = 0: must be at least 1".into());
        }
        None => (0..n_layer)
            .map(|i| match (i + 1) % pattern {
                0 => LayerKind::Full,
                _ => LayerKind::Sliding,
            })
            .collect(),
    };
    let present = k.map.contains_key("sliding_window");
    let window = match k.get("sliding_window") {
        None if present => None,
        None => Some(4096),
        Some(_) => Some(k.usize("sliding_window", None)?),
    };
    let sliding = types.contains(&LayerKind::Sliding);
    match window {
        Some(0) if sliding => Err("sliding_window = 0: sliding layers need a window".into()),
        None if sliding => Err(
            "sliding_window = null with \"sliding_attention\" layers: not supported (their attention would be full while their RoPE stays local)".into(),
        ),
        _ if !sliding => Ok((Vec::new(), None)),
        w => Ok((types, w)),
    }
}

/// Gemma 3's RoPE: the full layers' θ and scaling, the sliding layers' θ. transformers 5
/// writes `rope_parameters = {"full_attention": {…}, "sliding_attention": {…}}`; older configs
/// `rope_theta` + `rope_scaling` (the full layers') and `rope_local_base_freq`.
fn gemma3_rope(k: &mut Keys) -> Result<(f64, RopeScaling, f64), String> {
    let theta = k.f64("rope_theta", 1_000_000.0)?;
    let local = k.f64("rope_local_base_freq", 10_000.0)?;
    let params = k.get("rope_parameters");
    let scaling = k.get("rope_scaling");
    let Some(p) = params else {
        let (theta, scaling, partial) = match scaling {
            Some(s) => rope_dict(k, s, "rope_scaling", theta, 1.0)?,
            None => (theta, RopeScaling::None, 1.0),
        };
        whole_heads(partial)?;
        return Ok((theta, scaling, local));
    };
    let map = p
        .as_object()
        .ok_or_else(|| format!("rope_parameters = {p}: expected an object"))?;
    for key in map.keys() {
        if key != "full_attention" && key != "sliding_attention" {
            return Err(format!(
                "rope_parameters.{key} = {}: gemma3's rope_parameters hold one dict per layer type (full_attention, sliding_attention)",
                map[key]
            ));
        }
    }
    if let Some(s) = scaling {
        return Err(format!(
            "rope_scaling = {s}: given beside rope_parameters; say the full layers' scaling in rope_parameters.full_attention"
        ));
    }
    let default = Value::Object(Map::new());
    let full = map.get("full_attention").unwrap_or(&default);
    let (theta, scaling, partial) =
        rope_dict(k, full, "rope_parameters.full_attention", theta, 1.0)?;
    whole_heads(partial)?;
    let sliding = map.get("sliding_attention").unwrap_or(&default);
    let (local, local_scaling, partial) =
        rope_dict(k, sliding, "rope_parameters.sliding_attention", local, 1.0)?;
    whole_heads(partial)?;
    if local_scaling != RopeScaling::None {
        return Err(format!(
            "rope_parameters.sliding_attention = {sliding}: not supported (cockpit's sliding layers rotate with their own rope_theta, unscaled)"
        ));
    }
    Ok((theta, scaling, local))
}

/// Whether `model_type` (gemma3_text or gemma2) computes `m`.
pub(super) fn fits(m: &ModelConfig, model_type: &str) -> bool {
    let l = &m.layout;
    let gemma3 = model_type == "gemma3_text";
    m.norm == Norm::RmsNorm
        && m.pos == PosEncoding::Rope
        && m.activation == Activation::GeGlu
        && !m.bias
        && !m.qkv_bias
        && m.embedding_multiplier == (m.n_embd as f64).sqrt()
        && m.residual_multiplier == 1.0
        && m.logits_scaling == 1.0
        && !matches!(m.rope_scaling, RopeScaling::LongRope { .. })
        && m.n_head > 0
        && m.n_embd.is_multiple_of(m.n_head)
        && l.sandwich_norm
        && l.norm_plus_one
        && !l.post_norm
        && l.rotary_dim == 0
        && if gemma3 {
            l.qk_norm == QkNorm::Head && l.attn_softcap == 0.0
        } else {
            l.qk_norm == QkNorm::None && l.local_rope_theta == 0.0
        }
}

/// The config.json keys of `gemma3_text` or `gemma2` for `m` (the common ones are set).
pub(super) fn config_json(
    m: &ModelConfig,
    model_type: &str,
    hidden: usize,
    o: &mut Map<String, Value>,
) {
    let l = &m.layout;
    let gemma3 = model_type == "gemma3_text";
    let arch = if gemma3 {
        "Gemma3ForCausalLM"
    } else {
        "Gemma2ForCausalLM"
    };
    let scale = match m.attention_multiplier {
        0.0 => 1.0 / (m.head_size() as f64).sqrt(),
        a => a,
    };
    // query_pre_attn_scalar = scale^-2, an integer where it is one.
    let scalar = 1.0 / (scale * scale);
    let scalar = if (scalar - scalar.round()).abs() < 1e-9 * scalar {
        serde_json::json!(scalar.round() as u64)
    } else {
        serde_json::json!(scalar)
    };
    let types: Vec<&str> = (0..m.n_layer)
        .map(|i| match l.window_of(i) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    let cap = |c: f64| {
        if c > 0.0 {
            serde_json::json!(c)
        } else {
            Value::Null
        }
    };
    let full = super::llama::rope_scaling_json(&m.rope_scaling);
    let rope = |theta: f64, scaling: &Value| {
        let mut d = match scaling {
            Value::Object(s) => s.clone(),
            _ => serde_json::json!({"rope_type": "default"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        };
        d.remove("type");
        d.insert("rope_theta".into(), serde_json::json!(theta));
        Value::Object(d)
    };
    let rope_parameters = if gemma3 {
        let local = if l.local_rope_theta > 0.0 {
            l.local_rope_theta
        } else {
            m.rope_theta
        };
        serde_json::json!({
            "full_attention": rope(m.rope_theta, &full),
            "sliding_attention": rope(local, &Value::Null),
        })
    } else {
        rope(m.rope_theta, &full)
    };
    for (k, v) in [
        ("architectures", serde_json::json!([arch])),
        ("hidden_size", serde_json::json!(m.n_embd)),
        ("intermediate_size", serde_json::json!(hidden)),
        ("num_hidden_layers", serde_json::json!(m.n_layer)),
        ("num_attention_heads", serde_json::json!(m.n_head)),
        ("num_key_value_heads", serde_json::json!(m.kv_heads())),
        ("head_dim", serde_json::json!(m.head_size())),
        ("hidden_activation", serde_json::json!("gelu_pytorch_tanh")),
        (
            "max_position_embeddings",
            serde_json::json!(m.seq_len.max(m.n_positions)),
        ),
        ("rms_norm_eps", serde_json::json!(m.norm_eps)),
        ("query_pre_attn_scalar", scalar),
        (
            "sliding_window",
            serde_json::json!(if l.has_sliding() { l.window } else { 4096 }),
        ),
        ("layer_types", serde_json::json!(types)),
        ("rope_parameters", rope_parameters),
        ("attention_bias", Value::Bool(false)),
        ("attn_logit_softcapping", cap(l.attn_softcap)),
        ("final_logit_softcapping", cap(l.final_softcap)),
        ("use_bidirectional_attention", Value::Bool(false)),
        // Gemma's default pad_token_id (0) may be a real token of another vocabulary: say
        // none (the base's own, when it has one, is written after this).
        ("pad_token_id", Value::Null),
    ] {
        o.insert(k.into(), v);
    }
}

/// Whether a tensor of a `gemma3` (Gemma3ForConditionalGeneration) checkpoint is the
/// language model's, under cockpit's name (`model.…`, `lm_head.…`), or the vision side's
/// (None: not loaded).
pub(super) fn language_model_name(name: &str) -> Option<String> {
    for (prefix, to) in [
        // transformers 5: model.language_model.*, lm_head.*
        ("model.language_model.", "model."),
        // transformers 4: language_model.model.*, language_model.lm_head.*
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return Some(format!("{to}{rest}"));
        }
    }
    name.starts_with("lm_head.").then(|| name.to_string())
}
