//! LoRA fine-tuning around the model: PEFT-compatible adapter files, merging adapters into
//! the base, and rebuilding a trained model from a checkpoint (the base itself: `base`).

use super::checkpoint::{self, CheckpointError};
use super::model::Model;
use crate::config::{Config, LoraConfig};
use crate::util::atomic_write;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

fn corrupt(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// A checkpoint with the config it was trained with.
fn load_with_config(
    spec: &Path,
    device: &Device,
) -> Result<(std::path::PathBuf, checkpoint::Loaded, Config), CheckpointError> {
    let dir = checkpoint::resolve(spec)?;
    let loaded = checkpoint::load_weights(&dir, device)?;
    let cfg = super::base::checkpoint_config(&dir)?;
    Ok((dir, loaded, cfg))
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
    save_adapter_config(dir, lora, model.spec.hybrid.is_some())
}

/// `adapter_config.json` (the PEFT layout) for adapters on `lora.targets`.
/// (`hybrid`: a Granite 4.0 hybrid, whose shared MLP's projections are `input_linear` and
/// `output_linear` and whose Mamba layers' are `in_proj` and `out_proj`.)
pub fn save_adapter_config(
    dir: &Path,
    lora: &LoraConfig,
    hybrid: bool,
) -> Result<(), CheckpointError> {
    let modules: Vec<String> = lora
        .targets
        .iter()
        .map(|t| match (t.as_str(), hybrid) {
            ("in_proj" | "out_proj", _) => t.clone(),
            ("up", true) => "input_linear".into(),
            ("down", true) => "output_linear".into(),
            _ => format!("{t}_proj"),
        })
        .collect();
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

/// Build the model a checkpoint was trained with (f32), load its weights (base and adapters).
pub fn model_from_checkpoint(
    spec: &Path,
    device: &Device,
) -> Result<(Model, Config), CheckpointError> {
    model_from_checkpoint_as(spec, candle_core::DType::F32, device)
}

/// [`model_from_checkpoint`] computing in `dtype`.
pub fn model_from_checkpoint_as(
    spec: &Path,
    dtype: candle_core::DType,
    device: &Device,
) -> Result<(Model, Config), CheckpointError> {
    let (dir, loaded, cfg) = load_with_config(spec, device)?;
    let vocab = loaded
        .model
        .get("model.embed_tokens.weight")
        .and_then(|t| t.dims2().ok())
        .map(|(v, _)| v)
        .ok_or_else(|| corrupt(&dir, "no model.embed_tokens.weight"))?;
    let spec = super::model::ModelSpec::from_config(&cfg, vocab);
    let tensor_err = |e: candle_core::Error| CheckpointError::Tensor(e.to_string());
    // (Every weight comes from the checkpoint: none is drawn at random first.)
    let store = super::model::BaseStore {
        init: super::model::BaseInit::Loaded,
        ..Default::default()
    };
    let mut model =
        Model::new_with(spec.clone(), dtype, device, cfg.run.seed, store).map_err(tensor_err)?;
    if cfg.lora.enabled && cfg.lora.base_dtype == crate::config::BaseDtype::Nf4 {
        // The checkpoint holds no 4-bit matrices: the base is quantized again, as the run did.
        let mismatch = |message: String| CheckpointError::Mismatch {
            path: dir.display().to_string(),
            message,
        };
        if cfg.lora.base == crate::config::RANDOM_BASE {
            return Err(mismatch(
                "the run trained adapters on a random NF4 base (lora.base = \"random\"), which no file holds".into(),
            ));
        }
        let base = super::base::load(Path::new(&cfg.lora.base))?;
        super::base::load_into(&model, &base, "lora.base").map_err(|e| mismatch(e.to_string()))?;
        let kept = super::base::kept_blocks(Path::new(&cfg.lora.base))?;
        model.quantize_base(&kept).map_err(tensor_err)?;
    }
    if let Some(lora) = &spec.lora {
        model.add_lora(lora, cfg.run.seed).map_err(tensor_err)?;
    }
    model
        .load_named(&loaded.model, false)
        .map_err(|m| CheckpointError::Mismatch {
            path: dir.display().to_string(),
            message: m,
        })?;
    Ok((model, cfg))
}
