//! `cockpit check`: what this machine has, and what cockpit would use on it.

use crate::engine::{device, precision};
use crate::util::gb;

fn os_name() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        });
    format!(
        "{} ({} {})",
        pretty.unwrap_or_else(|| std::env::consts::OS.to_string()),
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

/// ", driver 580.95, CUDA 13.0" from NVML, or nothing when it cannot tell.
fn driver_versions() -> String {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return String::new();
    };
    let driver = nvml
        .sys_driver_version()
        .map(|v| format!(", driver {v}"))
        .unwrap_or_default();
    let cuda = nvml
        .sys_cuda_driver_version()
        .map(|v| format!(", CUDA {}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_default();
    format!("{driver}{cuda}")
}

/// Whether the whole-model CUDA step runs GPT-2 124M- and Llama-shaped models on this GPU in
/// `dtype`, and why not ([`crate::engine::spec::ModelSpec::fast_step_support`]).
fn step_lines(dev: &candle_core::Device, dtype: candle_core::DType) {
    use crate::config::{Config, ModelConfig};
    use crate::engine::model::{step_facts, ModelSpec};
    let gpt2 = ModelConfig {
        n_layer: 12,
        n_head: 12,
        n_embd: 768,
        ..ModelConfig::default()
    };
    let llama = ModelConfig {
        n_layer: 16,
        n_head: 32,
        n_kv_head: 8,
        n_embd: 2048,
        ..ModelConfig::llama_family()
    };
    for (name, m) in [("GPT-2 124M", gpt2), ("Llama 1B", llama)] {
        let c = Config {
            model: m,
            ..Config::default()
        };
        let spec = ModelSpec::from_config(&c, 50304);
        let verdict = match spec.fast_step_support(&step_facts(dev, dtype, &spec, false)) {
            Ok(()) => "whole-model CUDA step".to_string(),
            Err(why) => format!("per-op path: {why}"),
        };
        println!("  step      {name}-shaped: {verdict}");
    }
}

pub fn run() -> anyhow::Result<i32> {
    let snap = crate::telemetry::sample_once();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    crate::outln!(
        "cockpit {} — requirements report",
        env!("CARGO_PKG_VERSION")
    );
    crate::outln!("  OS        {}", os_name());
    crate::outln!("  CPU       {cores} cores available");
    let h = &snap.host;
    crate::outln!(
        "  RAM       {} GB total, {} GB in use",
        gb(h.ram_total_bytes),
        gb(h.ram_used_bytes)
    );
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("nccl", cfg!(feature = "nccl")),
    ]
    .iter()
    .filter(|(_, on)| *on)
    .map(|(n, _)| *n)
    .collect();
    crate::outln!(
        "  features  cpu engine, tui, nvml telemetry{}",
        features
            .iter()
            .map(|f| format!(", {f}"))
            .collect::<String>()
    );
    let mut missing = Vec::new();

    // NVML: what the driver reports (works without the cuda feature).
    match &snap.gpu_notice {
        Some(n) if snap.gpus.is_empty() => {
            crate::outln!("  NVML      unavailable: {n}");
            missing.push("GPU telemetry: install the NVIDIA driver (it ships libnvidia-ml.so.1) on a machine with an NVIDIA GPU".to_string());
        }
        _ => {
            crate::outln!(
                "  NVML      ok, {} GPU(s){}",
                snap.gpus.len(),
                driver_versions()
            );
            for g in &snap.gpus {
                let cc = g
                    .compute_capability
                    .map(|(a, b)| format!("sm_{a}{b}"))
                    .unwrap_or_else(|| "sm_?".into());
                let dtype = precision::choose(crate::config::DType::Auto, g.compute_capability)
                    .map(|(d, _)| precision::dtype_name(d))
                    .unwrap_or("f32");
                crate::outln!(
                    "    GPU{} {} | {cc} | {} GB | would train in {dtype}",
                    g.index,
                    g.name,
                    gb(g.mem_total_bytes)
                );
            }
        }
    }

    // CUDA through candle (only in a cuda build).
    if cfg!(feature = "cuda") {
        match device::open(crate::util::DeviceSpec::Cuda(0)) {
            Ok(dev) => {
                let cc = device::compute_capability(&dev);
                let (dtype, why) = precision::choose(crate::config::DType::Auto, cc)
                    .unwrap_or((candle_core::DType::F32, "fp32".into()));
                crate::outln!(
                    "  CUDA      {} | dtype {} — {why}",
                    device::describe(&dev),
                    precision::dtype_name(dtype)
                );
                if let Some(note) = crate::engine::kernels::build_note(&dev) {
                    crate::outln!("            {note}");
                }
                step_lines(&dev, dtype);
            }
            Err(e) => {
                crate::outln!("  CUDA      built in, but no usable device: {e}");
                missing.push("a CUDA device: check `nvidia-smi` and the driver".into());
            }
        }
    } else {
        crate::outln!("  CUDA      not built in: training runs on the CPU in fp32");
        missing.push("GPU training: rebuild with `cargo build --release --features cuda` (needs the CUDA toolkit, nvcc on PATH)".into());
    }
    let (dtype, why) = precision::choose(crate::config::DType::Auto, None)
        .unwrap_or((candle_core::DType::F32, String::new()));
    if !cfg!(feature = "cuda") {
        crate::outln!("  dtype     {} — {why}", precision::dtype_name(dtype));
    }
    if missing.is_empty() {
        crate::outln!("\nall set.");
    } else {
        crate::outln!("\nmissing:");
        for m in missing {
            crate::outln!("  - {m}");
        }
    }
    Ok(0)
}
