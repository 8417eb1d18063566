//! Hugging Face model directories, in and out: `config.json` read by `model_type` into the
//! model cockpit computes (exactly, or refused with the key that stands in the way), safetensors
//! (one file or shards through `model.safetensors.index.json`; f32, bf16 or f16), and the same
//! layout written back for `cockpit export`.
//!
//! One file per family (`llama.rs` also reads `mistral`, `qwen2` and `granite`; `gpt2.rs`,
//! `qwen3.rs`, `olmo2.rs`), the keys every config may carry in `config_keys.rs`, RoPE in
//! `rope.rs`, safetensors in `weights.rs`: a new family goes in its own file.
//!
//! Supported: `llama` (2 and 3.x; rope_scaling linear and llama3; head_dim; tied or not),
//! `mistral` (sliding windows only where they change nothing), `qwen2` (q/k/v biases),
//! `qwen3` (per-head QK-norm), `olmo2` (post-norm, whole-projection QK-norm), `phi3` (fused
//! weights, partial rotary, longrope), `gpt2` (Conv1D weights stored transposed, learned
//! positions, tied head), `granite` (dense: embedding/attention/residual multipliers and logits
//! scaling), `gemma3_text`, `gemma3` (its language model) and `gemma2` (`gemma3.rs`), and
//! `granitemoehybrid` (Granite 4.0 hybrid: Mamba-2 and NoPE/RoPE attention layers, shared MLP,
//! routed experts).

use super::checkpoint::CheckpointError;
use crate::config::{Activation, ModelConfig, Norm, PosEncoding};
use candle_core::{DType, Tensor};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The model types cockpit imports and exports.
pub const MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "phi3",
    "gpt2",
    "granite",
    "gemma3_text",
    "gemma3",
    "gemma2",
    "granitemoehybrid",
];

/// What a Hugging Face directory says beyond the model's arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub struct HfInfo {
    pub model_type: String,
    pub bos: Option<u32>,
    /// End-of-sequence ids (Llama 3 instruct models have several).
    pub eos: Vec<u32>,
    pub pad: Option<u32>,
    /// Mistral/Qwen2: the attention window; cockpit refuses sequences longer than it.
    pub sliding_window: Option<usize>,
    /// The stored dtype (`torch_dtype`/`dtype` of config.json), when given.
    pub dtype: Option<DType>,
}

fn corrupt(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.display().to_string(),
        message: message.into(),
    }
}
mod config_keys;
mod gemma3;
mod gpt2;
mod granite_hybrid;
mod llama;
mod olmo2;
mod phi3;
mod qwen3;
mod rope;
mod weights;

use config_keys::{token_ids, Keys};
pub use weights::write_weights;
use weights::{drop_rotary_buffers, drop_tied_head, read_tensors};

/// Parse a config.json value into the model cockpit computes and what else it says.
pub fn parse_config(v: &Value) -> Result<(ModelConfig, HfInfo), String> {
    let map = v
        .as_object()
        .ok_or_else(|| "expected a JSON object".to_string())?;
    let model_type = match map.get("model_type").and_then(Value::as_str) {
        Some(t) => t,
        None => {
            return Err(format!(
                "model_type: missing (supported: {})",
                MODEL_TYPES.join(", ")
            ))
        }
    };
    if !MODEL_TYPES.contains(&model_type) {
        return Err(format!(
            "model_type = {model_type:?}: not supported (supported: {})",
            MODEL_TYPES.join(", ")
        ));
    }
    let mut k = Keys {
        map,
        model_type,
        used: HashSet::new(),
    };
    if let Some(q) = map.get("quantization_config") {
        return Err(format!(
            "quantization_config = {q}: quantized checkpoints are not supported"
        ));
    }
    for (key, ok) in [
        ("is_encoder_decoder", false),
        ("add_cross_attention", false),
        ("scale_attn_by_inverse_layer_idx", false),
    ] {
        if let Some(b) = k.get(key).and_then(Value::as_bool) {
            k.require(key, b, ok, "cockpit builds decoder-only models without it")?;
        }
    }
    if let Some(p) = k.get("pruned_heads") {
        if p.as_object().is_some_and(|o| !o.is_empty()) {
            return Err(format!(
                "pruned_heads = {p}: pruned heads are not supported"
            ));
        }
    }
    let mut sliding_window = None;
    let model = if model_type == "gpt2" {
        gpt2::parse(&mut k)?
    } else if model_type == "gemma3" {
        gemma3::parse_wrapper(&mut k)?
    } else if model_type.starts_with("gemma") {
        gemma3::parse(&mut k)?
    } else if model_type == granite_hybrid::MODEL_TYPE {
        granite_hybrid::parse(&mut k)?
    } else {
        llama::parse(&mut k, &mut sliding_window)?
    };
    if model.pos == PosEncoding::Rope && !model.head_dim.is_multiple_of(2) {
        return Err(format!(
            "head_dim = {}: RoPE needs an even head size",
            model.head_dim
        ));
    }
    let bos = token_ids(k.get("bos_token_id"), "bos_token_id")?;
    let info = HfInfo {
        model_type: model_type.to_string(),
        bos: bos.first().copied(),
        eos: token_ids(k.get("eos_token_id"), "eos_token_id")?,
        pad: token_ids(k.get("pad_token_id"), "pad_token_id")?
            .first()
            .copied(),
        sliding_window,
        dtype: k
            .get("torch_dtype")
            .or_else(|| map.get("dtype"))
            .and_then(Value::as_str)
            .and_then(dtype_from_torch),
    };
    k.finish()?;
    Ok((model, info))
}

fn dtype_from_torch(s: &str) -> Option<DType> {
    match s {
        "float32" => Some(DType::F32),
        "bfloat16" => Some(DType::BF16),
        "float16" => Some(DType::F16),
        _ => None,
    }
}

fn torch_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// The [`ModelSpec`](super::spec::ModelSpec) of a Hugging Face `config.json` (with its
/// `vocab_size`): the same translation that loads the model.
pub fn spec(config_json: &Value) -> Result<super::spec::ModelSpec, String> {
    let (m, _) = parse_config(config_json)?;
    Ok(super::spec::ModelSpec::from_model(&m, m.vocab_size))
}

/// Read and parse `dir/config.json` (and the token ids of generation_config.json where
/// config.json has none).
pub fn read_config(dir: &Path) -> Result<(ModelConfig, HfInfo), CheckpointError> {
    let cp = dir.join("config.json");
    let text = std::fs::read_to_string(&cp).map_err(|e| corrupt(&cp, e.to_string()))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| corrupt(&cp, format!("not JSON: {e}")))?;
    let (model, mut info) = parse_config(&v).map_err(|m| corrupt(&cp, m))?;
    let gp = dir.join("generation_config.json");
    if let Ok(text) = std::fs::read_to_string(&gp) {
        let g: Value =
            serde_json::from_str(&text).map_err(|e| corrupt(&gp, format!("not JSON: {e}")))?;
        if info.bos.is_none() {
            info.bos = token_ids(g.get("bos_token_id"), "bos_token_id")
                .map_err(|m| corrupt(&gp, m))?
                .first()
                .copied();
        }
        if info.eos.is_empty() {
            info.eos =
                token_ids(g.get("eos_token_id"), "eos_token_id").map_err(|m| corrupt(&gp, m))?;
        }
    }
    Ok((model, info))
}

/// Load a Hugging Face directory: the model it describes (seq_len = its longest context) and
/// its weights under cockpit's names, on the CPU in their stored dtype.
pub fn load(dir: &Path) -> Result<(ModelConfig, HfInfo, HashMap<String, Tensor>), CheckpointError> {
    let (mut model, info) = read_config(dir)?;
    let tensors = read_tensors(dir)?;
    let mut tensors = match info.model_type.as_str() {
        "gpt2" => gpt2::from_gpt2(tensors, &model, dir)?,
        "phi3" => phi3::split_fused(tensors, &model, dir)?,
        "gemma3" => language_model(tensors, &mut model),
        granite_hybrid::MODEL_TYPE => granite_hybrid::from_published(tensors),
        _ => tensors,
    };
    granite_hybrid::check(&tensors, &model, dir)?;
    drop_rotary_buffers(&mut tensors);
    drop_tied_head(&mut tensors, model.tie_embeddings, dir)?;
    Ok((model, info, tensors))
}

/// A `gemma3` checkpoint's language-model tensors under cockpit's names; the vision tower's and
/// projector's are left out (counted in the model's notes).
fn language_model(
    tensors: HashMap<String, Tensor>,
    model: &mut ModelConfig,
) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    let mut vision = 0;
    for (name, t) in tensors {
        match gemma3::language_model_name(&name) {
            Some(n) => {
                out.insert(n, t);
            }
            None => vision += 1,
        }
    }
    if vision > 0 {
        model
            .arch_notes
            .push(format!("{vision} vision tensors not loaded"));
    }
    out
}

/// Which Hugging Face model_type computes a model, preferring `prefer` (the base's) when it
/// does; an error says why none does.
pub fn model_type_for(m: &ModelConfig, prefer: Option<&str>) -> Result<String, String> {
    let llama_like =
        m.norm == Norm::RmsNorm && m.pos == PosEncoding::Rope && m.activation == Activation::SwiGlu;
    let multipliers = m.embedding_multiplier != 1.0
        || m.attention_multiplier != 0.0
        || m.residual_multiplier != 1.0
        || m.logits_scaling != 1.0;
    let plain = m.layout.is_plain();
    if m.hybrid.is_some() {
        return match llama_like && granite_hybrid::fits(m) {
            true => Ok(granite_hybrid::MODEL_TYPE.to_string()),
            false => Err(format!(
                "no Hugging Face model_type computes this model: {} computes a hybrid stack with rmsnorm + swiglu, no biases, no QK-norm or post-norm, no rope scaling, and a Mamba width (mamba_n_heads · mamba_d_head) that is a multiple of n_embd",
                granite_hybrid::MODEL_TYPE
            )),
        };
    }
    let longrope = matches!(m.rope_scaling, crate::config::RopeScaling::LongRope { .. });
    let fits = |t: &str| match t {
        "gemma3_text" | "gemma2" => gemma3::fits(m, t),
        _ if longrope && t != "phi3" => false,
        "gpt2" => {
            plain
                && m.norm == Norm::LayerNorm
                && m.pos == PosEncoding::Learned
                && m.activation == Activation::Gelu
                && m.bias
                && (m.n_kv_head == 0 || m.n_kv_head == m.n_head)
                && (m.head_dim == 0 || m.head_dim * m.n_head == m.n_embd)
                && (m.attention_multiplier == 0.0 || m.attention_multiplier == 1.0)
                && m.embedding_multiplier == 1.0
                && m.residual_multiplier == 1.0
                && m.logits_scaling == 1.0
        }
        "llama" | "mistral" => {
            plain && llama_like && !m.qkv_bias && !multipliers && (t == "llama" || !m.bias)
        }
        "qwen2" => plain && llama_like && m.qkv_bias && !m.bias && !multipliers,
        "granite" => plain && llama_like && !m.qkv_bias,
        "qwen3" => llama_like && !m.qkv_bias && !m.bias && !multipliers && qwen3::fits(m),
        "olmo2" => llama_like && !m.qkv_bias && !m.bias && !multipliers && olmo2::fits(m),
        "phi3" => llama_like && !m.qkv_bias && !m.bias && !multipliers && phi3::fits(m),
        _ => false,
    };
    if let Some(p) = prefer.filter(|p| fits(p)) {
        return Ok(p.to_string());
    }
    if let Some(t) = [
        "gpt2",
        "llama",
        "qwen2",
        "granite",
        "qwen3",
        "olmo2",
        "phi3",
        "gemma3_text",
        "gemma2",
    ]
    .into_iter()
    .find(|t| fits(t))
    {
        return Ok(t.to_string());
    }
    Err(format!(
        "no Hugging Face model_type computes this model ({}): gpt2 needs layernorm + learned positions + gelu with biases; llama, mistral, qwen2 and granite need rmsnorm + rope + swiglu; qwen3 adds per-head QK-norm, olmo2 whole-projection QK-norm and post-norm, phi3 partial rotary, without biases; gemma3_text and gemma2 need gemma's block (geglu, sandwich 1+w norms, √hidden embeddings)",
        block_keys(m)
    ))
}

/// The `[model]` keys that decide which family computes `m`, as its config spells them: its
/// norm, positions, MLP and biases, and each way `[model.layout]` departs from the plain block.
fn block_keys(m: &ModelConfig) -> String {
    fn spelled<T: serde::Serialize>(v: &T) -> String {
        match serde_json::to_value(v) {
            Ok(serde_json::Value::String(s)) => format!("\"{s}\""),
            Ok(other) => other.to_string(),
            Err(_) => "?".to_string(),
        }
    }
    let l = &m.layout;
    let mut keys = vec![
        format!("model.norm = {}", spelled(&m.norm)),
        format!("model.pos = {}", spelled(&m.pos)),
        format!("model.activation = {}", spelled(&m.activation)),
        format!("model.bias = {}", m.bias),
    ];
    if m.qkv_bias {
        keys.push("model.qkv_bias = true".to_string());
    }
    if l.qk_norm != crate::config::QkNorm::None {
        keys.push(format!("model.layout.qk_norm = {}", spelled(&l.qk_norm)));
    }
    for (on, key) in [
        (l.post_norm, "post_norm"),
        (l.sandwich_norm, "sandwich_norm"),
        (l.norm_plus_one, "norm_plus_one"),
    ] {
        if on {
            keys.push(format!("model.layout.{key} = true"));
        }
    }
    if l.rotary_dim > 0 {
        keys.push(format!("model.layout.rotary_dim = {}", l.rotary_dim));
    }
    if !l.layer_types.is_empty() || l.window > 0 {
        keys.push(format!(
            "model.layout.window = {} (sliding layers)",
            l.window
        ));
    }
    for (v, key) in [
        (l.local_rope_theta, "local_rope_theta"),
        (l.attn_softcap, "attn_softcap"),
        (l.final_softcap, "final_softcap"),
    ] {
        if v > 0.0 {
            keys.push(format!("model.layout.{key} = {v}"));
        }
    }
    keys.join(", ")
}

/// The config.json that makes transformers build `m` as `model_type`.
pub fn config_json(
    m: &ModelConfig,
    model_type: &str,
    vocab: usize,
    base: Option<&HfInfo>,
    dtype: DType,
) -> Value {
    let hidden = super::spec::mlp_width(m.n_embd, m.mlp_ratio);
    let mut c = serde_json::json!({
        "model_type": model_type,
        "vocab_size": vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": torch_name(dtype),
    });
    let o = c.as_object_mut().expect("a JSON object");
    if model_type == "gpt2" {
        gpt2::config_json(m, hidden, o);
    } else if model_type.starts_with("gemma") {
        gemma3::config_json(m, model_type, hidden, o);
    } else if model_type == granite_hybrid::MODEL_TYPE {
        granite_hybrid::config_json(m, hidden, o);
    } else {
        llama::config_json(m, model_type, hidden, base, o);
    }
    if let Some(b) = base {
        o.insert("bos_token_id".into(), serde_json::json!(b.bos));
        let eos = match b.eos.as_slice() {
            [] => Value::Null,
            [one] => serde_json::json!(one),
            many => serde_json::json!(many),
        };
        o.insert("eos_token_id".into(), eos);
        if let Some(p) = b.pad {
            o.insert("pad_token_id".into(), serde_json::json!(p));
        }
    }
    c
}

/// cockpit's tensors (Llama names, `[out, in]`) under `model_type`'s names and layout.
pub fn to_hf_names(
    tensors: Vec<(String, Tensor)>,
    model_type: &str,
    n_layer: usize,
) -> candle_core::Result<Vec<(String, Tensor)>> {
    match model_type {
        "gpt2" => gpt2::to_hf_names(tensors, n_layer),
        "phi3" => phi3::to_hf_names(tensors, n_layer),
        granite_hybrid::MODEL_TYPE => Ok(granite_hybrid::to_hf_names(tensors)),
        _ => Ok(tensors),
    }
}

/// Tokenizer files transformers reads beside the model.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

/// `generation_config.json` from the token ids.
pub fn generation_config(info: Option<&HfInfo>) -> Value {
    let mut g = serde_json::json!({"_from_model_config": true});
    if let Some(b) = info {
        let o = g.as_object_mut().expect("a JSON object");
        if let Some(bos) = b.bos {
            o.insert("bos_token_id".into(), bos.into());
        }
        match b.eos.as_slice() {
            [] => {}
            [one] => {
                o.insert("eos_token_id".into(), (*one).into());
            }
            many => {
                o.insert("eos_token_id".into(), serde_json::json!(many));
            }
        }
        if let Some(p) = b.pad {
            o.insert("pad_token_id".into(), p.into());
        }
    }
    g
}

/// Map a dtype name of the command line.
pub fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "f32" | "float32" => Some(DType::F32),
        "bf16" | "bfloat16" => Some(DType::BF16),
        "f16" | "float16" => Some(DType::F16),
        _ => None,
    }
}
