//! cockpit's GGUF exports run by llama.cpp itself (the `llama-cpp-python` package, CPU): its
//! loss on a fixture's held-out ids from its own logits equals cockpit's loss on the fixture
//! (f16: ≤ 1e-3 nats; q8_0: stated, ≤ 2e-2), and its tokenizer reads the sentencepiece export
//! as transformers does. Skipped with a message where Python or the package is missing
//! (`$COCKPIT_PYTHON`, else python3; the package compiles llama.cpp when installed).

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn python(args: &[&str]) -> Option<Value> {
    let py = std::env::var("COCKPIT_PYTHON").unwrap_or_else(|_| "python3".into());
    common::python_json(&py, "gguf_support", "llama_cpp_loss.py", args)
}

fn export(src: &Path, out: &Path, quant: &str) {
    let o = common::cockpit()
        .arg("export")
        .arg(src)
        .arg(out)
        .args(["--format", "gguf", "--quant", quant])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The gemma3_text fixture with its score scale at llama.cpp's (1/√head_dim, which llama.cpp
/// derives from the shape: it reads no query_pre_attn_scalar), copied under `tmp`.
fn gemma3_at_llama_cpps_scale(tmp: &Path) -> PathBuf {
    let src = fixture("hf/gemma3_text");
    let dir = tmp.join("gemma3_scaled");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let mut c = json(&dir.join("config.json"));
    c["query_pre_attn_scalar"] = c["head_dim"].clone();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    dir
}

#[test]
fn llama_cpp_runs_cockpits_exports_with_cockpits_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let spm = json(&fixture("spm/expected.json"));
    let hf_ids = |name: &str| json(&fixture(&format!("hf/{name}/expected.json")))["ids"].clone();
    for (name, dir, ids) in [
        (
            "llama2",
            fixture("hf/llama2"),
            json(&fixture("hf/llama2/expected.json"))["ids"].clone(),
        ),
        (
            "qwen2",
            fixture("hf/qwen2"),
            json(&fixture("hf/qwen2/expected.json"))["ids"].clone(),
        ),
        (
            "qwen3",
            fixture("hf/qwen3"),
            json(&fixture("hf/qwen3/expected.json"))["ids"].clone(),
        ),
        (
            "llama3",
            fixture("hf/llama3"),
            json(&fixture("hf/llama3/expected.json"))["ids"].clone(),
        ),
        (
            "olmo2",
            fixture("hf/olmo2"),
            json(&fixture("hf/olmo2/expected.json"))["ids"].clone(),
        ),
        ("spm", fixture("spm/hf"), spm["ids"].clone()),
        // phi3: q|k|v and gate|up fused, RoPE on half of each head; phi3_longrope: its factors
        // as rope_factors_long/short (llama.cpp takes the long ones past the original context
        // of 16, as the fixture's 48 ids do in transformers); gemma3: 1 + w norms, the layer
        // period 2 with a window of 8, the local θ, linear scaling on the full layers.
        ("phi3", fixture("hf/phi3"), hf_ids("phi3")),
        (
            "phi3_longrope",
            fixture("hf/phi3_longrope"),
            hf_ids("phi3_longrope"),
        ),
        (
            "gemma3",
            gemma3_at_llama_cpps_scale(tmp.path()),
            hf_ids("gemma3_text"),
        ),
        // gemma2: 1 + w norms, every other layer sliding (a window of 8), the attention and
        // final soft-caps
        ("gemma2", fixture("hf/gemma2"), hf_ids("gemma2")),
        // granitehybrid: Mamba-2 layers (llama.cpp's own scan) around a NoPE attention layer
        (
            "granite_hybrid",
            fixture("hf/granite_hybrid"),
            hf_ids("granite_hybrid"),
        ),
        // and with routed experts: the router, the experts' stacks, the shared expert
        // (without the fixture's Mamba proj biases, which llama.cpp has no place for)
        (
            "granite_hybrid_moe",
            common::granite_moe_without_proj_biases(&tmp.path().join("moe")),
            hf_ids("granite_hybrid_moe"),
        ),
    ] {
        let ids: Vec<u32> = serde_json::from_value(ids).unwrap();
        let ours = common::next_token_loss(&dir, &ids);
        for (quant, tol) in [("f16", 1e-3), ("q8_0", 2e-2)] {
            let out = tmp.path().join(format!("{name}-{quant}.gguf"));
            export(&dir, &out, quant);
            let ids_arg = serde_json::to_string(&ids).unwrap();
            // plain text (no leading space or special tokens written in it, where llama.cpp's
            // sentencepiece tokenizer and transformers' are known to part ways)
            let cases: Vec<&Value> = spm["cases"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| {
                    let t = c["text"].as_str().unwrap();
                    !t.is_empty() && !t.starts_with(' ') && !t.contains("<s>")
                })
                .collect();
            let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
            let texts = if name == "spm" {
                serde_json::to_string(&texts).unwrap()
            } else {
                "[]".into()
            };
            let Some(r) = python(&[out.to_str().unwrap(), &ids_arg, &texts]) else {
                return;
            };
            let loss = r["loss"].as_f64().unwrap();
            eprintln!(
                "{name} {quant}: llama.cpp loss {loss:.6}, cockpit {ours:.6}, diff {:.2e}",
                (loss - ours).abs()
            );
            assert!(
                (loss - ours).abs() <= tol,
                "{name} {quant}: {loss} vs {ours}"
            );
            for (c, got) in cases.iter().zip(r["text_ids"].as_array().unwrap()) {
                assert_eq!(got, &c["ids"], "{name} {quant}: {}", c["text"]);
            }
        }
    }
}

/// A sentencepiece GGUF that says `add_space_prefix = false` (as Gemma's do) reads as a
/// tokenizer that puts no `▁` before the first word: cockpit's ids are llama.cpp's, and differ
/// from those of the same file with the prefix.
#[test]
fn a_gguf_without_a_space_prefix_tokenizes_as_llama_cpp_does() {
    use cockpit::engine::gguf::writer::Value as V;
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("spm/gguf/model.gguf");
    let out = tmp.path().join("no_prefix.gguf");
    let set = [("tokenizer.ggml.add_space_prefix", V::Bool(false))];
    common::rewrite_gguf(&src, &out, &set, &[]);
    let spm = json(&fixture("spm/expected.json"));
    let texts: Vec<&str> = spm["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .filter(|t| !t.is_empty() && !t.starts_with(' ') && !t.contains("<s>"))
        .collect();
    let ids = serde_json::to_string(&spm["ids"]).unwrap();
    let texts_arg = serde_json::to_string(&texts).unwrap();
    let Some(r) = python(&[out.to_str().unwrap(), &ids, &texts_arg]) else {
        return;
    };
    let ours = |gguf: &Path| {
        let dir = cockpit::engine::gguf::load::materialize(gguf).unwrap();
        let t = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let enc = |s: &str| t.encode(s, true).unwrap().get_ids().to_vec();
        texts.iter().map(|s| enc(s)).collect::<Vec<Vec<u32>>>()
    };
    let (without, with) = (ours(&out), ours(&src));
    let theirs: Vec<Vec<u32>> = serde_json::from_value(r["text_ids"].clone()).unwrap();
    assert_eq!(without, theirs, "cockpit's ids against llama.cpp's");
    assert_ne!(without, with, "the prefix must change some ids");
}
