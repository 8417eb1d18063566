//! `cockpit export SOURCE OUT.gguf`: a run, checkpoint or Hugging Face directory (LoRA runs
//! merged) written as one GGUF file by [`super::gguf`]'s writer.

use super::export::Exported;
use super::gguf::quant::{self, GgmlType};
use super::gguf::writer::{self, TensorData, Value};
use super::gguf::{gemma3, granite_hybrid, names, phi3, tokenizer, Quant};
use super::source::{open, Source};
use super::{hf, EngineError};
use crate::config::RopeScaling;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

fn usage(message: String) -> EngineError {
    EngineError::Config(message)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// How a tensor is stored: vectors (norms, biases) stay f32, as llama.cpp keeps them; rows
/// that are no whole number of the type's blocks take Q8_0 in place of a k-quant where they
/// are whole 32-element blocks, else f16.
fn storage(name: &str, shape: &[usize], want: GgmlType) -> GgmlType {
    if shape.len() < 2 || granite_hybrid::keeps_f32(name) {
        return GgmlType::F32;
    }
    let row = shape[shape.len() - 1];
    if row.is_multiple_of(want.block().0) {
        want
    } else if want.block().0 == super::gguf::kquant::QK
        && row.is_multiple_of(GgmlType::Q8_0.block().0)
    {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

fn tensor_data(name: String, t: &Tensor, want: GgmlType) -> Result<TensorData, EngineError> {
    let shape = t.dims().to_vec();
    let ty = storage(&name, &shape, want);
    let x: Vec<f32> = t
        .to_dtype(DType::F32)?
        .contiguous()?
        .flatten_all()?
        .to_vec1()?;
    Ok(TensorData {
        name,
        shape,
        ty,
        bytes: quant::encode(&x, ty),
    })
}

/// Write `src` (a run, checkpoint or Hugging Face directory; LoRA runs merged) as one GGUF
/// file at `out` in `quant`.
pub fn export(src: &Path, out: &Path, quant: Quant) -> Result<Exported, EngineError> {
    if out.is_dir() {
        return Err(usage(format!(
            "{}: is a directory; GGUF export writes one file (e.g. model.gguf)",
            out.display()
        )));
    }
    let s = open(src, DType::F32, &Device::Cpu, 1)?;
    let at = |m: String| usage(format!("{}: {m}", src.display()));
    let model_type =
        hf::model_type_for(&s.config, s.hf.as_ref().map(|h| h.model_type.as_str())).map_err(at)?;
    let arch = names::arch_of(&model_type).ok_or_else(|| {
        at(format!(
            "model_type {model_type}: llama.cpp has no architecture for it"
        ))
    })?;
    if let Some(why) = granite_hybrid::refusal(&s.config) {
        return Err(at(why));
    }
    let (kv, tensors, notes) = build(&s, src, &model_type, arch, quant)?;
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.gguf".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if let Err(e) = writer::write(&tmp, &kv, &tensors) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(&tmp)(e));
    }
    std::fs::rename(&tmp, out).map_err(io(out))?;
    Ok(Exported {
        model_type: format!("{model_type} (GGUF architecture {arch})"),
        files: vec![name],
        notes,
    })
}

type Built = (Vec<(String, Value)>, Vec<TensorData>, Vec<String>);

fn build(
    s: &Source,
    src: &Path,
    model_type: &str,
    arch: &str,
    quant: Quant,
) -> Result<Built, EngineError> {
    let at = |m: String| usage(format!("{}: {m}", src.display()));
    let m = &s.config;
    let vocab = s.model.spec.vocab_size;
    let mut notes = Vec::new();
    let tok_kv = match s.tokenizer.as_deref() {
        Some(t) if t != "byte" && Path::new(t).is_file() => {
            tokenizer::keys(Path::new(t), s.hf_dir.as_deref(), s.hf.as_ref(), vocab).map_err(at)?
        }
        Some(t) => {
            return Err(at(format!(
                "the tokenizer is {t:?}, which has no tokenizer.json; GGUF files carry a vocabulary (llama.cpp has no byte-level tokenizer model), so a byte-tokenized run cannot be exported as GGUF"
            )))
        }
        None => {
            return Err(at(
                "the run trained on the built-in corpus (token ids only, no tokenizer); GGUF files carry a vocabulary".into(),
            ))
        }
    };
    let file_type = quant.file_type();
    let stem = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cockpit".into());
    let stem = match phi3::name_llama_cpp_trips_on(&stem, &tok_kv) {
        Some(missing) => {
            notes.push(format!(
                "general.name is \"model\", not {stem:?}: llama.cpp looks up {missing} in the vocabulary of a model whose name says phi-3, and this vocabulary has no such token"
            ));
            "model".to_string()
        }
        None => stem,
    };
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::Str(arch.into())),
        ("general.type".into(), Value::Str("model".into())),
        ("general.name".into(), Value::Str(stem)),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
        (
            "general.alignment".into(),
            Value::U32(writer::ALIGNMENT as u32),
        ),
    ];
    kv.extend(names::hyperparameters(
        arch,
        m,
        vocab,
        s.max_positions,
        s.hf.as_ref(),
    ));
    kv.extend(tok_kv);
    match arch {
        "gemma3" | "gemma2" => notes.extend(gemma3::notes(arch, m)),
        "granitehybrid" => notes.extend(granite_hybrid::notes(m)),
        "phi3" if matches!(m.rope_scaling, RopeScaling::LongRope { .. }) => notes.push(
            "LongRoPE: llama.cpp takes the long factors when its context (n_ctx) exceeds the original one, where transformers and cockpit take them by the sequence's length".into(),
        ),
        _ => {}
    }
    if let Some(w) =
        s.hf.as_ref()
            .and_then(|h| h.sliding_window)
            .filter(|_| arch != "phi3")
    {
        notes.push(format!(
            "the base's sliding_window = {w} is not in the GGUF (llama.cpp's llama architecture attends to the whole context)"
        ));
    }
    let merged = s.model.merged_tensors()?;
    let named = names::to_gguf(merged, arch, m).map_err(at)?;
    let mut tensors = Vec::with_capacity(named.len() + 1);
    let rope = names::rope_freqs(&s.model.spec).map(|f| ("rope_freqs.weight", f));
    for (name, f) in rope.into_iter().chain(phi3::rope_factors(m)) {
        tensors.push(TensorData {
            name: name.into(),
            shape: vec![f.len()],
            ty: GgmlType::F32,
            bytes: quant::encode(&f, GgmlType::F32),
        });
    }
    let mut fallback = Vec::new();
    let tied = !named.iter().any(|(n, _)| n == "output.weight");
    for (n, t) in named {
        let want = quant.type_for(&n, s.model.spec.n_layer, tied);
        let d = tensor_data(n, &t, want)?;
        if d.ty != want && d.shape.len() > 1 && !granite_hybrid::keeps_f32(&d.name) {
            fallback.push(format!("{} ({})", d.name, d.ty.name()));
        }
        tensors.push(d);
    }
    if !fallback.is_empty() {
        notes.push(format!(
            "{} tensor(s) stored in another type: their rows are not whole {} blocks ({})",
            fallback.len(),
            quant.name(),
            fallback.join(", ")
        ));
    }
    let _ = model_type;
    Ok((kv, tensors, notes))
}
