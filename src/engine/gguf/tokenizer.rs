//! A tokenizer.json as GGUF's `tokenizer.ggml.*` keys: a byte-level BPE as llama.cpp's "gpt2"
//! model (tokens, their types, the merges), a sentencepiece-style BPE (byte fallback, `▁` for
//! spaces: Llama 2, Mistral, TinyLlama) as its "llama" model (tokens, scores, types, and the
//! merges, which transformers' GGUF loader reads); the special ids and the chat template.

use super::writer::Value;
use crate::engine::hf::HfInfo;
use serde_json::Value as Json;
use std::path::Path;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const UNKNOWN: i32 = 2;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

fn read_json(p: &Path) -> Result<Json, String> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", p.display()))
}

/// Whether a pre-tokenizer or decoder (or any inside a Sequence) is byte-level.
fn byte_level(v: &Json) -> bool {
    match v.get("type").and_then(Json::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => ["pretokenizers", "decoders"].iter().any(|k| {
            v.get(k)
                .and_then(Json::as_array)
                .is_some_and(|a| a.iter().any(byte_level))
        }),
        _ => false,
    }
}

/// llama.cpp's name of the pre-tokenizer's split regex ("gpt-2" for ByteLevel's own).
fn pre_name(pre: &Json) -> &'static str {
    let text = pre.to_string();
    if text.contains(r"\\p{N}{1,3}") {
        "llama-bpe"
    } else if text.contains(r"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|") {
        "qwen2"
    } else if text.contains("\"use_regex\":true") && !text.contains("\"Split\"") {
        "gpt-2"
    } else {
        "default"
    }
}

/// The special token a tokenizer_config.json entry names (a string or an AddedToken object).
fn config_token(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// The `tokenizer.ggml.*` keys of `tokenizer_json` for a model of `vocab` embedding rows.
/// `hf_dir` holds tokenizer_config.json / chat_template.jinja where the base has them.
pub fn keys(
    tokenizer_json: &Path,
    hf_dir: Option<&Path>,
    info: Option<&HfInfo>,
    vocab: usize,
) -> Result<Vec<(String, Value)>, String> {
    let t = read_json(tokenizer_json)?;
    let at = tokenizer_json.display();
    let model = &t["model"];
    let kind = model.get("type").and_then(Json::as_str).unwrap_or("");
    let spm = kind == "BPE" && sentencepiece_style(&t);
    if kind != "BPE" || !(spm || byte_level(&t["pre_tokenizer"])) {
        return Err(format!(
            "{at}: a {kind:?} tokenizer that is neither byte-level nor sentencepiece-style BPE; GGUF export writes those (llama.cpp's \"gpt2\" and \"llama\" models) only"
        ));
    }
    let mut tokens: Vec<Option<String>> = vec![None; vocab];
    let mut types = vec![NORMAL; vocab];
    let mut place = |id: u64, s: &str, ty: i32| -> Result<(), String> {
        let id = id as usize;
        if id >= tokens.len() {
            return Err(format!(
                "{at}: token {s:?} has id {id}, outside the model's {vocab} embeddings"
            ));
        }
        tokens[id] = Some(s.to_string());
        types[id] = ty;
        Ok(())
    };
    let v = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| format!("{at}: model.vocab: missing"))?;
    for (s, id) in v {
        let id = id
            .as_u64()
            .ok_or_else(|| format!("{at}: model.vocab[{s:?}] = {id}: expected an id"))?;
        place(id, s, NORMAL)?;
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(s)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(format!("{at}: added_tokens: {a}: expected id and content"));
        };
        let special = a["special"].as_bool().unwrap_or(false);
        place(id, s, if special { CONTROL } else { USER_DEFINED })?;
    }
    let config = match hf_dir.map(|d| d.join("tokenizer_config.json")) {
        Some(p) if p.is_file() => read_json(&p)?,
        _ => Json::Null,
    };
    let unk_name = model["unk_token"]
        .as_str()
        .map(str::to_string)
        .or_else(|| config_token(config.get("unk_token")));
    if spm {
        // byte-fallback pieces and the unknown token, as llama.cpp's converter types them
        let unk = unk_name.as_deref();
        for (i, t) in tokens.iter().enumerate() {
            match t.as_deref() {
                Some(s) if unk == Some(s) => types[i] = UNKNOWN,
                Some(s) if types[i] == NORMAL && is_byte_piece(s) => types[i] = BYTE,
                _ => {}
            }
        }
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            s.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) => match (
                p.first().and_then(Json::as_str),
                p.get(1).and_then(Json::as_str),
            ) {
                (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                _ => Err(format!("{at}: model.merges: {m}: expected a pair")),
            },
            _ => Err(format!(
                "{at}: model.merges: {m}: expected \"a b\" or a pair"
            )),
        })
        .collect::<Result<_, _>>()?;
    let id_of = |s: &str| tokens.iter().position(|t| t == s).map(|i| i as u32);
    let named = |k: &str| config_token(config.get(k)).and_then(|s| id_of(&s));
    let bos = info.and_then(|i| i.bos).or_else(|| named("bos_token"));
    let eos = info
        .and_then(|i| i.eos.first().copied())
        .or_else(|| named("eos_token"));
    let pad = info.and_then(|i| i.pad).or_else(|| named("pad_token"));
    let unk = unk_name.as_deref().and_then(id_of);
    let mut kv = if spm {
        if let Some(m) = merges.iter().find(|m| m.matches(' ').count() != 1) {
            return Err(format!(
                "{at}: model.merges: {m:?}: a piece with a space cannot be written as a GGUF merge"
            ));
        }
        vec![
            (
                "tokenizer.ggml.model".to_string(),
                Value::Str("llama".into()),
            ),
            ("tokenizer.ggml.pre".into(), Value::Str("default".into())),
            (
                "tokenizer.ggml.scores".into(),
                Value::F32s(scores(&tokens, &types, &merges)),
            ),
            ("tokenizer.ggml.tokens".into(), Value::Strs(tokens.clone())),
            ("tokenizer.ggml.token_type".into(), Value::I32s(types)),
            ("tokenizer.ggml.merges".into(), Value::Strs(merges)),
            (
                "tokenizer.ggml.add_space_prefix".into(),
                Value::Bool(prepends_space(&t)),
            ),
        ]
    } else {
        vec![
            (
                "tokenizer.ggml.model".to_string(),
                Value::Str("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".into(),
                Value::Str(pre_name(&t["pre_tokenizer"]).into()),
            ),
            ("tokenizer.ggml.tokens".into(), Value::Strs(tokens.clone())),
            ("tokenizer.ggml.token_type".into(), Value::I32s(types)),
            ("tokenizer.ggml.merges".into(), Value::Strs(merges)),
        ]
    };
    for (k, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("unknown_token_id", unk.filter(|_| spm)),
        ("padding_token_id", pad),
    ] {
        if let Some(id) = id {
            kv.push((format!("tokenizer.ggml.{k}"), Value::U32(id)));
        }
    }
    // A BOS token added by the post-processor (Llama 3) or asked for by the config.
    let adds_bos = config["add_bos_token"].as_bool().unwrap_or_else(|| {
        let post = t["post_processor"].to_string();
        bos.is_some_and(|b| post.contains(&format!("\"id\":{}", json_str(&tokens[b as usize]))))
    });
    kv.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(adds_bos)));
    if spm {
        let adds_eos = config["add_eos_token"].as_bool().unwrap_or_else(|| {
            let post = t["post_processor"]["single"].to_string();
            eos.is_some_and(|e| post.contains(&format!("\"id\":{}", json_str(&tokens[e as usize]))))
        });
        kv.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(adds_eos)));
    }
    let template = match config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        _ => hf_dir
            .map(|d| d.join("chat_template.jinja"))
            .filter(|p| p.is_file())
            .and_then(|p| std::fs::read_to_string(p).ok()),
    };
    if let Some(c) = template {
        kv.push(("tokenizer.chat_template".into(), Value::Str(c)));
    }
    Ok(kv)
}

fn json_str(s: &str) -> String {
    Json::String(s.to_string()).to_string()
}

/// Whether a BPE tokenizer.json is sentencepiece-style: byte fallback, or spaces as `▁` by a
/// Metaspace pre-tokenizer or a Prepend/Replace normalizer.
fn sentencepiece_style(t: &Json) -> bool {
    let metaspace = [&t["pre_tokenizer"], &t["normalizer"]]
        .iter()
        .any(|v| v.to_string().contains('\u{2581}'));
    t["model"]["byte_fallback"].as_bool() == Some(true) || metaspace
}

/// Whether the tokenizer puts a `▁` before the text (Metaspace's prepend scheme, or a Prepend
/// normalizer).
fn prepends_space(t: &Json) -> bool {
    let pre = &t["pre_tokenizer"];
    let scheme = |v: &Json| {
        v.get("prepend_scheme")
            .and_then(Json::as_str)
            .map(str::to_string)
    };
    let metaspace = match pre.get("type").and_then(Json::as_str) {
        Some("Metaspace") => scheme(pre),
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["type"] == "Metaspace")
            .and_then(scheme),
        _ => None,
    };
    match metaspace {
        Some(s) => s != "never",
        None => t["normalizer"].to_string().contains("\"Prepend\""),
    }
}

/// `<0xAB>`: a byte-fallback piece.
fn is_byte_piece(s: &str) -> bool {
    s.len() == 6
        && s.starts_with("<0x")
        && s.ends_with('>')
        && s[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Sentencepiece scores for a BPE vocabulary, which has none: a piece that a merge makes
/// scores minus that merge's rank (llama.cpp merges the best-scoring pair first, which is
/// BPE's order), other normal pieces below every merge, the rest 0.
fn scores(tokens: &[String], types: &[i32], merges: &[String]) -> Vec<f32> {
    let mut made: std::collections::HashMap<String, usize> = Default::default();
    for (r, m) in merges.iter().enumerate() {
        made.entry(m.replacen(' ', "", 1)).or_insert(r);
    }
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .map(|(i, (t, &ty))| match (made.get(t), ty) {
            (Some(&r), NORMAL | USER_DEFINED) => -(r as f32),
            (None, NORMAL) => -((merges.len() + i) as f32),
            _ => 0.0,
        })
        .collect()
}
