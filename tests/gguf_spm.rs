//! SentencePiece-style ("llama") GGUF tokenizers, in and out, against transformers' GGUF loader.
//! The fixture (tests/fixtures/spm, made by scripts/spm_fixtures.py) is a tiny SentencePiece BPE
//! model with Llama 2's settings, a tiny Llama trained on it, that model written by the `gguf`
//! package's writer as llama.cpp's converter writes it (pieces, scores, token types, no merges),
//! and what transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` gives for a few
//! strings; CI needs no Python for those. The export's read-back by the `gguf` package and
//! transformers is skipped with a message where Python or its packages are missing
//! (`$COCKPIT_PYTHON`, else python3).

mod common;

use cockpit::engine::gguf::load::materialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/spm")
        .join(rel)
}

fn expected() -> Value {
    let p = fixture("expected.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn python(script: &str, args: &[&str]) -> Option<Value> {
    let py = std::env::var("COCKPIT_PYTHON").unwrap_or_else(|_| "python3".into());
    common::python_json(&py, "gguf_support", script, args)
}

fn tokenizer(dir: &Path) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Every case's ids (with and without special tokens) and decoded text, as transformers gave
/// them for the fixture's GGUF, from the tokenizer cockpit built from `gguf`.
fn assert_tokenizes_as_transformers(gguf: &Path, what: &str) {
    let dir = materialize(gguf).unwrap_or_else(|e| panic!("{e}"));
    let tok = tokenizer(&dir);
    let e = expected();
    for c in e["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got.get_ids(), ids(&c["ids"]), "{what}: {text:?}");
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(plain.get_ids(), ids(&c["ids_plain"]), "{what}: {text:?}");
        let back = tok.decode(got.get_ids(), true).unwrap();
        assert_eq!(back, c["decoded"].as_str().unwrap(), "{what}: {text:?}");
        let with = tok.decode(got.get_ids(), false).unwrap();
        assert_eq!(
            with,
            c["decoded_special"].as_str().unwrap(),
            "{what}: {text:?}"
        );
        // decoding round-trips (transformers' too: but for the one space its decoder strips
        // where the text begins with one, and the special tokens)
        if !text.contains("<s>") && !text.starts_with(' ') {
            assert_eq!(back, text, "{what}: decoding round-trips");
        }
    }
}

#[test]
fn a_sentencepiece_gguf_tokenizes_as_transformers_does() {
    assert_tokenizes_as_transformers(&fixture("gguf/model.gguf"), "fixture GGUF");
    // (and cockpit's prompt encoding is that tokenizer's, with its BOS)
    let dir = materialize(&fixture("gguf/model.gguf")).unwrap();
    let t = cockpit::engine::data::Tok::open(dir.join("tokenizer.json").to_str().unwrap()).unwrap();
    let c = &expected()["cases"][1];
    let got = t.encode_prompt(c["text"].as_str().unwrap()).unwrap();
    assert_eq!(got, ids(&c["ids"]));
}

#[test]
fn a_sentencepiece_gguf_is_a_model_source_with_transformers_loss() {
    let e = expected();
    let seq = ids(&e["ids"]);
    let want = e["gguf_loss"].as_f64().unwrap();
    let got = common::next_token_loss(&fixture("gguf/model.gguf"), &seq);
    eprintln!("cockpit on the GGUF {got:.6}, transformers {want:.6}");
    assert!((got - want).abs() < 1e-4, "{got} vs {want}");
}

#[test]
fn the_hf_fixture_tokenizes_as_the_gguf() {
    // (the fixture's tokenizer.json is transformers' own conversion of tokenizer.model)
    let tok = tokenizer(&fixture("hf"));
    for c in expected()["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got.get_ids(), ids(&c["hf_dir_ids"]), "{text:?}");
    }
}

#[test]
fn export_writes_a_sentencepiece_tokenizer_as_llama_cpp_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = fixture("hf");
    let tj: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("tokenizer.json")).unwrap()).unwrap();
    let e = expected();
    let seq = ids(&e["ids"]);
    let ours = common::next_token_loss(&hf, &seq);
    for quant in ["f16", "q8_0"] {
        let out = tmp.path().join(format!("spm-{quant}.gguf"));
        let o = common::cockpit()
            .arg("export")
            .arg(&hf)
            .arg(&out)
            .args(["--format", "gguf", "--quant", quant])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        // cockpit reads its own export back: same tokenizer, same model
        assert_tokenizes_as_transformers(&out, quant);
        let loss = common::next_token_loss(&out, &seq);
        eprintln!("{quant}: cockpit on the export {loss:.6}, on the fixture {ours:.6}");
        assert!((loss - ours).abs() < 2e-2, "{quant}: {loss} vs {ours}");
        // llama.cpp's reader: the "llama" model, every piece with its score and type
        let Some(r) = python("read_gguf.py", &[out.to_str().unwrap()]) else {
            return;
        };
        let kv = &r["kv"];
        assert_eq!(kv["tokenizer.ggml.model"], "llama");
        assert_eq!(r["types"]["tokenizer.ggml.scores"], "ARRAY/FLOAT32");
        let tokens = kv["tokenizer.ggml.tokens"].as_array().unwrap();
        let scores = kv["tokenizer.ggml.scores"].as_array().unwrap();
        let types = kv["tokenizer.ggml.token_type"].as_array().unwrap();
        assert_eq!(tokens.len(), scores.len());
        assert_eq!(tokens.len(), types.len());
        for (s, id) in tj["model"]["vocab"].as_object().unwrap() {
            assert_eq!(tokens[id.as_u64().unwrap() as usize], s.as_str());
        }
        let at = |s: &str| tokens.iter().position(|t| t == s).unwrap();
        assert_eq!(types[at("<unk>")], 2, "unknown");
        assert_eq!(types[at("<s>")], 3, "control");
        assert_eq!(types[at("<0x41>")], 6, "byte");
        assert_eq!(types[at("▁t")], 1, "normal");
        // a merged piece outscores the pieces it is made of, and earlier merges outscore later
        let sc = |s: &str| scores[at(s)].as_f64().unwrap();
        assert!(sc("▁t") > sc("▁") && sc("▁t") > sc("t"));
        assert!(sc("▁t") > sc("▁the"));
        assert_eq!(kv["tokenizer.ggml.bos_token_id"], 1);
        assert_eq!(kv["tokenizer.ggml.eos_token_id"], 2);
        assert_eq!(kv["tokenizer.ggml.unknown_token_id"], 0);
        assert_eq!(kv["tokenizer.ggml.add_bos_token"], true);
        assert_eq!(kv["tokenizer.ggml.add_space_prefix"], true);
        // transformers' GGUF loader tokenizes the export as it does llama.cpp's conversion
        let cases = e["cases"].as_array().unwrap();
        let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
        let arg = serde_json::to_string(&texts).unwrap();
        let Some(t) = python("hf_tokenize.py", &[out.to_str().unwrap(), &arg]) else {
            return;
        };
        for (c, got) in cases.iter().zip(t.as_array().unwrap()) {
            assert_eq!(got["ids"], c["ids"], "{quant}: {}", c["text"]);
            assert_eq!(got["decoded"], c["decoded"], "{quant}: {}", c["text"]);
        }
    }
}
