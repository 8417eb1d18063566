//! Pretrained weights a run starts from (`model.init_from` for full fine-tuning, `lora.base`
//! for LoRA): a Hugging Face directory or a cockpit run/checkpoint. The base fixes the model's
//! shape; a `[model]` key set to something else is an error naming both values. The base also
//! brings its tokenizer (`data.tokenizer = "auto" | "base"`) and its BOS/EOS ids.

use super::checkpoint::{self, CheckpointError};
use super::data::Special;
use super::hf::{self, HfInfo};
use super::kernels::ggml::GgmlBlocks;
use super::EngineError;
use crate::config::{Config, ModelConfig, PosEncoding};
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A run dir keeps its Hugging Face base's config, generation config and tokenizer files
/// here, so export and generate work after the base directory moved.
pub const HF_BASE_DIR: &str = "hf_base";

/// What a base is, without its weights.
#[derive(Clone, Debug)]
pub struct BaseMeta {
    /// Its model, with seq_len = the longest context it supports.
    pub model: ModelConfig,
    /// The Hugging Face side: model_type and token ids (a cockpit base trained from one
    /// carries its base's).
    pub hf: Option<HfInfo>,
    /// The directory holding config.json and the tokenizer files of the Hugging Face side.
    pub hf_dir: Option<PathBuf>,
    /// The tokenizer the base was trained with: a tokenizer.json path, "byte", or None
    /// (a Hugging Face directory without tokenizer.json; the built-in corpus).
    pub tokenizer: Option<String>,
    pub description: String,
}

/// Base weights (cockpit names, on the CPU in their stored dtype) and what they are.
pub struct Base {
    pub meta: BaseMeta,
    pub tensors: HashMap<String, Tensor>,
}

pub use super::locate::is_hf_dir;
use super::locate::Location;

fn hf_tokenizer(dir: &Path) -> Option<String> {
    let t = dir.join("tokenizer.json");
    t.is_file().then(|| t.display().to_string())
}

/// The Hugging Face side a run dir kept (`RUN/hf_base/`), if any.
pub fn kept_hf(run_dir: &Path) -> Result<Option<(HfInfo, PathBuf)>, CheckpointError> {
    let d = run_dir.join(HF_BASE_DIR);
    if !d.join("config.json").is_file() {
        return Ok(None);
    }
    let (_, info) = hf::read_config(&d)?;
    Ok(Some((info, d)))
}

/// The config a cockpit checkpoint was trained with.
pub fn checkpoint_config(step_dir: &Path) -> Result<Config, CheckpointError> {
    let sp = step_dir.join("state.json");
    let text = std::fs::read_to_string(&sp).map_err(|e| CheckpointError::Corrupt {
        path: sp.display().to_string(),
        message: e.to_string(),
    })?;
    let state: checkpoint::TrainState =
        serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
            path: sp.display().to_string(),
            message: e.to_string(),
        })?;
    serde_json::from_value(state.config).map_err(|e| CheckpointError::Corrupt {
        path: sp.display().to_string(),
        message: format!("no usable config in the checkpoint: {e}"),
    })
}

/// Read what a base is (config files only, no weights).
pub fn meta(spec: &Path) -> Result<BaseMeta, CheckpointError> {
    meta_at(&super::locate::locate(spec)?)
}

/// [`meta`] of a located source.
pub(crate) fn meta_at(at: &Location) -> Result<BaseMeta, CheckpointError> {
    let (dir, run_dir) = match at {
        Location::HuggingFace(dir) => {
            let (model, info) = hf::read_config(dir)?;
            return Ok(BaseMeta {
                description: format!("Hugging Face {} model {}", info.model_type, dir.display()),
                model,
                hf: Some(info),
                tokenizer: hf_tokenizer(dir),
                hf_dir: Some(dir.clone()),
            });
        }
        Location::Checkpoint { step_dir, run_dir } => (step_dir, run_dir),
    };
    let cfg = checkpoint_config(dir)?;
    let kept = match run_dir {
        Some(run) => kept_hf(run)?,
        None => None,
    };
    let tokenizer = match (cfg.data.source.as_str(), &kept) {
        (_, Some((_, d))) if d.join("tokenizer.json").is_file() => hf_tokenizer(d),
        // (Files read with the "auto" tokenizer and no Hugging Face side: bytes.)
        ("files", _) if cfg.data.tokenizer == "auto" => Some("byte".into()),
        ("files", _) => Some(cfg.data.tokenizer.clone()),
        _ => None,
    };
    let mut model = cfg.model;
    if model.pos == PosEncoding::Learned {
        model.n_positions = model.n_positions.max(model.seq_len);
    }
    Ok(BaseMeta {
        model,
        hf: kept.as_ref().map(|(i, _)| i.clone()),
        hf_dir: kept.map(|(_, d)| d),
        tokenizer,
        description: format!("cockpit checkpoint {}", dir.display()),
    })
}

/// Load a base: its description and its weights (LoRA adapters of a cockpit base left out).
pub fn load(spec: &Path) -> Result<Base, CheckpointError> {
    let at = super::locate::locate(spec)?;
    let m = meta_at(&at)?;
    let dir = match at {
        Location::HuggingFace(dir) => {
            let (_, _, tensors) = hf::load(&dir)?;
            return Ok(Base { meta: m, tensors });
        }
        Location::Checkpoint { step_dir, .. } => step_dir,
    };
    let loaded = checkpoint::load_weights(&dir, &candle_core::Device::Cpu)?;
    let tensors = loaded
        .model
        .into_iter()
        .filter(|(k, _)| !k.contains(".lora_"))
        .collect();
    Ok(Base { meta: m, tensors })
}

/// A GGUF base's layer matrices in their own 4–6-bit blocks, which a 4-bit LoRA base keeps
/// ([`super::model::Model::quantize_base`]; the base's tensors hold them dequantized too):
/// none for any other source. Read only for such a base (they take the file's size in memory).
pub fn kept_blocks(spec: &Path) -> Result<HashMap<String, GgmlBlocks>, CheckpointError> {
    match super::locate::locate(spec)? {
        Location::HuggingFace(dir) => super::gguf::load::kept_blocks(&dir),
        Location::Checkpoint { .. } => Ok(HashMap::new()),
    }
}

/// Which key names the base of a run, and its path.
pub fn spec(cfg: &Config) -> Option<(&'static str, &str)> {
    if cfg.lora.enabled && !cfg.lora.base.is_empty() && cfg.lora.base != crate::config::RANDOM_BASE
    {
        Some(("lora.base", cfg.lora.base.as_str()))
    } else if !cfg.model.init_from.is_empty() {
        Some(("model.init_from", cfg.model.init_from.as_str()))
    } else {
        None
    }
}

/// The run's model: the base's, with the run's seq_len, dropout and init settings. A `[model]`
/// key the run sets (to other than its default) that differs from the base's is an error.
pub fn resolve_model(base: &BaseMeta, run: &ModelConfig, key: &str) -> Result<ModelConfig, String> {
    let b = &base.model;
    let default = ModelConfig::default();
    let as_map = |m: &ModelConfig| match serde_json::to_value(m) {
        Ok(serde_json::Value::Object(o)) => o,
        _ => serde_json::Map::new(),
    };
    let (bm, rm, dm) = (as_map(b), as_map(run), as_map(&default));
    let free = [
        "seq_len",
        "dropout",
        "init_std",
        "init_from",
        "n_positions",
        "recompute",
    ];
    for (k, rv) in &rm {
        if free.contains(&k.as_str()) || dm.get(k) == Some(rv) {
            continue;
        }
        let bv = bm.get(k).cloned().unwrap_or(serde_json::Value::Null);
        let same = match (k.as_str(), rv.as_u64(), bv.as_u64()) {
            // 0 means "n_embd / n_head" and "n_head": compare what they resolve to.
            ("head_dim", Some(r), _) => r as usize == b.head_size(),
            ("n_kv_head", Some(r), _) => r as usize == b.kv_heads(),
            ("mlp_ratio", ..) => {
                let width = crate::engine::spec::mlp_width;
                width(b.n_embd, rv.as_f64().unwrap_or(0.0)) == width(b.n_embd, b.mlp_ratio)
            }
            _ => *rv == bv,
        };
        if !same {
            return Err(format!(
                "model.{k} = {rv} contradicts the base's {bv} ({key} = {:?}); remove the key (the base fixes the model's shape)",
                base_name(base)
            ));
        }
    }
    if run.seq_len > b.seq_len.max(b.n_positions) {
        return Err(format!(
            "model.seq_len = {} is longer than the base supports ({}, {key} = {:?})",
            run.seq_len,
            b.seq_len.max(b.n_positions),
            base_name(base)
        ));
    }
    if let Some(w) = base.hf.as_ref().and_then(|h| h.sliding_window) {
        if run.seq_len > w {
            return Err(format!(
                "model.seq_len = {} exceeds the base's sliding_window = {w}: cockpit has no sliding-window attention; use model.seq_len ≤ {w}",
                run.seq_len
            ));
        }
    }
    let mut m = b.clone();
    if m.pos == PosEncoding::Learned {
        m.n_positions = b.n_positions.max(b.seq_len);
    }
    m.seq_len = run.seq_len;
    m.dropout = run.dropout;
    m.init_std = run.init_std;
    m.init_from = run.init_from.clone();
    m.recompute = run.recompute;
    Ok(m)
}

fn base_name(base: &BaseMeta) -> String {
    base.description
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Resolve `data.tokenizer` ("auto": the base's when it has one, else byte; "base": the base's,
/// an error when it has none) and the BOS/EOS ids to pack documents with.
pub fn resolve_data(cfg: &mut Config, base: Option<&BaseMeta>) -> Result<Special, EngineError> {
    let key = spec(cfg).map(|(k, _)| k).unwrap_or("model.init_from");
    let tok = cfg.data.tokenizer.clone();
    let from_base = base.and_then(|b| b.tokenizer.clone());
    cfg.data.tokenizer = match (tok.as_str(), base) {
        ("auto", _) => from_base.clone().unwrap_or_else(|| "byte".into()),
        ("base", None) => {
            return Err(EngineError::Config(format!(
                "data.tokenizer = \"base\": no base model is set (set {key} or lora.base)"
            )))
        }
        ("base", Some(b)) => from_base.clone().ok_or_else(|| {
            EngineError::Config(format!(
                "data.tokenizer = \"base\": {} has no tokenizer.json",
                b.description
            ))
        })?,
        _ => tok.clone(),
    };
    let uses_base_tokenizer =
        from_base.is_some() && from_base.as_deref() == Some(&cfg.data.tokenizer);
    let special = match base.and_then(|b| b.hf.as_ref()) {
        Some(h) if uses_base_tokenizer && cfg.data.source == "files" => {
            let eos = h.eos.first().copied();
            Special {
                // GPT-2 style: one <|endoftext|> between documents, not two.
                bos: h.bos.filter(|b| Some(*b) != eos),
                eos,
            }
        }
        _ => Special::default(),
    };
    if let Some(b) = base {
        let vocab = b.model.vocab_size;
        for (what, id) in [("BOS", special.bos), ("EOS", special.eos)] {
            if let Some(id) = id {
                if id as usize >= vocab {
                    return Err(EngineError::Config(format!(
                        "{}: {what} id {id} is outside the model's vocabulary ({vocab})",
                        b.description
                    )));
                }
            }
        }
    }
    Ok(special)
}

/// Copy a Hugging Face base's config, generation config and tokenizer files into
/// `run_dir/hf_base/` (export and generate read them from there).
pub fn keep_hf_files(base: &BaseMeta, run_dir: &Path) -> Result<(), EngineError> {
    let Some(src) = &base.hf_dir else {
        return Ok(());
    };
    let dest = run_dir.join(HF_BASE_DIR);
    if src == &dest {
        return Ok(());
    }
    std::fs::create_dir_all(&dest).map_err(|e| EngineError::Io {
        path: dest.display().to_string(),
        source: e,
    })?;
    let names = ["config.json", "generation_config.json"]
        .into_iter()
        .chain(hf::TOKENIZER_FILES.iter().copied());
    for name in names {
        let from = src.join(name);
        if from.is_file() {
            let to = dest.join(name);
            std::fs::copy(&from, &to).map_err(|e| EngineError::Io {
                path: to.display().to_string(),
                source: e,
            })?;
        }
    }
    Ok(())
}

/// Set a model's weights from its base: every parameter (but adapters) present with its
/// shape, and no tensor of the base left unused.
pub fn load_into(model: &super::model::Model, base: &Base, key: &str) -> Result<(), EngineError> {
    let mismatch = |message: String| {
        EngineError::Checkpoint(CheckpointError::Mismatch {
            path: format!("{key} = {:?}", base_name(&base.meta)),
            message,
        })
    };
    let names: std::collections::HashSet<&str> =
        model.params.iter().map(|p| p.name.as_str()).collect();
    let mut extra: Vec<&String> = base
        .tensors
        .keys()
        .filter(|k| !names.contains(k.as_str()))
        .collect();
    extra.sort();
    if let Some(name) = extra.first() {
        return Err(mismatch(format!(
            "{name}: a tensor the model would not use ({} such); refusing to drop it",
            extra.len()
        )));
    }
    model.load_named(&base.tensors, true).map_err(mismatch)
}

/// A model of `m` (seq_len as given) holding the base's weights, frozen or not as trained,
/// stored in `dtype` (the model is used, not trained: no fp32 masters) and never drawn at
/// random first.
pub fn build(
    base: &Base,
    m: &ModelConfig,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    key: &str,
) -> Result<super::model::Model, EngineError> {
    let cfg = Config {
        model: m.clone(),
        ..Config::default()
    };
    let spec = super::model::ModelSpec::from_config(&cfg, m.vocab_size);
    let store = super::model::BaseStore {
        dtype,
        init: super::model::BaseInit::Loaded,
    };
    let model = super::model::Model::new_with(spec, dtype, device, 0, store)?;
    load_into(&model, base, key)?;
    Ok(model)
}
