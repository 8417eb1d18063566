//! Hugging Face models in and out, checked against transformers: the fixtures under
//! tests/fixtures/hf/ (made by scripts/hf_fixtures.py) hold tiny trained models of every
//! supported model_type with transformers' per-token log-probabilities and greedy tokens.

use candle_core::{DType, Device, Tensor, D};
use cockpit::config::ModelConfig;
use cockpit::engine::base;
use cockpit::engine::model::Model;
use std::path::{Path, PathBuf};

const FIXTURES: &[&str] = &["llama2", "llama3", "mistral", "qwen2", "gpt2", "granite"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

struct Expected {
    ids: Vec<u32>,
    logprobs: Vec<f64>,
    loss: f64,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn expected(dir: &Path) -> Expected {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        ids: ids("ids"),
        logprobs: v["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        loss: v["loss"].as_f64().unwrap(),
        prompt: ids("prompt_ids"),
        greedy: ids("greedy"),
    }
}

/// The fixture's model (f32, CPU) with seq_len = the fixed sequence's length.
fn load(dir: &Path, seq_len: usize) -> Model {
    let b = base::load(dir).unwrap_or_else(|e| panic!("{e}"));
    let run = ModelConfig {
        seq_len,
        ..ModelConfig::default()
    };
    let m = base::resolve_model(&b.meta, &run, "model.init_from").unwrap();
    base::build(&b, &m, DType::F32, &Device::Cpu, "model.init_from")
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Per-token log-probabilities of ids[1..] under the model.
fn logprobs(model: &mut Model, ids: &[u32]) -> Vec<f64> {
    let n = ids.len() - 1;
    let x = Tensor::from_vec(ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
    let logits = model.forward(&x, false).unwrap();
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32).unwrap(), D::Minus1).unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    (0..n).map(|i| lp[i][ids[i + 1] as usize] as f64).collect()
}

#[test]
fn every_model_type_computes_what_transformers_computes() {
    for name in FIXTURES {
        let dir = fixture(name);
        let e = expected(&dir);
        let mut model = load(&dir, e.ids.len() - 1);
        let lp = logprobs(&mut model, &e.ids);
        let loss = -lp.iter().sum::<f64>() / lp.len() as f64;
        let worst = lp
            .iter()
            .zip(&e.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{name}: loss {loss:.6} vs transformers {:.6}; worst token {worst:.2e}",
            e.loss
        );
        assert!(
            (loss - e.loss).abs() < 1e-4,
            "{name}: loss {loss} vs {}",
            e.loss
        );
        assert!(worst < 1e-3, "{name}: a token's log-prob is {worst} off");
    }
}
