//! `cockpit export` and `cockpit generate`: a trained model (a run, a checkpoint, or a Hugging
//! Face directory, opened by [`super::source`]) written as a Hugging Face directory, or
//! continuing a prompt.

use super::data::Tok;
use super::generate::{self, Sampling};
use super::hf;
use super::source::{open, Source};
use super::EngineError;
use crate::util::DeviceSpec;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

/// How to export.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// LoRA runs: the PEFT adapter alone instead of merged weights.
    pub adapter: bool,
    /// The weights' dtype (default: the base's, else f32).
    pub dtype: Option<DType>,
    /// Shard the weights above this many bytes.
    pub max_shard_bytes: u64,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    pub model_type: String,
    pub files: Vec<String>,
    pub notes: Vec<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Write `src` as a Hugging Face directory at `out` (which must not exist, or be empty).
pub fn export(src: &Path, out: &Path, o: &ExportOptions) -> Result<Exported, EngineError> {
    if out.exists() && std::fs::read_dir(out).map_err(io(out))?.next().is_some() {
        return Err(usage(format!(
            "{}: exists and is not empty; export writes a new directory",
            out.display()
        )));
    }
    let s = open(src, DType::F32, &Device::Cpu, 1)?;
    let lora = s.run.as_ref().map(|c| c.lora.clone()).filter(|l| l.enabled);
    let model_type = hf::model_type_for(&s.config, s.hf.as_ref().map(|h| h.model_type.as_str()))
        .map_err(|m| usage(format!("{}: {m}", src.display())))?;
    // Adapters stay f32 unless asked (PEFT's default); merged weights take the base's dtype.
    let dtype = match (o.dtype, o.adapter) {
        (Some(d), _) => d,
        (None, true) => DType::F32,
        (None, false) => s.hf.as_ref().and_then(|h| h.dtype).unwrap_or(DType::F32),
    };
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let result = write_export(&s, &tmp, o, lora.as_ref(), &model_type, dtype);
    let notes = match result {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        std::fs::remove_dir(out).map_err(io(out))?;
    }
    std::fs::rename(&tmp, out).map_err(io(out))?;
    let mut files: Vec<String> = std::fs::read_dir(out)
        .map_err(io(out))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    files.sort();
    Ok(Exported {
        model_type,
        files,
        notes,
    })
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), EngineError> {
    let text = serde_json::to_vec_pretty(v).unwrap_or_default();
    std::fs::write(path, text).map_err(io(path))
}

fn write_export(
    s: &Source,
    dir: &Path,
    o: &ExportOptions,
    lora: Option<&crate::config::LoraConfig>,
    model_type: &str,
    dtype: DType,
) -> Result<Vec<String>, EngineError> {
    let tensor_err = |e: candle_core::Error| EngineError::Candle(e);
    let mut notes = Vec::new();
    if o.adapter {
        let Some(l) = lora else {
            return Err(usage(
                "--adapter: not a LoRA run (lora.enabled = false); export the whole model without it".into(),
            ));
        };
        let fused = ["q", "k", "v", "gate", "up"];
        if model_type == "phi3" && l.targets.iter().any(|t| fused.contains(&t.as_str())) {
            return Err(usage(format!(
                "--adapter: a phi3 model's q, k and v are one fused qkv_proj layer and gate and up one gate_up_proj in transformers, so cockpit's adapters on {:?} have no PEFT names; export merged weights (without --adapter), or train adapters on o and down only",
                l.targets
            )));
        }
        if model_type == "gpt2" {
            return Err(usage(
                "--adapter: a gpt2 model's q, k and v are one fused c_attn layer in transformers, so cockpit's per-projection adapters have no PEFT names; export merged weights (without --adapter)".into(),
            ));
        }
        let tensors: Vec<(String, Tensor)> = s
            .model
            .adapter_tensors()
            .into_iter()
            .map(|(n, t)| t.to_dtype(dtype).map(|t| (n, t)))
            .collect::<candle_core::Result<_>>()
            .map_err(tensor_err)?;
        let p = dir.join("adapter_model.safetensors");
        let written = hf::write_weights(dir, &tensors, u64::MAX)?;
        if let Some(w) = written.first() {
            std::fs::rename(w, &p).map_err(io(&p))?;
        }
        super::lora::save_adapter_config(dir, l, s.config.hybrid.is_some())?;
        return Ok(notes);
    }
    let merged = s.model.merged_tensors().map_err(tensor_err)?;
    let named = hf::to_hf_names(merged, model_type, s.config.n_layer).map_err(tensor_err)?;
    let named: Vec<(String, Tensor)> = named
        .into_iter()
        .map(|(n, t)| t.to_dtype(dtype).map(|t| (n, t)))
        .collect::<candle_core::Result<_>>()
        .map_err(tensor_err)?;
    hf::write_weights(dir, &named, o.max_shard_bytes)?;
    let vocab = s.model.spec.vocab_size;
    let mut config = s.config.clone();
    config.seq_len = s.max_positions;
    write_json(
        &dir.join("config.json"),
        &hf::config_json(&config, model_type, vocab, s.hf.as_ref(), dtype),
    )?;
    let gen = match &s.hf_dir {
        Some(d) if d.join("generation_config.json").is_file() => {
            let p = d.join("generation_config.json");
            let text = std::fs::read_to_string(&p).map_err(io(&p))?;
            serde_json::from_str(&text).unwrap_or_else(|_| hf::generation_config(s.hf.as_ref()))
        }
        _ => hf::generation_config(s.hf.as_ref()),
    };
    write_json(&dir.join("generation_config.json"), &gen)?;
    // Tokenizer files: the Hugging Face base's, or the tokenizer.json the run trained with.
    let mut copied = 0;
    if let Some(d) = &s.hf_dir {
        for f in hf::TOKENIZER_FILES {
            let from = d.join(f);
            if from.is_file() {
                std::fs::copy(&from, dir.join(f)).map_err(io(&from))?;
                copied += 1;
            }
        }
    }
    if copied == 0 {
        match s.tokenizer.as_deref() {
            Some(t) if t != "byte" && Path::new(t).is_file() => {
                std::fs::copy(t, dir.join("tokenizer.json")).map_err(io(Path::new(t)))?;
            }
            Some(t) => notes.push(format!(
                "no tokenizer files written: the run's tokenizer is {t:?}, which has no tokenizer.json"
            )),
            None => notes.push(
                "no tokenizer files written: the run trained on the built-in corpus (token ids only)"
                    .into(),
            ),
        }
    }
    Ok(notes)
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub prompt: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub device: DeviceSpec,
    /// Keep going past an end-of-sequence token.
    pub ignore_eos: bool,
    /// Render the prompt as a user turn through the chat template beside the tokenizer.
    pub chat: bool,
}

/// What generation produced.
#[derive(Clone, Debug)]
pub struct Generated {
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
    pub text: Option<String>,
    pub tokens_per_sec: f64,
}

/// Continue a prompt with a model from `src`; `on_text` gets the text as it grows (or the ids,
/// space-separated, when there is no tokenizer).
pub fn run_generate(
    src: &Path,
    o: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generated, EngineError> {
    let device = super::device::open(o.device)?;
    let dtype = if device.is_cuda() {
        super::precision::choose(
            crate::config::DType::Auto,
            super::device::compute_capability(&device),
        )
        .map(|(d, _)| d)
        .unwrap_or(DType::F32)
    } else {
        DType::F32
    };
    let s = open(src, dtype, &device, 64)?;
    let tok = match s.tokenizer.as_deref() {
        Some(t) => Some(Tok::open(t)?),
        None => None,
    };
    // --chat: the template's end-of-turn token stops generation too.
    let mut chat_stop = None;
    let prompt_ids = match (&o.prompt, &tok) {
        (Some(_), _) if !o.prompt_ids.is_empty() => {
            return Err(usage("give --prompt or --prompt-ids, not both".into()))
        }
        (None, _) => o.prompt_ids.clone(),
        (Some(p), Some(t)) if o.chat => {
            let tmpl = super::generate::template::template_of(&s, src)
                .map_err(|e| usage(format!("--chat: {e}")))?;
            let text = tmpl
                .render(&[serde_json::json!({"role": "user", "content": p})], true)
                .map_err(|e| usage(format!("--chat: the chat template fails to render: {e}")))?;
            chat_stop = tmpl.eos_id(t);
            t.encode_offsets(&text, "--chat")?.0
        }
        (Some(p), Some(t)) => t.encode_prompt(p)?,
        (Some(_), None) => {
            return Err(usage(format!(
                "{}: no tokenizer (the built-in corpus); give --prompt-ids",
                src.display()
            )))
        }
    };
    let mut prompt_ids = prompt_ids;
    if prompt_ids.is_empty() {
        match s.hf.as_ref().and_then(|h| h.bos) {
            Some(b) => prompt_ids.push(b),
            None => {
                return Err(usage(
                    "the prompt is empty (and the model has no BOS token to start from)".into(),
                ))
            }
        }
    }
    let vocab = s.model.spec.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(usage(format!(
            "prompt token {bad} is outside the model's vocabulary ({vocab})"
        )));
    }
    let total = prompt_ids.len() + o.max_tokens;
    if total > s.max_positions {
        return Err(usage(format!(
            "{} prompt + {} new tokens exceed the model's {} positions; lower --max-tokens",
            prompt_ids.len(),
            o.max_tokens,
            s.max_positions
        )));
    }
    if let Some(w) = s.hf.as_ref().and_then(|h| h.sliding_window) {
        if total > w {
            return Err(usage(format!(
                "{total} tokens exceed the model's sliding_window = {w}, which cockpit does not compute; lower --max-tokens"
            )));
        }
    }
    let mut stop: Vec<u32> = match (&s.hf, o.ignore_eos) {
        (Some(h), false) => h.eos.clone(),
        _ => Vec::new(),
    };
    if !o.ignore_eos {
        stop.extend(chat_stop.filter(|e| !stop.contains(e)));
    }
    let start = std::time::Instant::now();
    let mut ids: Vec<u32> = Vec::new();
    let mut shown = String::new();
    let out = generate::generate(
        &s.model,
        &prompt_ids,
        o.max_tokens,
        &o.sampling,
        &stop,
        |t| {
            ids.push(t);
            match &tok {
                Some(tk) => {
                    let text = tk.decode(&ids);
                    // Print what is new; a token that completes a character shows up with it.
                    if let Some(new) = text.strip_prefix(shown.as_str()) {
                        if !new.is_empty() && !new.ends_with('\u{FFFD}') {
                            on_text(new);
                            shown = text;
                        }
                    }
                }
                None => on_text(&format!("{t} ")),
            }
        },
    )?;
    let secs = start.elapsed().as_secs_f64();
    let text = tok.as_ref().map(|t| t.decode(&out));
    if let (Some(full), Some(_)) = (&text, &tok) {
        if let Some(rest) = full.strip_prefix(shown.as_str()) {
            if !rest.is_empty() {
                on_text(rest);
            }
        }
    }
    Ok(Generated {
        prompt_ids,
        tokens_per_sec: out.len() as f64 / secs.max(1e-9),
        ids: out,
        text,
    })
}
