//! Hugging Face model directories, in and out: `config.json` read by `model_type` into the
//! model cockpit computes (exactly, or refused with the key that stands in the way), safetensors
//! (one file or shards through `model.safetensors.index.json`; f32, bf16 or f16), and the same
//! layout written back for `cockpit export`.
//!
//! Over 1,000 lines for now: the per-family config readers and weight-name maps still live
//! here side by side; the model-family issue (Qwen3, Gemma 3, Phi-3, OLMo 2) splits them into
//! one file per family under `hf/`, which is where a new family goes.
//!
//! Supported: `llama` (2 and 3.x; rope_scaling linear and llama3; head_dim; tied or not),
//! `mistral` (sliding windows only where they change nothing), `qwen2` (q/k/v biases),
//! `gpt2` (Conv1D weights stored transposed, learned positions, tied head) and `granite`
//! (dense: embedding/attention/residual multipliers and logits scaling).

use super::checkpoint::CheckpointError;
use crate::config::{Activation, Arch, ModelConfig, Norm, PosEncoding, RopeScaling};
use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The model types cockpit imports and exports.
pub const MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "gpt2", "granite"];

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

/// Keys every `PretrainedConfig` may carry that do not touch the arithmetic.
const GENERIC_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "_attn_implementation_autoset",
    "attn_implementation",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "finetuning_task",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "chunk_size_feed_forward",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "loss_type",
    // Dropout rates: training only (cockpit's model.dropout applies); no effect on the outputs.
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "summary_first_dropout",
    // Tensor-parallel split of the matmuls in pretraining: the same arithmetic.
    "pretraining_tp",
    // GPT-2's sequence-summary head (GPT2DoubleHeadsModel only) and its old context key.
    "summary_activation",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    "n_ctx",
    // Upcasting the attention to f32: numerics only (cockpit's CPU path is f32 throughout).
    "reorder_and_upcast_attn",
    "scale_attn_by_inverse_layer_idx",
    "add_cross_attention",
    "is_encoder_decoder",
    "is_decoder",
    "pruned_heads",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "max_window_layers",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "hidden_act",
    "activation_function",
];

/// config.json read key by key: every key is either used, known to be harmless, or an error.
struct Keys<'a> {
    map: &'a Map<String, Value>,
    model_type: &'a str,
    used: HashSet<&'a str>,
}

impl<'a> Keys<'a> {
    fn get(&mut self, key: &'a str) -> Option<&'a Value> {
        self.used.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn usize(&mut self, key: &'a str, default: Option<usize>) -> Result<usize, String> {
        match self.get(key) {
            None => {
                default.ok_or_else(|| format!("{key}: missing (needed for {})", self.model_type))
            }
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{key} = {v}: expected a non-negative integer")),
        }
    }
    fn f64(&mut self, key: &'a str, default: f64) -> Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("{key} = {v}: expected a number")),
        }
    }
    fn bool(&mut self, key: &'a str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("{key} = {v}: expected true or false")),
        }
    }
    fn str(&mut self, key: &'a str, default: &str) -> Result<String, String> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{key} = {v}: expected a string")),
        }
    }
    /// A key whose value must be the one cockpit computes.
    fn require<T: PartialEq + std::fmt::Display>(
        &self,
        key: &str,
        value: T,
        supported: T,
        why: &str,
    ) -> Result<(), String> {
        if value == supported {
            Ok(())
        } else {
            Err(format!(
                "{key} = {value}: not supported for {} (supported: {supported}); {why}",
                self.model_type
            ))
        }
    }
    /// Every key left is unknown: it may change the arithmetic, so it is refused.
    fn finish(&self) -> Result<(), String> {
        for (k, v) in self.map {
            if !self.used.contains(k.as_str()) && !GENERIC_KEYS.contains(&k.as_str()) {
                return Err(format!(
                    "{k} = {v}: a key cockpit does not know for {}; it may change what the model computes, so the model is not loaded",
                    self.model_type
                ));
            }
        }
        Ok(())
    }
}

fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(|n| vec![n as u32])
            .ok_or_else(|| format!("{key} = {n}: expected a token id")),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as u32)
                    .ok_or_else(|| format!("{key} = {x}: expected token ids"))
            })
            .collect(),
        Some(other) => Err(format!("{key} = {other}: expected a token id or a list")),
    }
}

/// RoPE θ and scaling from `rope_theta` + `rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5).
fn rope(k: &mut Keys, default_theta: f64) -> Result<(f64, RopeScaling), String> {
    let legacy_theta = k.f64("rope_theta", default_theta)?;
    let (obj, name) = match (k.get("rope_parameters"), k.get("rope_scaling")) {
        (Some(p), _) => (p, "rope_parameters"),
        (None, Some(s)) => (s, "rope_scaling"),
        (None, None) => return Ok((legacy_theta, RopeScaling::None)),
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
    Ok((theta, scaling))
}

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
        let act = k.str("activation_function", "gelu_new")?;
        if !matches!(act.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
            return Err(format!(
                "activation_function = {act:?}: not supported for gpt2 (supported: gelu_new, gelu_pytorch_tanh: GELU with the tanh approximation)"
            ));
        }
        let n_embd = k.usize("n_embd", Some(768))?;
        let n_positions = k.usize("n_positions", Some(1024))?;
        let hidden = k.usize("n_inner", Some(4 * n_embd))?;
        ModelConfig {
            arch: Arch::Gpt,
            vocab_size: k.usize("vocab_size", Some(50257))?,
            n_layer: k.usize("n_layer", Some(12))?,
            n_head: k.usize("n_head", Some(12))?,
            n_kv_head: 0,
            n_embd,
            seq_len: n_positions,
            mlp_ratio: hidden as f64 / n_embd as f64,
            norm: Norm::LayerNorm,
            norm_eps: k.f64("layer_norm_epsilon", 1e-5)?,
            pos: PosEncoding::Learned,
            activation: Activation::Gelu,
            tie_embeddings: k.bool("tie_word_embeddings", true)?,
            bias: true,
            n_positions,
            attention_multiplier: if k.bool("scale_attn_weights", true)? {
                0.0
            } else {
                1.0
            },
            ..ModelConfig::default()
        }
    } else {
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
            "qwen2" => (1e-6, false, 32768),
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
        let head_dim = k.usize("head_dim", Some(n_embd / n_head))?;
        let (theta, scaling) = rope(&mut k, 10000.0)?;
        let max_pos = k.usize("max_position_embeddings", Some(default_max))?;
        let (mut bias, mut qkv_bias) = (false, false);
        match model_type {
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
                let sw = k.bool("use_sliding_window", false)?;
                k.require(
                    "use_sliding_window",
                    sw,
                    false,
                    "cockpit has no sliding-window attention",
                )?;
                if let Some(types) = k.get("layer_types") {
                    let all_full = types
                        .as_array()
                        .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
                    if !all_full {
                        return Err(format!(
                            "layer_types = {types}: only \"full_attention\" layers are supported"
                        ));
                    }
                }
            }
            "mistral" => {
                // MistralConfig's default window is 4096 when the key is absent.
                sliding_window = match map.get("sliding_window") {
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
            ..ModelConfig::default()
        };
        if model_type == "granite" {
            m.embedding_multiplier = k.f64("embedding_multiplier", 1.0)?;
            m.attention_multiplier = k.f64("attention_multiplier", 1.0)?;
            m.residual_multiplier = k.f64("residual_multiplier", 1.0)?;
            m.logits_scaling = k.f64("logits_scaling", 1.0)?;
        }
        m
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

/// model.safetensors.index.json's tensor name → shard file.
type WeightMap = BTreeMap<String, String>;

/// The safetensors files of a directory: the shards an index names, or model.safetensors.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>), CheckpointError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| corrupt(&index, e.to_string()))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| corrupt(&index, format!("not JSON: {e}")))?;
        let map: BTreeMap<String, String> = v
            .get("weight_map")
            .cloned()
            .and_then(|m| serde_json::from_value(m).ok())
            .ok_or_else(|| corrupt(&index, "no weight_map of tensor name → file name"))?;
        let mut files: Vec<String> = map.values().cloned().collect();
        files.sort();
        files.dedup();
        let mut paths = Vec::new();
        for f in files {
            let p = dir.join(&f);
            if f.contains('/') || f.contains("..") || !p.is_file() {
                return Err(corrupt(
                    &index,
                    format!("names the shard {f:?}, which is missing"),
                ));
            }
            paths.push(p);
        }
        return Ok((paths, Some(map)));
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let msg = if dir.join("pytorch_model.bin").is_file() {
        "only safetensors weights are supported (pytorch_model.bin found; convert it with transformers: model.save_pretrained(dir, safe_serialization=True))"
    } else {
        "no model.safetensors or model.safetensors.index.json"
    };
    Err(corrupt(dir, msg))
}

/// Every tensor of the files (on the CPU, in their stored dtype: f32, bf16 or f16).
fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>, CheckpointError> {
    let (files, index) = weight_files(dir)?;
    let mut out = HashMap::new();
    for path in &files {
        let bytes = std::fs::read(path).map_err(|e| corrupt(path, e.to_string()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| corrupt(path, format!("not a readable safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                other => {
                    return Err(corrupt(
                        path,
                        format!(
                            "{name}: dtype {other:?} is not supported (supported: F32, BF16, F16)"
                        ),
                    ))
                }
            };
            if let Some(map) = &index {
                let listed = map.get(&name).map(|f| dir.join(f));
                if listed.as_deref() != Some(path.as_path()) {
                    return Err(corrupt(
                        path,
                        format!("holds {name}, which model.safetensors.index.json does not place in this file"),
                    ));
                }
            }
            let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)
                .map_err(|e| corrupt(path, format!("{name}: {e}")))?;
            if out.insert(name.clone(), t).is_some() {
                return Err(corrupt(path, format!("{name}: stored twice")));
            }
        }
    }
    if let Some(map) = &index {
        if let Some((name, file)) = map.iter().find(|(n, _)| !out.contains_key(*n)) {
            return Err(corrupt(
                &dir.join(file),
                format!("lacks {name}, which model.safetensors.index.json places in it"),
            ));
        }
    }
    Ok(out)
}

fn gpt2_prefix(name: &str) -> &str {
    name.strip_prefix("transformer.").unwrap_or(name)
}

/// GPT-2's names and Conv1D layout (`[in, out]`, q|k|v fused) to cockpit's (Llama names,
/// `[out, in]`).
fn from_gpt2(
    tensors: HashMap<String, Tensor>,
    m: &ModelConfig,
    dir: &Path,
) -> Result<HashMap<String, Tensor>, CheckpointError> {
    let err = |name: &str, msg: String| corrupt(dir, format!("{name}: {msg}"));
    fn te<'a>(dir: &'a Path, name: &'a str) -> impl Fn(candle_core::Error) -> CheckpointError + 'a {
        move |e| corrupt(dir, format!("{name}: {e}"))
    }
    let mut out = HashMap::new();
    let mut lm_head = None;
    for (name, t) in tensors {
        let short = gpt2_prefix(&name);
        let parts: Vec<&str> = short.split('.').collect();
        let layer = |rest: &str| format!("model.layers.{}.{rest}", parts[1]);
        let conv = |t: &Tensor| t.t().and_then(|t| t.contiguous()).map_err(te(dir, &name));
        match parts.as_slice() {
            ["wte", "weight"] => {
                out.insert("model.embed_tokens.weight".to_string(), t);
            }
            ["wpe", "weight"] => {
                out.insert("model.embed_positions.weight".to_string(), t);
            }
            ["ln_f", w] => {
                out.insert(format!("model.norm.{w}"), t);
            }
            ["h", _, "ln_1", w] => {
                out.insert(layer(&format!("input_layernorm.{w}")), t);
            }
            ["h", _, "ln_2", w] => {
                out.insert(layer(&format!("post_attention_layernorm.{w}")), t);
            }
            ["h", _, "attn", "c_attn", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                let n = t.dim(0).map_err(te(dir, &name))?;
                if n != 3 * m.n_embd {
                    return Err(err(
                        &name,
                        format!("{n} q|k|v rows, expected 3·{}", m.n_embd),
                    ));
                }
                for (i, p) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                    let part = t
                        .narrow(0, i * m.n_embd, m.n_embd)
                        .map_err(te(dir, &name))?;
                    out.insert(
                        layer(&format!("self_attn.{p}.{w}")),
                        part.contiguous().map_err(te(dir, &name))?,
                    );
                }
            }
            ["h", _, "attn", "c_proj", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("self_attn.o_proj.{w}")), t);
            }
            ["h", _, "mlp", "c_fc", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("mlp.up_proj.{w}")), t);
            }
            ["h", _, "mlp", "c_proj", w] => {
                let t = if *w == "weight" { conv(&t)? } else { t };
                out.insert(layer(&format!("mlp.down_proj.{w}")), t);
            }
            // The causal-mask buffers of older checkpoints: what cockpit computes anyway.
            ["h", _, "attn", "bias" | "masked_bias"] => {}
            _ if name == "lm_head.weight" => lm_head = Some(t),
            _ => {
                return Err(err(
                    &name,
                    "not a tensor of a GPT2LMHeadModel; refusing to drop it".into(),
                ))
            }
        }
    }
    if let Some(h) = lm_head {
        out.insert("lm_head.weight".to_string(), h);
    }
    Ok(out)
}

/// A tied model's file may carry its head anyway; it must then equal the embedding.
fn drop_tied_head(
    tensors: &mut HashMap<String, Tensor>,
    tied: bool,
    dir: &Path,
) -> Result<(), CheckpointError> {
    if !tied {
        return Ok(());
    }
    if let Some(h) = tensors.remove("lm_head.weight") {
        let same = tensors
            .get("model.embed_tokens.weight")
            .map(|e| {
                e.dims() == h.dims()
                    && (e.to_dtype(DType::F32).and_then(|e| {
                        (e - h.to_dtype(DType::F32)?)?
                            .abs()?
                            .max_all()?
                            .to_scalar::<f32>()
                    }))
                    .is_ok_and(|d| d == 0.0)
            })
            .unwrap_or(false);
        if !same {
            return Err(corrupt(
                dir,
                "lm_head.weight differs from the embedding, but tie_word_embeddings is true",
            ));
        }
    }
    Ok(())
}

/// Old Llama checkpoints store each layer's RoPE frequencies; cockpit computes them.
fn drop_rotary_buffers(tensors: &mut HashMap<String, Tensor>) {
    tensors.retain(|k, _| !k.ends_with(".rotary_emb.inv_freq"));
}

/// Load a Hugging Face directory: the model it describes (seq_len = its longest context) and
/// its weights under cockpit's names, on the CPU in their stored dtype.
pub fn load(dir: &Path) -> Result<(ModelConfig, HfInfo, HashMap<String, Tensor>), CheckpointError> {
    let (model, info) = read_config(dir)?;
    let tensors = read_tensors(dir)?;
    let mut tensors = if info.model_type == "gpt2" {
        from_gpt2(tensors, &model, dir)?
    } else {
        tensors
    };
    drop_rotary_buffers(&mut tensors);
    drop_tied_head(&mut tensors, model.tie_embeddings, dir)?;
    Ok((model, info, tensors))
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
    let fits = |t: &str| match t {
        "gpt2" => {
            m.norm == Norm::LayerNorm
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
            llama_like && !m.qkv_bias && !multipliers && (t == "llama" || !m.bias)
        }
        "qwen2" => llama_like && m.qkv_bias && !m.bias && !multipliers,
        "granite" => llama_like && !m.qkv_bias,
        _ => false,
    };
    if let Some(p) = prefer.filter(|p| fits(p)) {
        return Ok(p.to_string());
    }
    if let Some(t) = ["gpt2", "llama", "qwen2", "granite"]
        .into_iter()
        .find(|t| fits(t))
    {
        return Ok(t.to_string());
    }
    Err(format!(
        "no Hugging Face model_type computes this model ({:?} norm, {:?} positions, {:?} MLP{}): gpt2 needs layernorm + learned positions + gelu with biases; llama, mistral, qwen2 and granite need rmsnorm + rope + swiglu",
        m.norm,
        m.pos,
        m.activation,
        if m.qkv_bias { ", q/k/v biases" } else { "" }
    ))
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
    let head_dim = m.head_size();
    let kv = m.kv_heads();
    let mut c = serde_json::json!({
        "model_type": model_type,
        "vocab_size": vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": torch_name(dtype),
    });
    let o = c.as_object_mut().expect("a JSON object");
    if model_type == "gpt2" {
        let positions = m.n_positions.max(m.seq_len);
        o.insert(
            "architectures".into(),
            serde_json::json!(["GPT2LMHeadModel"]),
        );
        for (k, v) in [
            ("n_embd", serde_json::json!(m.n_embd)),
            ("n_layer", serde_json::json!(m.n_layer)),
            ("n_head", serde_json::json!(m.n_head)),
            ("n_positions", serde_json::json!(positions)),
            ("n_ctx", serde_json::json!(positions)),
            ("n_inner", serde_json::json!(hidden)),
            ("activation_function", serde_json::json!("gelu_new")),
            ("layer_norm_epsilon", serde_json::json!(m.norm_eps)),
            (
                "scale_attn_weights",
                serde_json::json!(m.attention_multiplier == 0.0),
            ),
            ("resid_pdrop", serde_json::json!(0.0)),
            ("embd_pdrop", serde_json::json!(0.0)),
            ("attn_pdrop", serde_json::json!(0.0)),
        ] {
            o.insert(k.into(), v);
        }
    } else {
        let arch = match model_type {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "granite" => "GraniteForCausalLM",
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
        let scaling = match m.rope_scaling {
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
        };
        o.insert("rope_scaling".into(), scaling);
        match model_type {
            "qwen2" => {
                o.insert("use_sliding_window".into(), Value::Bool(false));
            }
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
    if model_type != "gpt2" {
        return Ok(tensors);
    }
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let mut take = |n: &str| {
        by_name
            .remove(n)
            .ok_or_else(|| candle_core::Error::Msg(format!("{n}: missing")))
    };
    let conv = |t: Tensor| t.t()?.contiguous();
    let mut out = vec![
        (
            "transformer.wte.weight".into(),
            take("model.embed_tokens.weight")?,
        ),
        (
            "transformer.wpe.weight".into(),
            take("model.embed_positions.weight")?,
        ),
        ("transformer.ln_f.weight".into(), take("model.norm.weight")?),
        ("transformer.ln_f.bias".into(), take("model.norm.bias")?),
    ];
    for i in 0..n_layer {
        let p = format!("model.layers.{i}");
        let h = format!("transformer.h.{i}");
        for (from, to) in [
            ("input_layernorm", "ln_1"),
            ("post_attention_layernorm", "ln_2"),
        ] {
            for w in ["weight", "bias"] {
                out.push((format!("{h}.{to}.{w}"), take(&format!("{p}.{from}.{w}"))?));
            }
        }
        let qkv = |w: &str, take: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>| {
            let parts = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .map(|n| take(&format!("{p}.self_attn.{n}.{w}")))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        };
        out.push((
            format!("{h}.attn.c_attn.weight"),
            conv(qkv("weight", &mut take)?)?,
        ));
        out.push((format!("{h}.attn.c_attn.bias"), qkv("bias", &mut take)?));
        for (from, to) in [
            ("self_attn.o_proj", "attn.c_proj"),
            ("mlp.up_proj", "mlp.c_fc"),
            ("mlp.down_proj", "mlp.c_proj"),
        ] {
            out.push((
                format!("{h}.{to}.weight"),
                conv(take(&format!("{p}.{from}.weight"))?)?,
            ));
            out.push((format!("{h}.{to}.bias"), take(&format!("{p}.{from}.bias"))?));
        }
    }
    if let Ok(head) = take("lm_head.weight") {
        out.push(("lm_head.weight".into(), head));
    }
    Ok(out)
}

/// Write tensors as `model.safetensors`, or as shards of at most `max_shard_bytes` with
/// `model.safetensors.index.json` when they do not fit in one.
pub fn write_weights(
    dir: &Path,
    tensors: &[(String, Tensor)],
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>, CheckpointError> {
    let size = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    let total: u64 = tensors.iter().map(|(_, t)| size(t)).sum();
    let mut shards: Vec<Vec<&(String, Tensor)>> = vec![Vec::new()];
    let mut current = 0;
    for nt in tensors {
        let s = size(&nt.1);
        if current > 0 && current + s > max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += s;
        shards.last_mut().expect("one shard").push(nt);
    }
    let n = shards.len();
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let path = dir.join(&name);
        let map: HashMap<String, Tensor> =
            shard.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let views: Vec<(String, Tensor)> = map.into_iter().collect();
        safetensors_save(&views, &meta, &path)?;
        for (k, _) in shard.iter() {
            weight_map.insert(k.clone(), name.clone());
        }
        written.push(path);
    }
    if n > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        let text = serde_json::to_vec_pretty(&index).unwrap_or_default();
        std::fs::write(&p, text).map_err(|e| corrupt(&p, e.to_string()))?;
        written.push(p);
    }
    Ok(written)
}

/// safetensors with metadata (transformers wants `format = pt`).
fn safetensors_save(
    tensors: &[(String, Tensor)],
    meta: &HashMap<String, String>,
    path: &Path,
) -> Result<(), CheckpointError> {
    let mut bufs = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dtype, bytes) = tensor_bytes(t).map_err(|e| corrupt(path, format!("{name}: {e}")))?;
        bufs.push((name.clone(), dtype, t.dims().to_vec(), bytes));
    }
    let views = bufs
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| corrupt(path, format!("{n}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, Some(meta.clone()), path)
        .map_err(|e| corrupt(path, e.to_string()))
}

fn tensor_bytes(t: &Tensor) -> candle_core::Result<(safetensors::Dtype, Vec<u8>)> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?.flatten_all()?;
    Ok(match t.dtype() {
        DType::BF16 => (
            safetensors::Dtype::BF16,
            t.to_vec1::<half::bf16>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            safetensors::Dtype::F16,
            t.to_vec1::<half::f16>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        _ => (
            safetensors::Dtype::F32,
            t.to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
    })
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
