//! GGUF in: a .gguf file as a model source. The file is turned once into the Hugging Face
//! directory it describes (config.json from its `<arch>.*` metadata, checked by the same
//! reader as any config.json; its tensors dequantized under Hugging Face's names, q/k rows
//! permuted back, fused ones split, Gemma 3's `1 + w` norms shifted back; tokenizer.json from its byte-level BPE or sentencepiece vocabulary,
//! [`super::tokenizer_in`]), kept in a cache directory
//! keyed by the file, so every command that opens a Hugging Face directory opens it.

use super::names;
use super::reader::{Gguf, Meta, TensorInfo};
use crate::config::ModelConfig;
use crate::engine::checkpoint::CheckpointError;
use crate::engine::hf;
use crate::engine::kernels::ggml::{format, GgmlBlocks};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn corrupt(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Whether `path` is a GGUF file (its magic).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// The Hugging Face model_type of a GGUF architecture.
fn model_type(arch: &str) -> Option<&'static str> {
    match arch {
        "llama" => Some("llama"),
        "qwen2" => Some("qwen2"),
        "qwen3" => Some("qwen3"),
        "olmo2" => Some("olmo2"),
        "gpt2" => Some("gpt2"),
        "granite" => Some("granite"),
        "phi3" => Some("phi3"),
        "gemma3" => Some("gemma3_text"),
        "gemma2" => Some("gemma2"),
        "granitehybrid" => Some("granitemoehybrid"),
        _ => None,
    }
}

/// Changes when what a cache directory holds does (a directory written before is remade).
const CACHE_FORMAT: u32 = 4;

/// The file in a cache directory that names the GGUF file it was made from (canonical path).
const SOURCE: &str = ".source";

/// The cache directory of `path` (its canonical path, size and modification time).
fn cache_dir(path: &Path) -> Result<PathBuf, CheckpointError> {
    use sha2::{Digest, Sha256};
    let md = std::fs::metadata(path).map_err(|e| corrupt(path, e.to_string()))?;
    let canon = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mtime = md
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let key = format!(
        "{}\n{}\n{mtime}\n{}\n{CACHE_FORMAT}",
        canon.display(),
        md.len(),
        env!("CARGO_PKG_VERSION")
    );
    let hash: String = Sha256::digest(key.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    Ok(std::env::temp_dir()
        .join("cockpit-gguf")
        .join(format!("{stem}-{hash}")))
}

/// Removes the cache directories (beside `keep`) whose GGUF file is gone or was rewritten
/// since (a directory of an older cache format, which names none, too): the cache holds a
/// model's whole weights, so what no file can ask for again is not left behind. Scratch
/// directories (a materialize in progress) are left alone.
fn prune_cache(parent: &Path, keep: &Path, source: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let hidden = p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if p == keep || hidden || !p.is_dir() {
            continue;
        }
        let stale = match std::fs::read_to_string(p.join(SOURCE)) {
            // (the same file, since rewritten: its current cache is `keep`)
            Ok(src) => !Path::new(&src).is_file() || Path::new(&src) == source,
            Err(_) => true,
        };
        if stale {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
}

/// The Hugging Face directory of the GGUF file at `path`, written on first use (under the
/// system's temporary directory, `cockpit-gguf/`; caches of files that are gone or changed
/// are removed when a new one is written).
pub fn materialize(path: &Path) -> Result<PathBuf, CheckpointError> {
    let dir = cache_dir(path)?;
    if dir.join(".complete").is_file() {
        return Ok(dir);
    }
    let bytes = std::fs::read(path).map_err(|e| corrupt(path, e.to_string()))?;
    let g = Gguf::parse(bytes).map_err(|m| corrupt(path, m))?;
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| corrupt(parent, e.to_string()))?;
    let canon = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    prune_cache(parent, &dir, &canon);
    // (One scratch directory per call: two threads of one process may materialize the same
    // file at once; the first rename wins.)
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(
        ".{}.tmp-{}-{call}",
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| corrupt(&tmp, e.to_string()))?;
    if let Err(m) = write_hf(&g, &tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(corrupt(path, m));
    }
    std::fs::write(tmp.join(SOURCE), canon.to_string_lossy().as_bytes())
        .map_err(|e| corrupt(&tmp, e.to_string()))?;
    std::fs::write(tmp.join(".complete"), b"").map_err(|e| corrupt(&tmp, e.to_string()))?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // another process or thread made it first
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(dir)
}

/// The Hugging Face `rope_scaling` (rope type llama3) whose frequencies are the plain ones
/// (θ, `rd` rotated dims) divided by `factors`, as llama.cpp's `rope_freqs`: Some(None) when
/// every factor is 1 (no scaling), None when no parameters in the searched range give them (to
/// 1e-5: the factors are stored as f32). The factor is the largest one; the low/high frequency
/// factors and the original context are searched (Llama 3.1–3.3: 1, 4, 8192).
fn llama3_scaling(factors: &[f32], theta: f64, rd: usize) -> Option<Option<Value>> {
    if factors.len() * 2 != rd || factors.is_empty() {
        return None;
    }
    let big = factors.iter().fold(0f32, |a, &b| a.max(b)) as f64;
    if factors.iter().all(|&x| (x as f64 - 1.0).abs() < 1e-6) {
        return Some(None);
    }
    let inv: Vec<f64> = (0..rd / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / rd as f64))
        .collect();
    // Hugging Face's llama3 rule: a frequency whose wavelength exceeds old/low is divided by
    // the factor, one below old/high kept, those between blended.
    let ratios = |factor: f64, low: f64, high: f64, old: f64| -> Vec<f64> {
        inv.iter()
            .map(|&fr| {
                let wavelen = 2.0 * std::f64::consts::PI / fr;
                let scaled = if wavelen > old / low {
                    fr / factor
                } else if wavelen < old / high {
                    fr
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * fr / factor + smooth * fr
                };
                fr / scaled
            })
            .collect()
    };
    for old in (4..=20).map(|p| (1u64 << p) as f64) {
        for (low, high) in [(1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (2.0, 8.0)] {
            let r = ratios(big, low, high, old);
            let fits = r
                .iter()
                .zip(factors)
                .all(|(a, &b)| (a - b as f64).abs() <= 1e-5 * a.abs().max(1.0));
            if fits {
                return Some(Some(json!({
                    "rope_type": "llama3",
                    "factor": big,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": old as u64,
                })));
            }
        }
    }
    None
}

fn need<'a>(g: &'a Gguf, key: &str) -> Result<&'a Meta, String> {
    g.get(key).ok_or_else(|| format!("{key}: missing"))
}

fn num(g: &Gguf, key: &str) -> Result<usize, String> {
    need(g, key)?
        .as_usize()
        .ok_or_else(|| format!("{key}: expected a non-negative integer"))
}

fn write_json(p: &Path, v: &Value) -> Result<(), String> {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", p.display()))
}

fn write_hf(g: &Gguf, dir: &Path) -> Result<(), String> {
    let arch = need(g, "general.architecture")?
        .as_str()
        .ok_or("general.architecture: expected a string")?
        .to_string();
    let Some(mt) = model_type(&arch) else {
        return Err(format!(
            "general.architecture = {arch:?}: not supported (supported: llama, qwen2, qwen3, olmo2, gpt2, granite, phi3, gemma3, gemma2, granitehybrid)"
        ));
    };
    let k = |s: &str| format!("{arch}.{s}");
    let has = |n: &str| g.tensors.iter().any(|t| t.name == n);
    let embd = g
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .ok_or("token_embd.weight: missing")?;
    let vocab = embd.shape[0];
    let n_embd = num(g, &k("embedding_length"))?;
    let n_layer = num(g, &k("block_count"))?;
    let n_head = num(g, &k("attention.head_count"))?;
    let ff = num(g, &k("feed_forward_length"))?;
    let ctx = num(g, &k("context_length"))?;
    let f = |key: &str, d: f64| g.get(&k(key)).and_then(Meta::as_f64).unwrap_or(d);
    let tied = !has("output.weight");
    let mut c: Map<String, Value> = Map::new();
    c.insert("model_type".into(), json!(mt));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(tied));
    if mt == "gpt2" {
        for (key, v) in [
            ("n_embd", json!(n_embd)),
            ("n_layer", json!(n_layer)),
            ("n_head", json!(n_head)),
            ("n_positions", json!(ctx)),
            ("n_inner", json!(ff)),
            (
                "layer_norm_epsilon",
                json!(f("attention.layer_norm_epsilon", 1e-5)),
            ),
        ] {
            c.insert(key.into(), v);
        }
    } else {
        let kv = g
            .get(&k("attention.head_count_kv"))
            .and_then(Meta::as_usize)
            .unwrap_or(n_head);
        // (the head dim: `attention.key_length`, else n_embd / heads, as llama.cpp reads it;
        // `rope.dimension_count` is the rotated dims, which cockpit reads only as the whole head)
        let hd = g
            .get(&k("attention.key_length"))
            .and_then(Meta::as_usize)
            .unwrap_or(n_embd / n_head.max(1));
        if let Some(rd) = g.get(&k("rope.dimension_count")).and_then(Meta::as_usize) {
            // (Phi-3 rotates part of each head: its partial_rotary_factor)
            if rd != hd && mt != "phi3" {
                return Err(format!(
                    "{arch}.rope.dimension_count = {rd}: RoPE on part of a head of {hd} dims is not supported in GGUF input"
                ));
            }
        }
        for (key, v) in [
            ("hidden_size", json!(n_embd)),
            ("intermediate_size", json!(ff)),
            ("num_hidden_layers", json!(n_layer)),
            ("num_attention_heads", json!(n_head)),
            ("num_key_value_heads", json!(kv)),
            ("head_dim", json!(hd)),
            ("max_position_embeddings", json!(ctx)),
            (
                "rms_norm_eps",
                json!(f("attention.layer_norm_rms_epsilon", 1e-6)),
            ),
            ("rope_theta", json!(f("rope.freq_base", 10000.0))),
        ] {
            c.insert(key.into(), v);
        }
        // Llama 3's RoPE scaling, which llama.cpp's converter writes as per-frequency factors:
        // the Hugging Face parameters that give those factors.
        if let Some(t) = g.tensors.iter().find(|t| t.name == "rope_freqs.weight") {
            let factors = g.decode(t).map_err(|e| format!("rope_freqs.weight: {e}"))?;
            let theta = f("rope.freq_base", 10000.0);
            let rd = g
                .get(&k("rope.dimension_count"))
                .and_then(Meta::as_usize)
                .unwrap_or(hd);
            match llama3_scaling(&factors, theta, rd) {
                Some(Some(v)) => {
                    c.insert("rope_scaling".into(), v);
                }
                Some(None) => {}
                None => {
                    return Err(format!(
                        "rope_freqs.weight: {} factors that no Llama 3 RoPE scaling (factor, low/high frequency factors, original context) gives",
                        factors.len()
                    ))
                }
            }
        }
        match g.get(&k("rope.scaling.type")).and_then(Meta::as_str) {
            None | Some("none") => {}
            Some("linear") => {
                c.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": f("rope.scaling.factor", 1.0)}),
                );
            }
            Some(other) => {
                return Err(format!(
                    "{}.rope.scaling.type = {other:?}: not supported (supported: linear)",
                    arch
                ))
            }
        }
        if mt == "llama" || mt == "granite" {
            let b = has("blk.0.attn_q.bias");
            c.insert("attention_bias".into(), json!(b));
            c.insert("mlp_bias".into(), json!(b));
        }
        match mt {
            "phi3" => super::phi3::config(g, &mut c, hd, ctx)?,
            "gemma3_text" | "gemma2" => super::gemma3::config(&arch, g, &mut c, n_layer)?,
            "granitemoehybrid" => super::granite_hybrid::config(g, &mut c, n_layer)?,
            _ => {}
        }
        if mt == "granite" || mt == "granitemoehybrid" {
            for (key, gk) in [
                ("attention_multiplier", "attention.scale"),
                ("embedding_multiplier", "embedding_scale"),
                ("residual_multiplier", "residual_scale"),
                ("logits_scaling", "logit_scale"),
            ] {
                c.insert(key.into(), json!(f(gk, 1.0)));
            }
        }
    }
    let tok = |key: &str| {
        g.get(&format!("tokenizer.ggml.{key}"))
            .and_then(Meta::as_usize)
    };
    c.insert("bos_token_id".into(), json!(tok("bos_token_id")));
    c.insert("eos_token_id".into(), json!(tok("eos_token_id")));
    let config = Value::Object(c);
    let (m, info) =
        hf::parse_config(&config).map_err(|e| format!("its metadata as config.json: {e}"))?;
    write_json(&dir.join("config.json"), &config)?;
    write_json(
        &dir.join("generation_config.json"),
        &hf::generation_config(Some(&info)),
    )?;
    // the tensors, dequantized, under cockpit's names, then Hugging Face's
    let dense = |_: usize, t: &TensorInfo| {
        let x = g.decode(t)?;
        Tensor::from_vec(x, t.shape.clone(), &Device::Cpu).map_err(|e| format!("{}: {e}", t.name))
    };
    let named = cockpit_tensors(g, &m, mt, &arch, ff, &dense)?;
    // (GPT-2's matrices are stored transposed: none is kept as blocks)
    if mt != "gpt2" {
        let rows = cockpit_tensors(g, &m, mt, &arch, ff, &row_ids)?;
        write_kept(g, &named, rows, &dir.join(KEPT_BLOCKS))?;
    }
    let named = hf::to_hf_names(named, mt, m.n_layer).map_err(|e| e.to_string())?;
    let named: Vec<(String, Tensor)> = named
        .into_iter()
        .map(|(n, t)| t.to_dtype(DType::F32).map(|t| (n, t)))
        .collect::<candle_core::Result<_>>()
        .map_err(|e| e.to_string())?;
    hf::write_weights(dir, &named, u64::MAX).map_err(|e| e.to_string())?;
    super::tokenizer_in::write(g, dir)
}

/// The file's tensors under cockpit's names, each GGUF tensor (its index, its place) read by
/// `value`: q/k rows permuted back, fused matrices split, Gemma 3's norms shifted, the hybrid's
/// gate and up joined.
fn cockpit_tensors(
    g: &Gguf,
    m: &ModelConfig,
    mt: &str,
    arch: &str,
    ff: usize,
    value: &dyn Fn(usize, &TensorInfo) -> Result<Tensor, String>,
) -> Result<Vec<(String, Tensor)>, String> {
    let mut named: Vec<(String, Tensor)> = Vec::new();
    for (k, t) in g.tensors.iter().enumerate() {
        if t.name == "rope_freqs.weight" || super::phi3::is_config_tensor(&t.name) {
            continue; // (read into the config's rope_scaling above)
        }
        let te = |e: candle_core::Error| format!("{}: {e}", t.name);
        let v = value(k, t)?;
        if let Some(rest) = t
            .name
            .strip_suffix(".attn_qkv.weight")
            .or(t.name.strip_suffix(".attn_qkv.bias"))
        {
            let i = rest.strip_prefix("blk.").unwrap_or(rest);
            let w = t.name.rsplit('.').next().unwrap_or("weight");
            let (q, kv) = (m.n_head * m.head_size(), m.kv_heads() * m.head_size());
            if v.dim(0).map_err(te)? != q + 2 * kv {
                return Err(format!(
                    "{}: {} rows, the metadata makes q|k|v {}",
                    t.name,
                    t.shape[0],
                    q + 2 * kv
                ));
            }
            for (p, at, rows) in [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)] {
                let part = v
                    .narrow(0, at, rows)
                    .and_then(|p| p.contiguous())
                    .map_err(te)?;
                named.push((format!("model.layers.{i}.self_attn.{p}.{w}"), part));
            }
            continue;
        }
        if mt == "phi3" {
            if let Some(parts) = super::phi3::split_ffn_up(&t.name, &v, ff) {
                named.extend(parts?);
                continue;
            }
        }
        if mt == "granitemoehybrid" {
            if super::granite_hybrid::is_joined(&t.name) {
                named.push((t.name.clone(), v)); // (joined below)
                continue;
            }
            if let Some(one) = super::granite_hybrid::in_tensor(&t.name, &v) {
                named.push(one?);
                continue;
            }
        }
        let Some(c) = names::cockpit_name(&t.name, arch) else {
            return Err(format!(
                "{}: a tensor cockpit does not know for {arch}",
                t.name
            ));
        };
        let v = if names::permutes_qk(arch) && t.name.contains(".attn_q.") {
            names::unpermute_rows(&v, m.n_head).map_err(te)?
        } else if names::permutes_qk(arch) && t.name.contains(".attn_k.") {
            names::unpermute_rows(&v, m.kv_heads()).map_err(te)?
        } else {
            v
        };
        named.push((c, v));
    }
    match mt {
        "gemma3_text" | "gemma2" => named = super::gemma3::shift_norms(named, -1.0)?,
        "granitemoehybrid" => super::granite_hybrid::join_gate_up(&mut named, m.n_layer)?,
        _ => {}
    }
    Ok(named)
}

/// Where each row of a GGUF tensor goes: `[rows, 2]` of (tensor index, row), exact in f32 —
/// what [`cockpit_tensors`] does to these, it does to the rows of the values.
fn row_ids(k: usize, t: &TensorInfo) -> Result<Tensor, String> {
    let rows = t.shape.first().copied().unwrap_or(1);
    let ids: Vec<f32> = (0..rows).flat_map(|r| [k as f32, r as f32]).collect();
    Tensor::from_vec(ids, (rows, 2), &Device::Cpu).map_err(|e| format!("{}: {e}", t.name))
}

/// In a GGUF file's Hugging Face directory: the layers' matrices stored in 4–6-bit blocks
/// (`kernels::ggml::FORMATS`), as the file stores them, under cockpit's names (U8 `[out, row bytes]`; the
/// metadata gives each one's ggml type code). A 4-bit LoRA base keeps them
/// ([`kept_blocks`]) instead of quantizing their dequantized values again.
pub const KEPT_BLOCKS: &str = "gguf_blocks.safetensors";

/// Writes [`KEPT_BLOCKS`]: every layer matrix of `dense` whose rows (`rows`, from
/// [`row_ids`]) all come from tensors of one kept format whose rows are the matrix's.
fn write_kept(
    g: &Gguf,
    dense: &[(String, Tensor)],
    rows: Vec<(String, Tensor)>,
    path: &Path,
) -> Result<(), String> {
    let mut kept: Vec<(String, u32, usize, Vec<u8>)> = Vec::new();
    for (name, ids) in rows {
        if !name.starts_with("model.layers.") || !name.ends_with(".weight") {
            continue;
        }
        let Some((_, w)) = dense.iter().find(|(n, _)| *n == name) else {
            continue;
        };
        let (Ok((out, inp)), Ok(ids)) = (w.dims2(), ids.to_vec2::<f32>()) else {
            continue;
        };
        if ids.len() != out {
            continue;
        }
        // (None where a row comes from a tensor of another format or width)
        let gathered = ids
            .iter()
            .try_fold((None, Vec::new()), |(code, mut bytes), id| {
                let t = &g.tensors[id[0] as usize];
                let (c, _, block, size) = format(t.code)?;
                if t.shape.len() != 2 || t.shape[1] != inp || code.is_some_and(|x| x != c) {
                    return None;
                }
                let row = inp / block * size;
                let (_, raw) = g.raw(t).ok()?;
                let at = id[1] as usize * row;
                bytes.extend_from_slice(raw.get(at..at + row)?);
                Some((Some(c), bytes))
            });
        if let Some((Some(c), bytes)) = gathered {
            kept.push((name, c, bytes.len() / out, bytes));
        }
    }
    if kept.is_empty() {
        return Ok(());
    }
    let views = kept
        .iter()
        .map(|(n, _, row, b)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::U8,
                vec![b.len() / row, *row],
                b,
            )
            .map(|v| (n.clone(), v))
            .map_err(|e| format!("{n}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta: HashMap<String, String> = kept
        .iter()
        .map(|(n, c, _, _)| (n.clone(), c.to_string()))
        .collect();
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The matrices a GGUF file's Hugging Face directory keeps in their blocks ([`KEPT_BLOCKS`];
/// none where the file is absent: a directory not made from a GGUF file, or a GPT-2 one), on
/// the CPU.
pub fn kept_blocks(dir: &Path) -> Result<HashMap<String, GgmlBlocks>, CheckpointError> {
    let path = dir.join(KEPT_BLOCKS);
    if !path.is_file() {
        return Ok(HashMap::new());
    }
    let bytes = std::fs::read(&path).map_err(|e| corrupt(&path, e.to_string()))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| corrupt(&path, format!("not a readable safetensors file: {e}")))?;
    let codes = header.metadata().clone().unwrap_or_default();
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| corrupt(&path, format!("not a readable safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let code = codes.get(&name).and_then(|c| c.parse::<u32>().ok());
        let (Some((code, _, block, size)), [rows, row]) = (code.and_then(format), view.shape())
        else {
            return Err(corrupt(
                &path,
                format!("{name}: no kept format, or not [rows, bytes]"),
            ));
        };
        let b = GgmlBlocks::new(
            code,
            *rows,
            row / size * block,
            view.data().to_vec(),
            &Device::Cpu,
        )
        .map_err(|e| corrupt(&path, format!("{name}: {e}")))?;
        out.insert(name, b);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, RopeScaling};
    use crate::engine::spec::ModelSpec;

    /// llama.cpp's `rope_freqs` of a Llama 3.2-shaped spec (factor 32, 1/4, 8192, θ 5e5, head
    /// dim 64) come back as those parameters; all-ones factors as no scaling; others refused.
    #[test]
    fn rope_freqs_come_back_as_llama3_parameters() {
        let mut c = Config::default();
        c.model.n_embd = 256;
        c.model.n_head = 4;
        c.model.rope_theta = 500_000.0;
        c.model.rope_scaling = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let spec = ModelSpec::from_config(&c, 100);
        let f = super::super::names::rope_freqs(&spec).unwrap();
        let v = llama3_scaling(&f, 500_000.0, 64).unwrap().unwrap();
        assert_eq!(v["factor"], 32.0);
        assert_eq!(v["low_freq_factor"], 1.0);
        assert_eq!(v["high_freq_factor"], 4.0);
        assert_eq!(v["original_max_position_embeddings"], 8192);
        assert_eq!(llama3_scaling(&[1.0; 32], 500_000.0, 64), Some(None));
        let odd: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 * 0.37).collect();
        assert_eq!(llama3_scaling(&odd, 500_000.0, 64), None);
        assert_eq!(
            llama3_scaling(&f, 500_000.0, 48),
            None,
            "factors for 32 pairs, 24 given"
        );
    }
}
