//! GGUF in: the `tokenizer.ggml.*` keys as a Hugging Face tokenizer.json (and
//! tokenizer_config.json with the chat template), built as transformers' GGUF loader builds
//! them, so that cockpit encodes and decodes a GGUF's text as `AutoTokenizer.from_pretrained(dir,
//! gguf_file=...)` does:
//! - `gpt2`: byte-level BPE, the file's merges;
//! - `llama` (SentencePiece): BPE with byte fallback over the file's pieces, `▁` for spaces
//!   (Metaspace, a `▁` prepended to the first word), the file's merges or, where it has none
//!   (llama.cpp's sentencepiece conversions), merges recovered from the pieces' scores; a BOS
//!   added unless the file says otherwise.
//!
//! Control tokens are special added tokens, user-defined ones plain added tokens, both matched
//! whole in the text.

use super::reader::{Gguf, Meta};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::Path;

/// llama.cpp's token types.
const CONTROL: usize = 3;
const USER_DEFINED: usize = 4;

fn write_json(p: &Path, v: &Value) -> Result<(), String> {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", p.display()))
}

fn strs(g: &Gguf, key: &str) -> Result<Option<Vec<String>>, String> {
    match g.get(key) {
        None => Ok(None),
        Some(Meta::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{key}[{i}]: expected a string"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(format!("{key}: expected an array of strings")),
    }
}

fn id(g: &Gguf, key: &str) -> Option<usize> {
    g.get(&format!("tokenizer.ggml.{key}"))
        .and_then(Meta::as_usize)
}

/// The file's tokenizer as tokenizer.json and tokenizer_config.json in `dir`; nothing for a
/// file without one or with a tokenizer model other than gpt2 and llama.
pub fn write(g: &Gguf, dir: &Path) -> Result<(), String> {
    let Some(model) = g.get("tokenizer.ggml.model") else {
        return Ok(());
    };
    let model = model
        .as_str()
        .ok_or("tokenizer.ggml.model: expected a string")?;
    let tokens = strs(g, "tokenizer.ggml.tokens")?.ok_or("tokenizer.ggml.tokens: missing")?;
    let types: Vec<usize> = match g.get("tokenizer.ggml.token_type") {
        Some(Meta::Array(a)) => a.iter().map(|m| m.as_usize().unwrap_or(1)).collect(),
        _ => Vec::new(),
    };
    let merges = strs(g, "tokenizer.ggml.merges")?;
    let name = |key: &str| id(g, key).and_then(|i| tokens.get(i).cloned());
    let (bos, eos, unk, pad) = (
        name("bos_token_id"),
        name("eos_token_id"),
        name("unknown_token_id"),
        name("padding_token_id"),
    );
    let flag = |k: &str| match g.get(&format!("tokenizer.ggml.{k}")) {
        Some(Meta::Bool(b)) => Some(*b),
        _ => None,
    };
    let t = match model {
        "gpt2" => byte_level(&tokens, &types, merges.unwrap_or_default()),
        "llama" => {
            let merges = match merges {
                Some(m) => m
                    .iter()
                    .map(|m| match m.split_once(' ') {
                        Some((a, b)) if !b.contains(' ') => Ok((a.to_string(), b.to_string())),
                        _ => Err(format!("tokenizer.ggml.merges: {m:?}: expected \"a b\"")),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                None => {
                    let scores = scores(g, tokens.len())?;
                    merges_from_scores(&tokens, &scores)
                }
            };
            // llama.cpp adds a BOS to a sentencepiece vocabulary that does not say otherwise
            let add_bos = flag("add_bos_token").unwrap_or(true);
            let add_eos = flag("add_eos_token").unwrap_or(false);
            let specials = [&bos, &eos, &unk, &pad];
            // (Gemma's say false: no `▁` before the first word)
            let prefix = flag("add_space_prefix").unwrap_or(true);
            let adds = Adds {
                bos: add_bos,
                eos: add_eos,
                space: prefix,
            };
            sentencepiece(&tokens, &types, &merges, &specials, adds)
        }
        // (other tokenizer models are left out: the model reads and writes token ids only)
        _ => return Ok(()),
    };
    write_json(&dir.join("tokenizer.json"), &t)?;
    let mut c = json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
        "eos_token": eos});
    if model == "llama" {
        c["unk_token"] = json!(unk);
        c["add_bos_token"] = json!(flag("add_bos_token").unwrap_or(true));
    }
    if let Some(p) = pad {
        c["pad_token"] = json!(p);
    }
    if let Some(t) = g.get("tokenizer.chat_template").and_then(Meta::as_str) {
        c["chat_template"] = json!(t);
    }
    write_json(&dir.join("tokenizer_config.json"), &c)
}

fn scores(g: &Gguf, n: usize) -> Result<Vec<f64>, String> {
    let key = "tokenizer.ggml.scores";
    let Some(Meta::Array(a)) = g.get(key) else {
        return Err(format!(
            "{key}: missing (a \"llama\" tokenizer without merges needs its pieces' scores)"
        ));
    };
    if a.len() != n {
        return Err(format!("{key}: {} scores for {n} tokens", a.len()));
    }
    a.iter()
        .enumerate()
        .map(|(i, m)| {
            m.as_f64()
                .ok_or_else(|| format!("{key}[{i}]: expected a number"))
        })
        .collect()
}

/// The merges a sentencepiece vocabulary implies, as transformers recovers them: every split
/// of a piece into two pieces of the vocabulary, ranked by the piece's score (best first), then
/// the longer left part, then the longer right part; ties in the order the pieces come, and
/// for one piece by the ids of its parts. (A piece spelled twice counts once, with the last
/// id and score.)
pub fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let mut vocab: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    let mut score: HashMap<&str, f64> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (i, (t, s)) in tokens.iter().zip(scores).enumerate() {
        if vocab.insert(t, i).is_none() {
            order.push(t);
        }
        score.insert(t, *s);
    }
    // (score, left chars, right chars, left, right)
    let mut all: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    for piece in order {
        let mut local = Vec::new();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&il), Some(&ir)) = (vocab.get(l), vocab.get(r)) {
                local.push((il, ir, l, r));
            }
        }
        local.sort_by_key(|&(il, ir, _, _)| (il, ir));
        let s = score[piece];
        all.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (s, l.chars().count(), r.chars().count(), l, r)),
        );
    }
    // best first; a stable sort keeps ties in their order
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    all.into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect()
}

fn added(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": special})
}

/// The vocabulary as a map (a token spelled twice keeps its last id, as in transformers).
fn vocab_map(tokens: &[String]) -> Map<String, Value> {
    let mut vocab = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), json!(i));
    }
    vocab
}

fn byte_level(tokens: &[String], types: &[usize], merges: Vec<String>) -> Value {
    let mut added_tokens = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let ty = types.get(i).copied().unwrap_or(1);
        if ty == CONTROL || ty == USER_DEFINED {
            let mut a = added(i, t, ty == CONTROL);
            a["normalized"] = json!(ty == USER_DEFINED);
            added_tokens.push(a);
        }
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab_map(tokens), "merges": merges},
    })
}

/// What a sentencepiece tokenizer adds to a text: BOS, EOS, a `▁` before the first word.
struct Adds {
    bos: bool,
    eos: bool,
    space: bool,
}

/// A sentencepiece vocabulary as transformers' Llama tokenizer: BPE with byte fallback, spaces
/// as `▁` with one prepended to the text where `adds.space`, no normalizer; the decoder undoes
/// both.
fn sentencepiece(
    tokens: &[String],
    types: &[usize],
    merges: &[(String, String)],
    specials: &[&Option<String>],
    adds: Adds,
) -> Value {
    let (add_bos, add_eos) = (adds.bos, adds.eos);
    let vocab = vocab_map(tokens);
    let id_of = |t: &str| vocab.get(t).and_then(Value::as_u64);
    // control tokens and the named specials: special; user-defined ones: plain, matched whole
    let mut added_ids: std::collections::BTreeMap<u64, Value> = Default::default();
    for (i, t) in tokens.iter().enumerate() {
        let Some(id) = id_of(t) else { continue };
        match types.get(i).copied() {
            Some(CONTROL) => {
                added_ids.insert(id, added(id as usize, t, true));
            }
            Some(USER_DEFINED) => {
                added_ids
                    .entry(id)
                    .or_insert_with(|| added(id as usize, t, false));
            }
            _ => {}
        }
    }
    for t in specials.iter().filter_map(|s| s.as_deref()) {
        if let Some(id) = id_of(t) {
            added_ids.insert(id, added(id as usize, t, true));
        }
    }
    let bos = specials[0].as_deref().filter(|_| add_bos);
    let eos = specials[1].as_deref().filter(|_| add_eos);
    let piece = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (out, parts) in [
        (&mut single, &[("A", 0)][..]),
        (&mut pair, &[("A", 0), ("B", 1)]),
    ] {
        for &(s, ty) in parts {
            out.extend(bos.map(|b| piece(b, ty)));
            out.push(seq(s, ty));
            out.extend(eos.map(|e| piece(e, ty)));
        }
    }
    let mut special_tokens = Map::new();
    for t in [bos, eos].into_iter().flatten() {
        let ids: Vec<u64> = id_of(t).into_iter().collect();
        special_tokens.insert(t.into(), json!({"id": t, "ids": ids, "tokens": [t]}));
    }
    let merges: Vec<Value> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if adds.space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let scheme = if adds.space { "first" } else { "never" };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_ids.into_values().collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme,
            "split": false},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special_tokens},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_come_from_scores_as_transformers_derives_them() {
        let t: Vec<String> = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "▁", "▁a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let s = [0.0, -10.0, -11.0, -12.0, -1.0, -2.0, -3.0, -13.0, -4.0];
        let m = merges_from_scores(&t, &s);
        let m: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // abc splits two ways at one score: the longer left part first
        assert_eq!(
            m,
            [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("▁", "a")]
        );
    }
}
