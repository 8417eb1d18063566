//! What the integration tests share: the small CPU model every engine test trains, the engine
//! spawned on it, the `cockpit` binary, a port for a rendezvous, and waiting for a condition
//! (tests poll for what they need; they never sleep a fixed time and hope).
//!
//! Each test crate uses part of this module; the rest would be dead code there.
#![allow(dead_code)]

use cockpit::config::{self, Config};
use cockpit::engine::{Engine, EngineOptions};
use cockpit::util::DeviceSpec;
use std::path::Path;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// The small model of the engine tests: two layers of 32 wide on a 200k-token built-in corpus,
/// micro-batches of 8 × 32 tokens, no warm-up, no evaluation or checkpoints on the way (each
/// test turns on what it checks).
pub const SMALL: &[&str] = &[
    "model.n_embd=32",
    "model.seq_len=32",
    "optim.micro_batch=8",
    "data.builtin_tokens=200000",
    "schedule.warmup_steps=0",
    "eval.every=0",
    "checkpoint.every_steps=0",
];

/// [`SMALL`] with `extra` overrides after it (later keys win).
pub fn small(extra: &[&str]) -> Config {
    let o: Vec<String> = SMALL.iter().chain(extra).map(|s| s.to_string()).collect();
    config::load(None, &o)
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

/// The engine on the CPU in `dir`, with a queue deep enough that no test drops a step event.
pub fn spawn(cfg: Config, dir: &Path) -> Engine {
    Engine::spawn(EngineOptions {
        max_queued_steps: 100_000,
        ..EngineOptions::new(cfg, dir.to_path_buf(), DeviceSpec::Cpu)
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The `cockpit` binary the end-to-end tests run.
pub fn cockpit() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("cockpit").unwrap_or_else(|e| panic!("{e}"))
}

/// A TCP port for a rendezvous that no other test takes: below Linux's ephemeral range
/// (32768-60999), so no outgoing connection is ever given it; a block of 16 per process by its
/// PID, handed out in turn within the process; and free when handed out (checked by binding it).
pub fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let block = 20_000 + (std::process::id() % 750) as u16 * 16;
    loop {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = block + i % 16;
        assert!(i < 16 * 64, "no free port in {block}..{}", block + 16);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Polls `cond` every 20 ms until it holds; fails the test naming `what` after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run the reader script `tests/<dir>/<script>` with `python` and parse the JSON it prints.
/// None, with a visible SKIPPED line, where the interpreter cannot run or the script exits 3
/// (a Python package it needs is absent); any other failure fails the test.
pub fn python_json<S: AsRef<std::ffi::OsStr>>(
    python: &str,
    dir: &str,
    script: &str,
    args: &[S],
) -> Option<serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(dir)
        .join(script);
    let out = match std::process::Command::new(python)
        .arg(&path)
        .args(args)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED {script}: {python} not runnable: {e}");
            return None;
        }
    };
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        eprintln!("SKIPPED {script}: {}", err.trim());
        return None;
    }
    assert!(out.status.success(), "{script} failed: {err}");
    Some(serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script}: {e}: {err}")))
}

/// Every Hugging Face fixture under tests/fixtures/hf (made by scripts/hf_fixtures.py).
pub const HF_FIXTURES: &[&str] = &[
    "llama2",
    "llama3",
    "mistral",
    "qwen2",
    "gpt2",
    "granite",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma3_text",
    "gemma3",
    "gemma2",
    "phi3_longrope",
    "granite_hybrid",
    "granite_hybrid_moe",
];

/// cockpit's mean next-token loss in nats of `ids` under the model at `src` (a Hugging Face dir,
/// a run or a GGUF file; f32, CPU).
pub fn next_token_loss(src: &Path, ids: &[u32]) -> f64 {
    use candle_core::{DType, Device, Tensor, D};
    use cockpit::engine::base;
    let b = base::load(src).unwrap_or_else(|e| panic!("{e}"));
    let run = config::ModelConfig {
        seq_len: ids.len(),
        ..config::ModelConfig::default()
    };
    let m = base::resolve_model(&b.meta, &run, "model.init_from").unwrap();
    let mut model = base::build(&b, &m, DType::F32, &Device::Cpu, "model.init_from").unwrap();
    let n = ids.len() - 1;
    let x = Tensor::from_vec(ids[..n].to_vec(), (1, n), &Device::Cpu).unwrap();
    let logits = model.forward(&x, false).unwrap();
    let lp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let lp: Vec<Vec<f32>> = lp.squeeze(0).unwrap().to_vec2().unwrap();
    -(0..n)
        .map(|i| lp[i][ids[i + 1] as usize] as f64)
        .sum::<f64>()
        / n as f64
}

/// `src` written again at `dst` (every tensor as F32) with the keys of `set` replaced or
/// added and the keys and tensors `drop` names left out.
pub fn rewrite_gguf(
    src: &Path,
    dst: &Path,
    set: &[(&str, cockpit::engine::gguf::writer::Value)],
    drop: &[&str],
) {
    use cockpit::engine::gguf::quant::{self, GgmlType};
    use cockpit::engine::gguf::reader::{Gguf, Meta};
    use cockpit::engine::gguf::writer::{self, Value};
    let g = Gguf::parse(std::fs::read(src).unwrap()).unwrap();
    let value = |m: &Meta| match m {
        Meta::Int(i) => Value::U32(*i as u32),
        Meta::Float(f) => Value::F32(*f as f32),
        Meta::Bool(b) => Value::Bool(*b),
        Meta::Str(s) => Value::Str(s.clone()),
        Meta::Array(a) => match a.first() {
            Some(Meta::Str(_)) => {
                Value::Strs(a.iter().map(|m| m.as_str().unwrap().into()).collect())
            }
            Some(Meta::Float(_)) => {
                Value::F32s(a.iter().map(|m| m.as_f64().unwrap() as f32).collect())
            }
            Some(Meta::Bool(_)) => Value::Bools(a.iter().map(|m| *m == Meta::Bool(true)).collect()),
            _ => Value::I32s(a.iter().map(|m| m.as_f64().unwrap() as i32).collect()),
        },
    };
    let new = |k: &str| set.iter().find(|(s, _)| *s == k).map(|(_, v)| v.clone());
    let mut kv: Vec<(String, Value)> = g
        .meta
        .iter()
        .filter(|(k, _)| !drop.contains(&k.as_str()))
        .map(|(k, m)| (k.clone(), new(k).unwrap_or_else(|| value(m))))
        .collect();
    for (k, v) in set {
        if !g.meta.contains_key(*k) {
            kv.push((k.to_string(), v.clone()));
        }
    }
    let tensors: Vec<writer::TensorData> = g
        .tensors
        .iter()
        .filter(|t| !drop.contains(&t.name.as_str()))
        .map(|t| writer::TensorData {
            name: t.name.clone(),
            shape: t.shape.clone(),
            ty: GgmlType::F32,
            bytes: quant::encode(&g.decode(t).unwrap(), GgmlType::F32),
        })
        .collect();
    writer::write(dst, &kv, &tensors).unwrap();
}

/// The granite_hybrid_moe fixture without its Mamba in_proj/out_proj biases (which llama.cpp's
/// `granitehybrid` cannot hold), in `dir`: another model than transformers' fixture, whose
/// loss cockpit gives (`next_token_loss` on `dir`), for tests of the GGUF format with experts.
pub fn granite_moe_without_proj_biases(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/granite_hybrid_moe");
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let p = f.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let st = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    t.retain(|k, _| !(k.contains(".mamba.in_proj.bias") || k.contains(".mamba.out_proj.bias")));
    candle_core::safetensors::save(&t, &st).unwrap();
    let cp = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
    c["mamba_proj_bias"] = false.into();
    std::fs::write(&cp, c.to_string()).unwrap();
    dir.to_path_buf()
}
