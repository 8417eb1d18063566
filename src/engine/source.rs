//! One way to open a model source — a run dir, a checkpoint or a Hugging Face directory
//! ([`super::locate`] says which) — as a model with its spec, its weights and its tokenizer:
//! `cockpit generate`, `export` and `merge` take it from here.

use super::base;
use super::hf::{self, HfInfo};
use super::locate::{locate, Location};
use super::model::Model;
use super::EngineError;
use crate::config::{Config, ModelConfig};
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// A model ready to use, with what is known around it.
pub struct Source {
    /// The model: its spec (`model.spec`) and its weights.
    pub model: Model,
    /// Its model description (the base's context length where a Hugging Face base is known).
    pub config: ModelConfig,
    /// The run's config (None for a Hugging Face directory).
    pub run: Option<Config>,
    pub hf: Option<HfInfo>,
    /// Where the Hugging Face side's config and tokenizer files are.
    pub hf_dir: Option<PathBuf>,
    /// "byte", a tokenizer.json path, or None (token ids only: the built-in corpus).
    pub tokenizer: Option<String>,
    /// The longest context: max_position_embeddings / the learned table.
    pub max_positions: usize,
}

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

/// Open a run dir, checkpoint or Hugging Face directory as a model on `device` in `dtype`.
/// `seq_len` sizes the model's training tables (generation decodes past it with RoPE).
/// What the source is (its Hugging Face side, its tokenizer) is read once, by
/// [`base::meta_at`], as a training run's base is.
pub fn open(
    spec: &Path,
    dtype: DType,
    device: &Device,
    seq_len: usize,
) -> Result<Source, EngineError> {
    let at = locate(spec)?;
    let meta = base::meta_at(&at)?;
    let step_dir = match at {
        Location::Checkpoint { step_dir, .. } => step_dir,
        Location::HuggingFace(dir) => return open_hf(&dir, dtype, device, seq_len),
    };
    let (model, cfg) = super::lora::model_from_checkpoint_as(&step_dir, dtype, device)?;
    let mut config = cfg.model.clone();
    if let Some(d) = &meta.hf_dir {
        // The base's context length, not the run's training length.
        let (m, _) = hf::read_config(d)?;
        config.seq_len = config.seq_len.max(m.seq_len);
    }
    let max_positions = config.seq_len.max(config.n_positions);
    Ok(Source {
        model,
        config,
        hf: meta.hf,
        hf_dir: meta.hf_dir,
        run: Some(cfg),
        tokenizer: meta.tokenizer,
        max_positions,
    })
}

/// [`open`] for a Hugging Face directory: its weights in a model of `seq_len` positions.
fn open_hf(
    dir: &Path,
    dtype: DType,
    device: &Device,
    seq_len: usize,
) -> Result<Source, EngineError> {
    let b = base::load(dir)?;
    let max_positions = b.meta.model.seq_len.max(b.meta.model.n_positions);
    let run = ModelConfig {
        seq_len: seq_len.clamp(1, max_positions),
        ..ModelConfig::default()
    };
    let m = base::resolve_model(&b.meta, &run, "source").map_err(usage)?;
    let model = base::build(&b, &m, dtype, device, "source")?;
    let mut config = m;
    config.seq_len = max_positions;
    Ok(Source {
        model,
        config,
        run: None,
        hf: b.meta.hf,
        hf_dir: b.meta.hf_dir,
        tokenizer: b.meta.tokenizer,
        max_positions,
    })
}
