//! GGUF export read back by the real readers: the `gguf` package's GGUFReader (every key and
//! tensor) and transformers' GGUF loader (the held-out loss of the committed fixtures), each
//! skipped with a message where Python or its packages are missing. The interpreter is
//! `$COCKPIT_PYTHON`, else python3.

mod common;

use candle_core::{DType, Tensor};
use cockpit::engine::gguf::names;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// Run a helper script; None (after saying why) when Python or its packages are absent.
fn python(script: &str, args: &[&str]) -> Option<Value> {
    let py = std::env::var("COCKPIT_PYTHON").unwrap_or_else(|_| "python3".into());
    common::python_json(&py, "gguf_support", script, args)
}

fn export(src: &Path, out: &Path, quant: &str) {
    let o = common::cockpit()
        .arg("export")
        .arg(src)
        .arg(out)
        .args(["--format", "gguf", "--quant", quant])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
}

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// `dir` exported in `quant` and read back by the `gguf` package (None: it is absent).
fn read_export(dir: &Path, quant: &str) -> Option<Value> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gguf");
    export(dir, &out, quant);
    python("read_gguf.py", &[out.to_str().unwrap()])
}

/// A tensor `t` as the `gguf` package read it holds `want`: F32 to the bit, or Q8_0 (the
/// matrices of a q8_0 export) within half a step of its block's scale.
fn assert_stored(at: &str, g: &str, t: &Value, want: &Tensor, quant: &str) {
    let shape: Vec<usize> = serde_json::from_value(t["shape"].clone()).unwrap();
    assert_eq!(shape, want.dims(), "{at}: {g}");
    let got: Vec<f64> = serde_json::from_value(t["values"].clone()).unwrap();
    let flat = want.to_dtype(DType::F32).and_then(|t| t.flatten_all());
    let want: Vec<f32> = flat.and_then(|t| t.to_vec1()).unwrap();
    let blocks = quant == "q8_0" && shape.len() == 2;
    assert_eq!(t["type"], if blocks { "Q8_0" } else { "F32" }, "{at}: {g}");
    for (i, (a, b)) in got.chunks(32).zip(want.chunks(32)).enumerate() {
        let step = if blocks {
            b.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0 * 0.6 + 1e-6
        } else {
            0.0
        };
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - *y as f64).abs() <= step,
                "{at}: {g} block {i}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn the_gguf_package_reads_every_key_and_tensor() {
    for (name, arch) in [
        ("llama2", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("olmo2", "olmo2"),
        ("gpt2", "gpt2"),
    ] {
        let dir = fixture(name);
        let cfg = json(&dir.join("config.json"));
        let tok = json(&dir.join("tokenizer.json"));
        let (m, _, weights) = cockpit::engine::hf::load(&dir).unwrap();
        for quant in ["f32", "q8_0"] {
            let Some(r) = read_export(&dir, quant) else {
                return;
            };
            let (kv, types) = (&r["kv"], &r["types"]);
            let at = format!("{name} {quant}");
            assert_eq!(kv["general.architecture"], arch, "{at}");
            assert_eq!(kv["general.alignment"], 32, "{at}");
            let k = |s: &str| format!("{arch}.{s}");
            assert_eq!(kv[k("block_count")], m.n_layer, "{at}");
            assert_eq!(types[k("block_count")], "UINT32", "{at}");
            assert_eq!(kv[k("embedding_length")], m.n_embd, "{at}");
            assert_eq!(kv[k("attention.head_count")], m.n_head, "{at}");
            assert_eq!(kv[k("context_length")], m.seq_len, "{at}");
            if arch != "gpt2" {
                assert_eq!(kv[k("attention.head_count_kv")], m.kv_heads(), "{at}");
                assert_eq!(
                    kv[k("feed_forward_length")],
                    cfg["intermediate_size"],
                    "{at}"
                );
                assert_eq!(types[k("rope.freq_base")], "FLOAT32", "{at}");
                let theta = cfg["rope_parameters"]["rope_theta"].as_f64().unwrap();
                assert_eq!(kv[k("rope.freq_base")].as_f64().unwrap(), theta, "{at}");
                let eps = kv[k("attention.layer_norm_rms_epsilon")].as_f64().unwrap();
                assert!((eps - m.norm_eps).abs() < 1e-9 * m.norm_eps.max(1.0) + 1e-12);
                assert_eq!(kv[k("rope.dimension_count")], m.head_size(), "{at}");
            }
            // the tokenizer: every token in id order, its merges, its special ids
            assert_eq!(kv["tokenizer.ggml.model"], "gpt2", "{at}");
            let tokens = kv["tokenizer.ggml.tokens"].as_array().unwrap();
            assert_eq!(tokens.len(), m.vocab_size, "{at}");
            assert_eq!(types["tokenizer.ggml.tokens"], "ARRAY/STRING", "{at}");
            for (s, id) in tok["model"]["vocab"].as_object().unwrap() {
                assert_eq!(tokens[id.as_u64().unwrap() as usize], s.as_str(), "{at}");
            }
            let merges = kv["tokenizer.ggml.merges"].as_array().unwrap();
            assert_eq!(
                merges.len(),
                tok["model"]["merges"].as_array().unwrap().len()
            );
            assert_eq!(
                kv["tokenizer.ggml.bos_token_id"], cfg["bos_token_id"],
                "{at}"
            );
            assert_eq!(
                kv["tokenizer.ggml.eos_token_id"], cfg["eos_token_id"],
                "{at}"
            );
            let tt = kv["tokenizer.ggml.token_type"].as_array().unwrap();
            assert_eq!(tt[0], 3, "{at}: <s> is a control token");
            // every tensor: llama.cpp's name, the right shape, cockpit's values
            let tensors = r["tensors"].as_object().unwrap();
            let expect = if arch == "gpt2" {
                4 + 12 * m.n_layer
            } else {
                2 + 9 * m.n_layer
            };
            let qk_norm = m.layout.qk_norm != cockpit::config::QkNorm::None;
            let expect = expect
                + usize::from(!m.tie_embeddings)
                + 3 * m.n_layer * usize::from(m.qkv_bias)
                + 2 * m.n_layer * usize::from(qk_norm);
            assert_eq!(tensors.len(), expect, "{at}: {:?}", tensors.keys());
            assert_eq!(tensors.contains_key("output.weight"), !m.tie_embeddings);
            for (g, t) in tensors {
                let want: Tensor = if g.contains("attn_qkv") {
                    let (l, w) = (g.split('.').nth(1).unwrap(), g.rsplit('.').next().unwrap());
                    let parts: Vec<Tensor> = ["q_proj", "k_proj", "v_proj"]
                        .iter()
                        .map(|p| weights[&format!("model.layers.{l}.self_attn.{p}.{w}")].clone())
                        .collect();
                    Tensor::cat(&parts, 0).unwrap()
                } else {
                    let c = names::cockpit_name(g, arch).unwrap_or_else(|| panic!("{at}: {g}"));
                    let w = weights.get(&c).unwrap_or_else(|| panic!("{at}: {g} → {c}"));
                    let w = w.to_dtype(DType::F32).unwrap();
                    if arch == "llama" && g.contains("attn_q.") {
                        names::permute_rows(&w, m.n_head).unwrap()
                    } else if arch == "llama" && g.contains("attn_k.") {
                        names::permute_rows(&w, m.kv_heads()).unwrap()
                    } else {
                        w
                    }
                };
                assert_stored(&at, g, t, &want, quant);
            }
        }
    }
}

/// A fixture's tensor, under cockpit's names, as llama.cpp's `arch` stores `g`: Phi-3's q|k|v
/// and gate|up fused, Gemma 3's norms as `1 + w`.
fn as_llama_cpp_stores(
    g: &str,
    arch: &str,
    weights: &std::collections::HashMap<String, Tensor>,
) -> Tensor {
    let l = g.split('.').nth(1).unwrap_or("");
    let cat = |parts: &[&str]| {
        let t: Vec<Tensor> = parts
            .iter()
            .map(|p| weights[&format!("model.layers.{l}.{p}.weight")].clone())
            .collect();
        Tensor::cat(&t, 0).unwrap()
    };
    let w = if g.ends_with("attn_qkv.weight") {
        cat(&["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    } else if arch == "phi3" && g.ends_with("ffn_up.weight") {
        cat(&["mlp.gate_proj", "mlp.up_proj"])
    } else {
        let c = names::cockpit_name(g, arch).unwrap_or_else(|| panic!("{arch}: {g}"));
        weights
            .get(&c)
            .unwrap_or_else(|| panic!("{arch}: {g} → {c}"))
            .clone()
    };
    let w = w.to_dtype(DType::F32).unwrap();
    if (arch == "gemma3" || arch == "gemma2") && g.ends_with("norm.weight") {
        (w + 1.0).unwrap()
    } else {
        w
    }
}

/// Phi-3, Gemma 3 and Gemma 2 go out as llama.cpp's `phi3`, `gemma3` and `gemma2`: the `gguf`
/// package reads the keys llama.cpp's converter writes for them (partial rotary, LongRoPE's
/// factors, attention factor and original context; Gemma 3's head dim, window, layer period,
/// local θ, scale and linear RoPE scaling; Gemma 2's window and soft-caps) and every tensor
/// with the fixture's values (fused, or `1 + w`).
#[test]
fn phi3_and_gemma3_go_out_as_llama_cpp_writes_them() {
    for (name, arch) in [
        ("phi3", "phi3"),
        ("phi3_longrope", "phi3"),
        ("gemma3_text", "gemma3"),
        ("gemma3", "gemma3"),
        ("gemma2", "gemma2"),
    ] {
        let dir = fixture(name);
        let cfg = json(&dir.join("config.json"));
        let text = if name == "gemma3" {
            cfg["text_config"].clone()
        } else {
            cfg.clone()
        };
        let (m, _, weights) = cockpit::engine::hf::load(&dir).unwrap();
        for quant in ["f32", "q8_0"] {
            let Some(r) = read_export(&dir, quant) else {
                return;
            };
            let (kv, tensors) = (&r["kv"], r["tensors"].as_object().unwrap());
            let at = format!("{name} {quant}");
            let k = |s: &str| kv[format!("{arch}.{s}")].clone();
            let f = |s: &str| k(s).as_f64().unwrap_or_else(|| panic!("{at}: {s}"));
            assert_eq!(kv["general.architecture"], arch, "{at}");
            assert_eq!(k("block_count"), m.n_layer, "{at}");
            assert_eq!(k("embedding_length"), m.n_embd, "{at}");
            assert_eq!(k("feed_forward_length"), text["intermediate_size"], "{at}");
            assert_eq!(k("attention.head_count"), m.n_head, "{at}");
            assert_eq!(k("attention.head_count_kv"), m.kv_heads(), "{at}");
            assert_eq!(k("context_length"), text["max_position_embeddings"]);
            let rope = &text["rope_parameters"];
            if arch == "phi3" {
                let partial = rope["partial_rotary_factor"].as_f64().unwrap();
                let rd = (m.head_size() as f64 * partial) as usize;
                assert_eq!(k("rope.dimension_count"), rd, "{at}");
                assert_eq!(f("rope.freq_base"), rope["rope_theta"].as_f64().unwrap());
                assert_eq!(k("attention.sliding_window"), 0, "{at}: no window");
                let longrope = rope["rope_type"] == "longrope";
                for (t, key) in [
                    ("rope_factors_long.weight", "long_factor"),
                    ("rope_factors_short.weight", "short_factor"),
                ] {
                    assert_eq!(tensors.contains_key(t), longrope, "{at}: {t}");
                    if longrope {
                        assert_eq!(tensors[t]["type"], "F32", "{at}: {t}");
                        let got: Vec<f32> =
                            serde_json::from_value(tensors[t]["values"].clone()).unwrap();
                        let want: Vec<f64> = serde_json::from_value(rope[key].clone()).unwrap();
                        let want: Vec<f32> = want.iter().map(|x| *x as f32).collect();
                        assert_eq!(got, want, "{at}: {t} (as f32)");
                    }
                }
                if longrope {
                    let old = cfg["original_max_position_embeddings"].as_f64().unwrap();
                    assert_eq!(k("rope.scaling.original_context_length"), old as u64);
                    // transformers' (and llama.cpp's converter's) √(1 + ln s / ln old)
                    let s = 64.0 / old;
                    let want = (1.0 + s.ln() / old.ln()).sqrt();
                    assert!((f("rope.scaling.attn_factor") - want).abs() < 1e-6, "{at}");
                }
            } else if arch == "gemma2" {
                let hd = text["head_dim"].as_u64().unwrap();
                assert_eq!(k("attention.key_length"), hd, "{at}");
                assert_eq!(k("attention.value_length"), hd, "{at}");
                assert_eq!(f("rope.freq_base"), rope["rope_theta"].as_f64().unwrap());
                assert_eq!(
                    k("attention.sliding_window"),
                    text["sliding_window"],
                    "{at}"
                );
                // (llama.cpp's gemma2 slides every other layer: no pattern key)
                assert!(kv.get("gemma2.attention.sliding_window_pattern").is_none());
                for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
                    assert_eq!(f(key), text[key].as_f64().unwrap(), "{at}: {key}");
                }
                let scalar = text["query_pre_attn_scalar"].as_f64().unwrap();
                assert!(
                    (f("attention.scale") - scalar.powf(-0.5)).abs() < 1e-7,
                    "{at}"
                );
            } else {
                let hd = text["head_dim"].as_u64().unwrap();
                assert_eq!(k("attention.key_length"), hd, "{at}");
                assert_eq!(k("attention.value_length"), hd, "{at}");
                assert_eq!(k("rope.dimension_count"), hd, "{at}");
                let full = &rope["full_attention"];
                assert_eq!(f("rope.freq_base"), full["rope_theta"].as_f64().unwrap());
                assert_eq!(k("rope.scaling.type"), full["rope_type"], "{at}");
                assert_eq!(f("rope.scaling.factor"), full["factor"].as_f64().unwrap());
                let local = rope["sliding_attention"]["rope_theta"].as_f64().unwrap();
                assert_eq!(f("rope.freq_base_swa"), local, "{at}");
                assert_eq!(
                    k("attention.sliding_window"),
                    text["sliding_window"],
                    "{at}"
                );
                // layer_types: sliding, full, sliding, full = every 2nd layer full
                assert_eq!(k("attention.sliding_window_pattern"), 2, "{at}");
                assert_eq!(
                    r["types"]["gemma3.attention.sliding_window_pattern"],
                    "UINT32"
                );
                let scalar = text["query_pre_attn_scalar"].as_f64().unwrap();
                assert!(
                    (f("attention.scale") - scalar.powf(-0.5)).abs() < 1e-7,
                    "{at}"
                );
                assert!(kv.get("gemma3.final_logit_softcapping").is_none(), "{at}");
            }
            let eps = f("attention.layer_norm_rms_epsilon");
            assert!((eps - m.norm_eps).abs() < 1e-7 * m.norm_eps, "{at}");
            // every tensor: Phi-3's fused (attn_qkv, ffn_up of gate|up), Gemma 3's 1 + w norms
            let per_layer = match arch {
                "phi3" => 6,
                "gemma2" => 11,
                _ => 13,
            };
            let extra = usize::from(tensors.contains_key("rope_factors_long.weight")) * 2;
            let expect = 2 + per_layer * m.n_layer + usize::from(!m.tie_embeddings) + extra;
            assert_eq!(tensors.len(), expect, "{at}: {:?}", tensors.keys());
            for (g, t) in tensors {
                if g.starts_with("rope_factors") {
                    continue;
                }
                let want = as_llama_cpp_stores(g, arch, &weights);
                assert_stored(&at, g, t, &want, quant);
            }
        }
    }
}

/// cockpit's Q4_K, Q5_K and Q6_K blocks, decoded by the `gguf` package (llama.cpp's own
/// dequantization), give exactly what cockpit's decoder gives, and stay near the values encoded.
#[test]
fn llama_cpp_decodes_cockpits_k_quant_blocks_as_cockpit_does() {
    use cockpit::engine::gguf::{quant, quant::GgmlType, writer};
    let x: Vec<f32> = (0..2 * 512)
        .map(|i| ((i as f32) * 0.013).sin() * (1.0 + (i % 11) as f32 * 0.2) - 0.1)
        .collect();
    let types = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];
    let tensors: Vec<writer::TensorData> = types
        .iter()
        .map(|&ty| writer::TensorData {
            name: format!("t.{}", ty.name()),
            shape: vec![2, 512],
            ty,
            bytes: quant::encode(&x, ty),
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("k.gguf");
    let kv = vec![(
        "general.architecture".to_string(),
        writer::Value::Str("llama".into()),
    )];
    writer::write(&out, &kv, &tensors).unwrap();
    let Some(r) = python("read_gguf.py", &[out.to_str().unwrap()]) else {
        return;
    };
    for t in &tensors {
        let got = &r["tensors"][&t.name];
        assert_eq!(got["type"], t.ty.name(), "{}", t.name);
        let vals: Vec<f64> = serde_json::from_value(got["values"].clone()).unwrap();
        let ours = quant::decode(&t.bytes, t.ty);
        assert_eq!(vals.len(), ours.len(), "{}", t.name);
        let worst = vals
            .iter()
            .zip(&ours)
            .map(|(a, b)| (a - *b as f64).abs())
            .fold(0f64, f64::max);
        assert!(
            worst <= 1e-6,
            "{}: llama.cpp's decoding differs by {worst}",
            t.name
        );
        let err = ours
            .iter()
            .zip(&x)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{}: worst error against the encoded values {err:.4}",
            t.name
        );
        assert!(err < 0.25, "{}: {err}", t.name);
    }
}

#[test]
fn transformers_loads_the_export_with_cockpits_loss() {
    // (Not llama3: transformers' GGUF loader drops llama.cpp's rope_freqs factors; not qwen3:
    // it takes Qwen3Config's default head_dim, not `qwen3.attention.key_length`, so a head dim
    // other than 128 loads with the wrong shapes. llama.cpp runs both: tests/gguf_llama_cpp.rs.)
    for name in ["llama2", "qwen2"] {
        let dir = fixture(name);
        let e = json(&dir.join("expected.json"));
        let ids: Vec<u32> = serde_json::from_value(e["ids"].clone()).unwrap();
        let ours = common::next_token_loss(&dir, &ids);
        let tmp = tempfile::tempdir().unwrap();
        for quant in ["f32", "f16", "bf16", "q8_0", "q4_k_m"] {
            let out = tmp.path().join(format!("{name}-{quant}.gguf"));
            export(&dir, &out, quant);
            let ids_arg = serde_json::to_string(&ids).unwrap();
            let text = e["prompt_text"].as_str().unwrap();
            let Some(r) = python("hf_loss.py", &[out.to_str().unwrap(), &ids_arg, text]) else {
                return;
            };
            let loss = r["loss"].as_f64().unwrap();
            eprintln!(
                "{name} {quant}: transformers loss {loss:.6}, cockpit {ours:.6}, diff {:.2e}",
                (loss - ours).abs()
            );
            // (The fixtures' rows are narrower than a k-quant block: q4_k_m writes them in
            // its fallback, Q8_0.)
            let tol = match quant {
                "q8_0" | "q4_k_m" => 2e-2,
                _ => 1e-3,
            };
            assert!(
                (loss - ours).abs() <= tol,
                "{name} {quant}: {loss} vs cockpit {ours}"
            );
            assert_eq!(
                r["text_ids"], e["prompt_ids"],
                "{name} {quant}: the GGUF's tokenizer"
            );
        }
    }
}

#[test]
fn what_gguf_export_cannot_write_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gguf");
    for (args, want) in [
        (vec!["--quant", "q2_k"], "k-quant"),
        (vec!["--format", "onnx"], "--format"),
        (vec!["--format", "hf", "--quant", "q8_0"], "--quant"),
        (vec!["--format", "gguf", "--dtype", "f16"], "--dtype"),
    ] {
        let o = common::cockpit()
            .arg("export")
            .arg(fixture("qwen2"))
            .arg(&out)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(!out.exists());
    }
}

#[test]
fn a_gguf_file_is_a_model_source_with_cockpits_loss() {
    // (llama3: its RoPE scaling goes out as llama.cpp's rope_freqs factors and comes back as
    // Hugging Face's llama3 parameters.)
    // (phi3: partial rotary, fused weights; phi3_longrope: its factors as llama.cpp's tensors
    // and back; gemma3: 1 + w norms, the layer period and local θ; gemma3: the wrapper's
    // language model.)
    for name in [
        "llama2",
        "llama3",
        "qwen2",
        "qwen3",
        "olmo2",
        "gpt2",
        "granite",
        "phi3",
        "phi3_longrope",
        "gemma3_text",
        "gemma3",
        "gemma2",
        "granite_hybrid",
    ] {
        let dir = fixture(name);
        let e = json(&dir.join("expected.json"));
        let ids: Vec<u32> = serde_json::from_value(e["ids"].clone()).unwrap();
        let ours = common::next_token_loss(&dir, &ids);
        let tmp = tempfile::tempdir().unwrap();
        for (quant, tol) in [
            ("f32", 1e-5),
            ("f16", 1e-3),
            ("q8_0", 2e-2),
            ("q4_0", 0.2),
            ("q4_k_m", 0.2),
        ] {
            let out = tmp.path().join(format!("{name}-{quant}.gguf"));
            export(&dir, &out, quant);
            let loss = common::next_token_loss(&out, &ids);
            eprintln!(
                "{name} {quant}: cockpit on the GGUF {loss:.6}, on the fixture {ours:.6}, diff {:.1e}",
                (loss - ours).abs()
            );
            assert!(
                (loss - ours).abs() <= tol,
                "{name} {quant}: {loss} vs {ours}"
            );
            if quant.starts_with("q4") {
                assert_kept_blocks(&out, name, quant);
            }
        }
        // and as any source: generate reads its tokenizer
        let o = common::cockpit()
            .arg("generate")
            .arg(tmp.path().join(format!("{name}-f32.gguf")))
            .args([
                "--prompt",
                e["prompt_text"].as_str().unwrap(),
                "--temperature",
                "0",
            ])
            .args(["--max-tokens", "4", "--ids"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got: Vec<u32> = String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        let greedy: Vec<u32> = serde_json::from_value(e["greedy"].clone()).unwrap();
        assert_eq!(got, greedy[..4], "{name}");
    }
}

/// A 4-bit GGUF file's layer matrices are kept in their own blocks for a 4-bit LoRA base
/// (`gguf_blocks.safetensors` of its directory): every one, under cockpit's name, decodes to the
/// very values the directory's dense weights hold (q/k rows permuted back, fused ones split, the
/// hybrid's gate and up joined, row for row); in a q4_0 file that is every projection.
fn assert_kept_blocks(file: &Path, name: &str, quant: &str) {
    use cockpit::engine::gguf::{load, quant::GgmlType};
    let dir = load::materialize(file).unwrap();
    let kept = load::kept_blocks(&dir).unwrap();
    let (_, _, dense) = cockpit::engine::hf::load(&dir).unwrap();
    if name == "gpt2" {
        assert!(kept.is_empty(), "GPT-2's transposed matrices are not kept");
        return;
    }
    for (n, b) in &kept {
        let ty = GgmlType::from_code(b.code).unwrap();
        let got = cockpit::engine::gguf::quant::decode(&b.data.to_vec1::<u8>().unwrap(), ty);
        let want: Vec<f32> = dense[n].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(dense[n].dims(), [b.out, b.inp], "{name} {quant}: {n}");
        assert!(
            got == want,
            "{name} {quant}: {n} in {ty:?} decodes to other values"
        );
    }
    let projections: Vec<&String> = dense
        .keys()
        .filter(|n| {
            n.starts_with("model.layers.")
                && (n.ends_with("proj.weight") || n.ends_with("linear.weight"))
        })
        .collect();
    eprintln!(
        "{name} {quant}: {} of {} projections kept as blocks",
        kept.len(),
        projections.len()
    );
    assert!(!projections.is_empty());
    if quant == "q4_0" {
        for n in projections {
            assert!(kept.contains_key(n), "{name} q4_0: {n} not kept");
        }
    }
}

#[test]
fn a_broken_or_foreign_gguf_is_refused_by_name() {
    use cockpit::engine::gguf::writer::{self, Value};
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.gguf");
    export(&fixture("qwen2"), &good, "q8_0");
    let bytes = std::fs::read(&good).unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let text = tmp.path().join("text.gguf");
    std::fs::write(&text, "not a model").unwrap();
    let falcon = tmp.path().join("falcon.gguf");
    let kv = vec![(
        "general.architecture".to_string(),
        Value::Str("falcon".into()),
    )];
    writer::write(&falcon, &kv, &[]).unwrap();
    // Phi-3 and Gemma 3 files that say what cockpit cannot read
    let (longrope, gemma) = (tmp.path().join("lr.gguf"), tmp.path().join("g.gguf"));
    export(&fixture("phi3_longrope"), &longrope, "f32");
    export(&fixture("gemma3_text"), &gemma, "f32");
    let one_factor = tmp.path().join("one_factor.gguf");
    common::rewrite_gguf(&longrope, &one_factor, &[], &["rope_factors_short.weight"]);
    let wide = tmp.path().join("wide.gguf");
    let ff = [("phi3.feed_forward_length", Value::U32(256))];
    common::rewrite_gguf(&longrope, &wide, &ff, &[]);
    let pattern = tmp.path().join("pattern.gguf");
    let p = [(
        "gemma3.attention.sliding_window_pattern",
        Value::Str("x".into()),
    )];
    common::rewrite_gguf(&gemma, &pattern, &p, &[]);
    for (path, want) in [
        (&cut, "truncated"),
        (&text, "not a GGUF file"),
        (&falcon, "general.architecture = \"falcon\": not supported"),
        (&one_factor, "LongRoPE needs both factor tensors"),
        (
            &wide,
            "blk.0.ffn_up.weight: 256 rows, phi3's gate|up has 512",
        ),
        (
            &pattern,
            "gemma3.attention.sliding_window_pattern = Str(\"x\")",
        ),
    ] {
        let o = common::cockpit()
            .arg("generate")
            .arg(path)
            .args(["--prompt-ids", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

/// A gemma3 file without the keys llama.cpp's converter leaves out (the layer period, the
/// sliding layers' θ, the score scale) reads as llama.cpp reads it: every 6th layer full, θ
/// 10000, 1/√head_dim.
#[test]
fn a_gemma3_file_without_cockpits_keys_reads_as_llama_cpp_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (full, bare) = (tmp.path().join("full.gguf"), tmp.path().join("bare.gguf"));
    export(&fixture("gemma3_text"), &full, "f32");
    let drop = [
        "gemma3.attention.sliding_window_pattern",
        "gemma3.rope.freq_base_swa",
        "gemma3.attention.scale",
    ];
    common::rewrite_gguf(&full, &bare, &[], &drop);
    let dir = cockpit::engine::gguf::load::materialize(&bare).unwrap();
    let c = json(&dir.join("config.json"));
    assert_eq!(c["model_type"], "gemma3_text");
    // 4 layers under a period of 6: all sliding (the 6th would be the first full one)
    assert_eq!(
        c["layer_types"],
        serde_json::json!(vec!["sliding_attention"; 4])
    );
    assert_eq!(c["sliding_window"], 8);
    assert_eq!(c["rope_local_base_freq"], 10000.0);
    assert_eq!(c["query_pre_attn_scalar"], 32.0);
    // and the full file's own values come back as the fixture says them
    let dir = cockpit::engine::gguf::load::materialize(&full).unwrap();
    let c = json(&dir.join("config.json"));
    let types = ["sliding_attention", "full_attention"];
    assert_eq!(c["layer_types"], serde_json::json!([types, types].concat()));
    assert!((c["query_pre_attn_scalar"].as_f64().unwrap() - 24.0).abs() < 1e-4);
}

/// A llama.cpp tensor name's layer and the part after it (`blk.3.ssm_in.weight` → `3`,
/// `ssm_in.weight`); `""` and the whole name outside the layers.
fn layer_part(g: &str) -> (&str, &str) {
    g.strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .unwrap_or(("", g))
}

/// A dense Granite 4.0 hybrid goes out as llama.cpp's `granitehybrid`: the gguf package reads
/// its Mamba sizes, its layer kinds as per-layer kv heads (0: Mamba), NoPE as
/// `rope.scaling.finetuned = false`, Granite's multipliers, and every tensor in llama.cpp's
/// layout (A = −exp(A_log), D and A as `[heads, 1]`, the conv as `[channels, width]`, the gated
/// norm as `[groups, inner / groups]`, the shared MLP's gate|up as ffn_gate and ffn_up).
#[test]
fn a_granite_hybrid_goes_out_as_llama_cpp_writes_it() {
    let dir = fixture("granite_hybrid");
    let cfg = json(&dir.join("config.json"));
    let (m, _, weights) = cockpit::engine::hf::load(&dir).unwrap();
    let Some(r) = read_export(&dir, "f32") else {
        return;
    };
    let (kv, tensors) = (&r["kv"], r["tensors"].as_object().unwrap());
    let k = |s: &str| kv[format!("granitehybrid.{s}")].clone();
    assert_eq!(kv["general.architecture"], "granitehybrid");
    assert_eq!(
        k("attention.head_count_kv"),
        serde_json::json!([0, 2, 0, 0])
    );
    assert_eq!(
        r["types"]["granitehybrid.attention.head_count_kv"],
        "ARRAY/INT32"
    );
    assert_eq!(k("ssm.time_step_rank"), cfg["mamba_n_heads"]);
    assert_eq!(k("ssm.inner_size"), 128);
    assert_eq!(k("ssm.state_size"), cfg["mamba_d_state"]);
    assert_eq!(k("ssm.group_count"), cfg["mamba_n_groups"]);
    assert_eq!(k("ssm.conv_kernel"), cfg["mamba_d_conv"]);
    assert_eq!(k("rope.scaling.finetuned"), false);
    assert_eq!(k("feed_forward_length"), cfg["shared_intermediate_size"]);
    for (key, c) in [
        ("attention.scale", "attention_multiplier"),
        ("embedding_scale", "embedding_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("logit_scale", "logits_scaling"),
    ] {
        assert_eq!(k(key), cfg[c], "{key}");
    }
    let w = |n: &str| weights[n].to_dtype(DType::F32).unwrap();
    for (g, t) in tensors {
        let (l, part) = layer_part(g);
        let at = |p: &str| format!("model.layers.{l}.{p}");
        let mamba = |p: &str| w(&at(&format!("mamba.{p}")));
        let mlp = |from: usize| {
            let t = w(&at("shared_mlp.input_linear.weight"));
            t.narrow(0, from, 128).unwrap()
        };
        let want = match part {
            "ssm_a" => mamba("A_log")
                .exp()
                .unwrap()
                .neg()
                .unwrap()
                .unsqueeze(1)
                .unwrap(),
            "ssm_d" => mamba("D").unsqueeze(1).unwrap(),
            "ssm_conv1d.weight" => mamba("conv1d.weight").squeeze(1).unwrap(),
            "ssm_norm.weight" => mamba("norm.weight").reshape((2, 64)).unwrap(),
            "ssm_in.weight" => mamba("in_proj.weight"),
            "ssm_out.weight" => mamba("out_proj.weight"),
            "ssm_conv1d.bias" => mamba("conv1d.bias"),
            "ssm_dt.bias" => mamba("dt_bias"),
            "ffn_gate.weight" => mlp(0),
            "ffn_up.weight" => mlp(128),
            "ffn_down.weight" => w(&at("shared_mlp.output_linear.weight")),
            // (q/k rows permuted as llama.cpp's converter permutes Granite's)
            "attn_q.weight" => {
                names::permute_rows(&w(&at("self_attn.q_proj.weight")), m.n_head).unwrap()
            }
            "attn_k.weight" => {
                names::permute_rows(&w(&at("self_attn.k_proj.weight")), m.kv_heads()).unwrap()
            }
            _ => w(&names::cockpit_name(g, "granitehybrid").unwrap()),
        };
        assert_stored("granite_hybrid", g, t, &want, "f32");
    }
    let mamba_layers = 3;
    let expect = 2 + 4 * 5 + mamba_layers * 8 + 4;
    assert_eq!(tensors.len(), expect, "{:?}", tensors.keys());
    assert!(!m.tie_embeddings || !tensors.contains_key("output.weight"));
}

/// A Granite 4.0 hybrid with routed experts goes out as llama.cpp's converter writes one: the
/// router as `ffn_gate_inp`, the experts' stacked gates, ups and downs as `ffn_*_exps`, the
/// shared MLP as the shared expert `ffn_*_shexp`, and the expert counts and widths.
#[test]
fn a_granite_hybrid_with_experts_goes_out_as_llama_cpp_writes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = common::granite_moe_without_proj_biases(&tmp.path().join("moe"));
    let cfg = json(&dir.join("config.json"));
    let (_, _, weights) = cockpit::engine::hf::load(&dir).unwrap();
    // (and read back as a model source with cockpit's loss on it)
    let e = json(&fixture("granite_hybrid_moe").join("expected.json"));
    let ids: Vec<u32> = serde_json::from_value(e["ids"].clone()).unwrap();
    let ours = common::next_token_loss(&dir, &ids);
    for (quant, tol) in [("f32", 1e-5), ("q8_0", 2e-2)] {
        let out = tmp.path().join(format!("moe-{quant}.gguf"));
        export(&dir, &out, quant);
        let loss = common::next_token_loss(&out, &ids);
        eprintln!(
            "granite_hybrid_moe {quant}: cockpit on the GGUF {loss:.6}, on the directory {ours:.6}"
        );
        assert!((loss - ours).abs() <= tol, "{quant}: {loss} vs {ours}");
    }
    // the routed experts' proj biases (the fixture's): refused by name
    let o = common::cockpit()
        .arg("export")
        .arg(fixture("granite_hybrid_moe"))
        .arg(tmp.path().join("biased.gguf"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("mamba_proj_bias"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let Some(r) = read_export(&dir, "f32") else {
        return;
    };
    let (kv, tensors) = (&r["kv"], r["tensors"].as_object().unwrap());
    let k = |s: &str| kv[format!("granitehybrid.{s}")].clone();
    assert_eq!(k("expert_count"), cfg["num_local_experts"]);
    assert_eq!(k("expert_used_count"), cfg["num_experts_per_tok"]);
    assert_eq!(k("expert_feed_forward_length"), cfg["intermediate_size"]);
    assert_eq!(
        k("expert_shared_feed_forward_length"),
        cfg["shared_intermediate_size"]
    );
    let ff = cfg["intermediate_size"].as_u64().unwrap() as usize;
    let shared = cfg["shared_intermediate_size"].as_u64().unwrap() as usize;
    let w = |n: &str| weights[n].to_dtype(DType::F32).unwrap();
    let mut seen = 0;
    for (g, t) in tensors {
        let (l, part) = layer_part(g);
        let at = |p: &str| format!("model.layers.{l}.{p}");
        let experts = || w(&at("block_sparse_moe.experts.gate_up_proj"));
        let mlp = || w(&at("shared_mlp.input_linear.weight"));
        let want = match part {
            "ffn_gate_inp.weight" => w(&at("block_sparse_moe.router.weight")),
            "ffn_gate_exps.weight" => experts().narrow(1, 0, ff).unwrap(),
            "ffn_up_exps.weight" => experts().narrow(1, ff, ff).unwrap(),
            "ffn_down_exps.weight" => w(&at("block_sparse_moe.experts.down_proj")),
            "ffn_gate_shexp.weight" => mlp().narrow(0, 0, shared).unwrap(),
            "ffn_up_shexp.weight" => mlp().narrow(0, shared, shared).unwrap(),
            "ffn_down_shexp.weight" => w(&at("shared_mlp.output_linear.weight")),
            _ => continue,
        };
        assert_stored("granite_hybrid_moe", g, t, &want, "f32");
        seen += 1;
    }
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    assert_eq!(seen, 7 * layers, "{:?}", tensors.keys());
    for dense in ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"] {
        assert!(!tensors.contains_key(&format!("blk.0.{dense}")), "{dense}");
    }
}

/// The Hugging Face directory a GGUF file is read through is a cache of the model's whole
/// weights: once its file is gone, or rewritten, the next file read removes it.
#[test]
fn caches_of_gone_or_rewritten_files_are_removed() {
    use cockpit::engine::gguf::load::materialize;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a.gguf"), tmp.path().join("b.gguf"));
    export(&fixture("llama3"), &a, "f32");
    export(&fixture("llama3"), &b, "f32");
    let da = materialize(&a).unwrap();
    let db = materialize(&b).unwrap();
    assert!(da.is_dir() && db.is_dir() && da != db);
    // b rewritten (another size: a new cache), a removed: both old caches go.
    std::fs::remove_file(&a).unwrap();
    export(&fixture("llama3"), &b, "q8_0");
    let db2 = materialize(&b).unwrap();
    assert!(db2.join("config.json").is_file());
    assert!(!da.exists(), "{} outlived its file", da.display());
    assert!(!db.exists(), "{} outlived its file's rewrite", db.display());
}
