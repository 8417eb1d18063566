//! Weights on disk: safetensors files (one, or shards through
//! `model.safetensors.index.json`; f32, bf16 or f16) read and written.

use super::corrupt;
use crate::engine::checkpoint::CheckpointError;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

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
pub(super) fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>, CheckpointError> {
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

/// A tied model's file may carry its head anyway; it must then equal the embedding.
pub(super) fn drop_tied_head(
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
pub(super) fn drop_rotary_buffers(tensors: &mut HashMap<String, Tensor>) {
    tensors.retain(|k, _| !k.ends_with(".rotary_emb.inv_freq"));
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
