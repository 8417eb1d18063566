//! LoRA fine-tuning around the model: base weights from a cockpit checkpoint or a Hugging Face
//! Llama directory, PEFT-compatible adapter files, and merging adapters into the base.

use super::checkpoint::{self, atomic_write, CheckpointError};
use super::model::Model;
use crate::config::{Activation, Arch, Config, LoraConfig, ModelConfig, Norm, PosEncoding};
use candle_core::{Device, Tensor};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Base weights and the model shape they imply.
pub struct Base {
    pub model: ModelConfig,
    pub tensors: HashMap<String, Tensor>,
    pub description: String,
}

fn corrupt(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// The subset of a Hugging Face Llama `config.json` that fixes the shape.
#[derive(Deserialize)]
struct HfLlamaConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
}

impl Base {
    /// Learned positions keep the base's length; RoPE takes the run's (up to the base's).
    pub fn shape_for(b: &Base, run: &ModelConfig) -> ModelConfig {
        let seq_len = match b.model.pos {
            PosEncoding::Learned => b.model.seq_len,
            PosEncoding::Rope => run.seq_len.min(b.model.seq_len),
        };
        ModelConfig {
            seq_len,
            dropout: run.dropout,
            ..b.model.clone()
        }
    }
}

/// Whether `dir` looks like a Hugging Face model directory (config.json + safetensors).
pub fn is_hf_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file() && !dir.join("manifest.json").is_file()
}

/// Load a Hugging Face Llama directory: `config.json` plus `*.safetensors` with HF names.
pub fn load_hf_llama(dir: &Path, seq_len: usize, device: &Device) -> Result<Base, CheckpointError> {
    let cp = dir.join("config.json");
    let text = std::fs::read_to_string(&cp).map_err(|e| corrupt(&cp, e.to_string()))?;
    let hf: HfLlamaConfig = serde_json::from_str(&text)
        .map_err(|e| corrupt(&cp, format!("not a Llama config: {e}")))?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| corrupt(dir, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(corrupt(dir, "no *.safetensors files"));
    }
    let mut tensors = HashMap::new();
    for f in &files {
        let t = candle_core::safetensors::load(f, device).map_err(|e| corrupt(f, e.to_string()))?;
        tensors.extend(t);
    }
    let model = ModelConfig {
        arch: Arch::Llama,
        vocab_size: hf.vocab_size,
        n_layer: hf.num_hidden_layers,
        n_head: hf.num_attention_heads,
        n_kv_head: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        n_embd: hf.hidden_size,
        seq_len: seq_len.min(hf.max_position_embeddings.unwrap_or(seq_len)),
        mlp_ratio: hf.intermediate_size as f64 / hf.hidden_size as f64,
        norm: Norm::RmsNorm,
        norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
        pos: PosEncoding::Rope,
        rope_theta: hf.rope_theta.unwrap_or(10000.0),
        activation: Activation::SwiGlu,
        tie_embeddings: hf.tie_word_embeddings.unwrap_or(false)
            || !tensors.contains_key("lm_head.weight"),
        dropout: 0.0,
        bias: false,
        init_std: 0.02,
        arch_notes: Vec::new(),
    };
    let description = format!(
        "Hugging Face Llama {} ({} files)",
        dir.display(),
        files.len()
    );
    Ok(Base {
        model,
        tensors,
        description,
    })
}

/// A checkpoint with the config it was trained with.
fn load_with_config(
    spec: &Path,
    device: &Device,
) -> Result<(std::path::PathBuf, checkpoint::Loaded, Config), CheckpointError> {
    let dir = checkpoint::resolve(spec)?;
    let loaded = checkpoint::load(&dir, device)?;
    let cfg: Config = serde_json::from_value(loaded.state.config.clone()).map_err(|e| {
        corrupt(
            &dir.join("state.json"),
            format!("no usable config in the checkpoint: {e}"),
        )
    })?;
    Ok((dir, loaded, cfg))
}

/// Load a cockpit checkpoint as a base: its model config and weights.
pub fn load_cockpit_base(spec: &Path, device: &Device) -> Result<Base, CheckpointError> {
    let (dir, loaded, cfg) = load_with_config(spec, device)?;
    let tensors = loaded
        .model
        .into_iter()
        .filter(|(k, _)| !k.contains(".lora_"))
        .collect();
    Ok(Base {
        model: cfg.model,
        tensors,
        description: format!("cockpit checkpoint {}", dir.display()),
    })
}

/// Load base weights named by `lora.base`.
pub fn load_base(
    lora: &LoraConfig,
    seq_len: usize,
    device: &Device,
) -> Result<Base, CheckpointError> {
    let p = Path::new(&lora.base);
    if is_hf_dir(p) {
        load_hf_llama(p, seq_len, device)
    } else {
        load_cockpit_base(p, device)
    }
}

/// Write `adapter_model.safetensors` + `adapter_config.json` (PEFT layout) into `dir`.
pub fn save_adapter(dir: &Path, model: &Model, lora: &LoraConfig) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(|e| corrupt(dir, e.to_string()))?;
    let tensors: HashMap<String, Tensor> = model.adapter_tensors().into_iter().collect();
    let tmp = dir.join(".adapter_model.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp).map_err(|e| corrupt(&tmp, e.to_string()))?;
    let dest = dir.join("adapter_model.safetensors");
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &dest))
        .map_err(|e| corrupt(&dest, e.to_string()))?;
    let modules: Vec<String> = lora.targets.iter().map(|t| format!("{t}_proj")).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "base_model_name_or_path": lora.base,
    });
    let text = serde_json::to_vec_pretty(&config).unwrap_or_default();
    let cp = dir.join("adapter_config.json");
    atomic_write(&cp, &text).map_err(|e| corrupt(&cp, e.to_string()))
}

/// Write merged weights (base + adapters, HF names, no LoRA tensors) to `out/model.safetensors`.
pub fn write_merged(out: &Path, model: &Model) -> Result<std::path::PathBuf, CheckpointError> {
    std::fs::create_dir_all(out).map_err(|e| corrupt(out, e.to_string()))?;
    let merged = model
        .merged_tensors()
        .map_err(|e| CheckpointError::Tensor(e.to_string()))?;
    let map: HashMap<String, Tensor> = merged.into_iter().collect();
    let dest = out.join("model.safetensors");
    let tmp = out.join(".model.safetensors.tmp");
    candle_core::safetensors::save(&map, &tmp).map_err(|e| corrupt(&tmp, e.to_string()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &dest))
        .map_err(|e| corrupt(&dest, e.to_string()))?;
    Ok(dest)
}

/// Build the model a LoRA checkpoint was trained with, load base and adapter weights.
pub fn model_from_checkpoint(
    spec: &Path,
    device: &Device,
) -> Result<(Model, Config), CheckpointError> {
    let (dir, loaded, cfg) = load_with_config(spec, device)?;
    let vocab = loaded
        .model
        .get("model.embed_tokens.weight")
        .and_then(|t| t.dims2().ok())
        .map(|(v, _)| v)
        .ok_or_else(|| corrupt(&dir, "no model.embed_tokens.weight"))?;
    let shape = super::model::Shape::from_config(&cfg, vocab);
    let tensor_err = |e: candle_core::Error| CheckpointError::Tensor(e.to_string());
    let mut model =
        Model::new(shape, candle_core::DType::F32, device, cfg.run.seed).map_err(tensor_err)?;
    if cfg.lora.enabled {
        let spec = super::model::LoraSpec {
            r: cfg.lora.r,
            alpha: cfg.lora.alpha,
            targets: cfg.lora.targets.clone(),
        };
        model.add_lora(&spec, cfg.run.seed).map_err(tensor_err)?;
    }
    model
        .load_named(&loaded.model, false)
        .map_err(|m| CheckpointError::Mismatch {
            path: dir.display().to_string(),
            message: m,
        })?;
    Ok((model, cfg))
}
