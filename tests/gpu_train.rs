//! fp16 with dynamic loss scaling on the whole-model step, end to end on the GPU: the embedded
//! default trained 300 steps in fp16 follows the bf16 run of the same seed, on the fast step
//! (no per-op fallback), and an injected non-finite step is skipped exactly once with the loss
//! scale halved. Needs `--features cuda` and a GPU (compute capability 7.5 and up); passes with
//! a notice without one. (That the step computes the f32 model's loss and gradients in fp16 is
//! tests/gpu_kernels.rs.)
#![cfg(feature = "cuda")]

use cockpit::config;
use cockpit::engine::events::{Event, StepStats};
use cockpit::engine::faults::Faults;
use cockpit::engine::{Engine, EngineOptions};
use cockpit::util::DeviceSpec;
use std::time::Duration;

const STEPS: u64 = 300;
/// Steps per window of the loss comparison.
const WINDOW: usize = 50;
/// The fp16 run's mean loss per window stays within this fraction of the bf16 run's.
const BAND: f64 = 0.03;

struct Run {
    steps: Vec<StepStats>,
    warnings: Vec<String>,
}

fn train(dtype: &str, nan_steps: Vec<u64>) -> Option<Run> {
    if candle_core::Device::new_cuda(0).is_err() {
        eprintln!("no CUDA device: skipped");
        return None;
    }
    let o: Vec<String> = [
        format!("precision.dtype=\"{dtype}\""),
        format!("run.max_steps={STEPS}"),
        "run.device=\"cuda\"".into(),
        "eval.every=0".into(),
        "eval.at_end=false".into(),
        "checkpoint.every_steps=0".into(),
        "checkpoint.at_end=false".into(),
    ]
    .to_vec();
    let cfg = config::load(None, &o)
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let e = Engine::spawn(EngineOptions {
        max_queued_steps: 100_000,
        faults: Faults {
            nan_steps,
            ..Faults::default()
        },
        ..EngineOptions::new(cfg, dir.path().to_path_buf(), DeviceSpec::Cuda(0))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let mut run = Run {
        steps: Vec::new(),
        warnings: Vec::new(),
    };
    loop {
        match e
            .events
            .recv_timeout(Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("no event: {e:?}"))
        {
            Event::Step(s) => run.steps.push(s),
            Event::Warning { message, .. } => run.warnings.push(message),
            Event::Finished { .. } => break,
            _ => {}
        }
    }
    e.thread.wait().unwrap_or_else(|e| panic!("{e}"));
    Some(run)
}

fn on_the_fast_step(what: &str, r: &Run) {
    assert!(
        !r.warnings.iter().any(|w| w.contains("per-op")),
        "{what} left the whole-model step: {:?}",
        r.warnings
    );
}

#[test]
fn fp16_follows_bf16_on_the_fast_step_and_skips_one_overflow() {
    let Some(bf16) = train("bf16", Vec::new()) else {
        return;
    };
    let Some(f16) = train("f16", Vec::new()) else {
        return;
    };
    // (On compute_75 kernels — a T4, or `COCKPIT_KERNELS=sm75` — the step runs fp16 only:
    // the bf16 reference then trains on the per-op path.)
    let dev = candle_core::Device::new_cuda(0).unwrap_or_else(|e| panic!("{e}"));
    if cockpit::engine::kernels::step_support(&dev, candle_core::DType::BF16).is_ok() {
        on_the_fast_step("bf16", &bf16);
    }
    on_the_fast_step("f16", &f16);
    assert_eq!(bf16.steps.len(), STEPS as usize);
    assert_eq!(f16.steps.len(), STEPS as usize);
    assert!(
        f16.warnings.iter().all(|w| !w.contains("skipped")),
        "a clean fp16 run skipped steps: {:?}",
        f16.warnings
    );
    let mean = |s: &[StepStats]| s.iter().map(|s| s.loss).sum::<f64>() / s.len() as f64;
    for (i, (a, b)) in bf16
        .steps
        .chunks(WINDOW)
        .zip(f16.steps.chunks(WINDOW))
        .enumerate()
    {
        let (a, b) = (mean(a), mean(b));
        let off = (b - a).abs() / a;
        eprintln!(
            "steps {}–{}: mean loss bf16 {a:.4}, f16 {b:.4} ({:.2}% apart)",
            i * WINDOW + 1,
            (i + 1) * WINDOW,
            off * 100.0
        );
        assert!(off <= BAND, "fp16 {b:.4} vs bf16 {a:.4} at window {i}");
    }
    let first = f16.steps[0].loss;
    let last = mean(&f16.steps[f16.steps.len() - WINDOW..]);
    assert!(last < 0.8 * first, "fp16 did not learn: {first} → {last}");
    let tps = |r: &Run| {
        let mut v: Vec<f64> = r.steps[50..].iter().map(|s| s.tokens_per_sec).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "median tokens/s: bf16 {:.0}, f16 {:.0}",
        tps(&bf16),
        tps(&f16)
    );

    // A non-finite step (as an fp16 overflow makes): skipped once, the scale halved, and the
    // run goes on to the end.
    let Some(hit) = train("f16", vec![100]) else {
        return;
    };
    on_the_fast_step("f16 with an overflow", &hit);
    let skipped: Vec<&String> = hit
        .warnings
        .iter()
        .filter(|w| w.contains("skipped"))
        .collect();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(
        skipped[0].contains("step 100 skipped") && skipped[0].contains("loss scale now 32768"),
        "{}",
        skipped[0]
    );
    assert_eq!(hit.steps.len(), STEPS as usize);
    let last_hit = mean(&hit.steps[hit.steps.len() - WINDOW..]);
    assert!(
        (last_hit - last).abs() / last <= BAND,
        "after the skipped step: {last_hit} vs {last}"
    );
}
