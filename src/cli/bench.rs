//! `cockpit bench CONFIG`: the training step's speed on this machine, measured the way the
//! PyTorch reference (`benches/torch_reference.py`) measures it — warm-up steps first, then
//! the median over the second half of the timed steps; tokens/s, the ms/step breakdown, MFU
//! and peak memory. Evaluation, checkpoints and the monitor are off; everything else (data
//! prefetch, SCU measurement when enabled) runs as in training.

use super::bench_rates::{AttentionRate, MambaRate};
use super::{config_error, fit, EXIT_FAILURE, EXIT_OK};
use crate::config;
use crate::engine::events::{Event, KernelTime, RunInfo, StepStats};
use crate::engine::{Engine, EngineOptions};
use anyhow::Context;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What one benchmark measured (also written as JSON with `--json`).
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub system: &'static str,
    pub device: String,
    pub dtype: String,
    pub batch: usize,
    pub accum: usize,
    pub seq: usize,
    pub params: u64,
    pub warmup: u64,
    pub steps: u64,
    pub ms_per_step_median: f64,
    pub compute_ms_median: f64,
    pub optim_ms_median: f64,
    pub data_wait_ms_median: f64,
    /// Data parallel: the ranks, and the time the step spent in communication after the
    /// backward (what the step does not hide).
    pub ranks: usize,
    pub comm_ms_median: f64,
    pub tokens_per_sec: f64,
    pub mfu: Option<f64>,
    pub peak_mem_gb: Option<f64>,
    pub loss_first: f64,
    pub loss_last: f64,
    /// With `--profile`: GPU ms per step by kernel group (mean over the timed steps).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<KernelTime>,
    /// With `--profile`: the flash kernels' achieved rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionRate>,
    /// With `--profile` on a hybrid: the Mamba mixer's time a layer and chunk products' rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mamba: Option<MambaRate>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Summarize timed steps (warm-up already dropped): medians over their second half.
pub fn summarize(info: &RunInfo, warmup: u64, timed: &[StepStats]) -> BenchReport {
    let half = &timed[timed.len() / 2..];
    let med = |f: fn(&StepStats) -> f64| median(half.iter().map(f).collect());
    let ms = med(|s| s.step_ms);
    // (A data-parallel step carries every rank's figures: the job's batch is theirs summed.)
    let ranks = timed.last().map_or(1, |s| s.ranks.len().max(1));
    let tokens_per_step = (info.seq_len
        * timed.last().map_or(info.micro_batch, |s| s.micro_batch)
        * info.accum
        * ranks) as f64;
    let tokens_per_sec = tokens_per_step / (ms / 1e3);
    let peak = timed.iter().filter_map(|s| s.memory_bytes).max();
    let kernels = mean_kernels(timed);
    let micro_batch = timed.last().map_or(info.micro_batch, |s| s.micro_batch);
    let attention = info
        .attention_flops_fwd
        .and_then(|f| AttentionRate::of(&kernels, f * micro_batch as f64));
    let mamba = info
        .mamba_flops
        .and_then(|f| MambaRate::of(&kernels, &f.times(micro_batch as f64)));
    BenchReport {
        system: "cockpit",
        device: info.device.clone(),
        dtype: info.dtype.clone(),
        batch: info.micro_batch,
        accum: info.accum,
        seq: info.seq_len,
        params: info.params_trainable,
        warmup,
        steps: timed.len() as u64,
        ms_per_step_median: ms,
        compute_ms_median: med(|s| s.compute_ms),
        optim_ms_median: med(|s| s.optim_ms),
        data_wait_ms_median: med(|s| s.data_wait_ms),
        ranks,
        comm_ms_median: med(|s| s.comm_ms),
        tokens_per_sec,
        mfu: info
            .peak_flops
            .map(|p| info.flops_per_token * tokens_per_sec / p),
        peak_mem_gb: peak.map(|b| b as f64 / 1e9),
        loss_first: timed.first().map_or(f64::NAN, |s| s.loss),
        loss_last: timed.last().map_or(f64::NAN, |s| s.loss),
        kernels,
        attention,
        mamba,
    }
}

/// Per kernel group: GPU ms and launches per step, averaged over the steps that carry them.
fn mean_kernels(timed: &[StepStats]) -> Vec<KernelTime> {
    let with: Vec<&StepStats> = timed.iter().filter(|s| !s.kernels.is_empty()).collect();
    let mut out: Vec<KernelTime> = Vec::new();
    for s in &with {
        for k in &s.kernels {
            match out.iter_mut().find(|o| o.name == k.name) {
                Some(o) => {
                    o.ms += k.ms;
                    o.launches += k.launches;
                }
                None => out.push(k.clone()),
            }
        }
    }
    let n = with.len().max(1);
    for o in &mut out {
        o.ms /= n as f64;
        o.launches /= n as u32;
    }
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cockpit | {} {} | B{}×{} T{} | {:.1} ms/step (compute {:.1}, optim {:.1}, data wait {:.2}) | {:.1}k tok/s",
            self.device,
            self.dtype,
            self.batch,
            self.accum,
            self.seq,
            self.ms_per_step_median,
            self.compute_ms_median,
            self.optim_ms_median,
            self.data_wait_ms_median,
            self.tokens_per_sec / 1e3
        )?;
        if self.ranks > 1 {
            write!(
                f,
                " | {} ranks, comm not hidden {:.2} ms/step",
                self.ranks, self.comm_ms_median
            )?;
        }
        if let Some(m) = self.mfu {
            write!(f, " | MFU {:.1}%", m * 100.0)?;
        }
        if let Some(g) = self.peak_mem_gb {
            write!(f, " | peak {g:.1} GB")?;
        }
        write!(f, " | loss {:.3} -> {:.3}", self.loss_first, self.loss_last)?;
        if !self.kernels.is_empty() {
            let total: f64 = self.kernels.iter().map(|k| k.ms).sum();
            write!(
                f,
                "\nGPU time per step by kernel group ({total:.2} ms in all):"
            )?;
            for k in &self.kernels {
                write!(
                    f,
                    "\n  {:<26} {:>7.2} ms {:>5.1}% {:>5} launches",
                    k.name,
                    k.ms,
                    100.0 * k.ms / total.max(1e-9),
                    k.launches
                )?;
            }
        }
        if let Some(a) = &self.attention {
            let rate = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.0}"));
            write!(
                f,
                "\nflash attention: forward {} TFLOP/s ({:.2} ms, {} launches), backward {} TFLOP/s ({:.2} ms, {} launches)",
                rate(a.fwd_tflops),
                a.fwd_ms,
                a.fwd_launches,
                rate(a.bwd_tflops),
                a.bwd_ms,
                a.bwd_launches
            )?;
        }
        if let Some(m) = &self.mamba {
            write!(
                f,
                "\nMamba-2 mixer: {:.2} ms a layer and micro-batch, forward and backward (flash attention {}); chunk products {} TFLOP/s ({:.2} ms)",
                m.layer_ms,
                m.attention_layer_ms
                    .map_or("-".to_string(), |a| format!("{a:.2} ms a layer")),
                m.chunk_tflops.map_or("-".to_string(), |t| format!("{t:.0}")),
                m.chunk_ms
            )?;
        }
        Ok(())
    }
}

pub struct BenchArgs<'a> {
    pub config: Option<&'a Path>,
    pub set: &'a [String],
    pub steps: u64,
    pub warmup: u64,
    pub device: Option<&'a str>,
    pub json: Option<&'a Path>,
    pub profile: bool,
    /// Judge memory growth over the timed steps (`--soak`): exit 1 on a leak.
    pub soak: bool,
    /// Search the largest micro-batch that fits (`--find-batch`) instead of timing.
    pub find_batch: bool,
    /// Worker processes (`--gpus`): above 1, a data-parallel job on this machine's GPUs.
    pub gpus: usize,
}

/// A soak's verdict on one memory series.
#[derive(Debug, Serialize)]
pub struct SoakReport {
    /// "host RSS" or "device memory".
    pub what: &'static str,
    pub from_bytes: u64,
    pub from_step: u64,
    pub to_bytes: u64,
    pub to_step: u64,
    pub bytes_per_step: f64,
    /// Fitted growth over the judged steps, and the most that is not a leak.
    pub growth_bytes: f64,
    pub limit_bytes: f64,
    pub leak: bool,
}

/// Least growth over a soak that counts as a leak: 3% of the memory after the warm-up, and at
/// least 4 MiB (allocator noise).
const SOAK_MIN_FRAC: f64 = 0.03;
const SOAK_MIN_BYTES: f64 = 4.0 * 1024.0 * 1024.0;

/// The memory of a soak's steps, thinned to at most [`MemoryTrace::MAX`] points (every
/// other one dropped when full) so that what the bench keeps does not grow with the steps.
#[derive(Default)]
pub struct MemoryTrace {
    host: Vec<(u64, u64)>,
    device: Vec<(u64, u64)>,
    stride: u64,
    seen: u64,
}

impl MemoryTrace {
    const MAX: usize = 2048;

    pub fn push(&mut self, s: &StepStats, device_is_gpu: bool) {
        self.stride = self.stride.max(1);
        self.seen += 1;
        if !(self.seen - 1).is_multiple_of(self.stride) {
            return;
        }
        if let Some(b) = s.host_rss_bytes {
            self.host.push((s.step, b));
        }
        if let Some(b) = s.memory_bytes.filter(|_| device_is_gpu) {
            self.device.push((s.step, b));
        }
        if self.host.len().max(self.device.len()) >= Self::MAX {
            for v in [&mut self.host, &mut self.device] {
                let kept: Vec<(u64, u64)> = v.iter().copied().step_by(2).collect();
                *v = kept;
            }
            self.stride *= 2;
        }
    }
}

/// Judge the host RSS and, on a GPU, the device memory of the timed steps.
pub fn soak(warmup: u64, trace: &MemoryTrace) -> Vec<SoakReport> {
    let min_points = (trace.host.len().max(trace.device.len()) / 2).clamp(2, 50);
    [("host RSS", &trace.host), ("device memory", &trace.device)]
        .into_iter()
        .filter_map(|(what, series)| {
            let c = crate::advisor::trend::judge(
                series,
                warmup,
                min_points,
                SOAK_MIN_BYTES,
                SOAK_MIN_FRAC,
            )?;
            Some(SoakReport {
                what,
                from_bytes: c.from.1,
                from_step: c.from.0,
                to_bytes: c.to.1,
                to_step: c.to.0,
                bytes_per_step: c.per_step,
                growth_bytes: c.growth,
                limit_bytes: c.growth / c.ratio,
                leak: c.ratio >= 1.0,
            })
        })
        .collect()
}

impl std::fmt::Display for SoakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: f64| b / 1e6;
        write!(
            f,
            "soak | {} {:.1} MB at step {} -> {:.1} MB at step {} | {:+.1} KB/step, {:+.1} MB fitted over {} steps (a leak: > {:.1} MB) | {}",
            self.what,
            mb(self.from_bytes as f64),
            self.from_step,
            mb(self.to_bytes as f64),
            self.to_step,
            self.bytes_per_step / 1e3,
            mb(self.growth_bytes),
            self.to_step - self.from_step,
            mb(self.limit_bytes),
            if self.leak { "LEAK" } else { "flat" }
        )
    }
}

pub fn run(a: BenchArgs) -> anyhow::Result<i32> {
    super::log_to_stderr();
    if a.steps == 0 {
        crate::errln!("cockpit bench: --steps 0: time at least 1 step");
        return Ok(super::EXIT_USAGE);
    }
    let total = a.warmup + a.steps;
    let mut overrides = a.set.to_vec();
    overrides.extend([
        format!("run.max_steps={total}"),
        // Constant LR, as in the reference script: the schedule does not change speed.
        "schedule.kind=\"constant\"".into(),
        "schedule.warmup_steps=0".into(),
        "eval.every=0".into(),
        "eval.at_end=false".into(),
        "checkpoint.every_steps=0".into(),
        "checkpoint.every_minutes=0".into(),
        "checkpoint.at_end=false".into(),
        "monitor.enabled=false".into(),
        "run.log_every_secs=3600".into(),
    ]);
    let mut flags = super::flag_sets::FlagSets::default();
    if let Some(d) = a.device {
        flags.push_str(&mut overrides, "--device", "run.device", d);
    }
    let loaded = match config::load(a.config, &overrides) {
        Ok(l) => l,
        Err(e) => return Ok(config_error(&flags.blame(e))),
    };
    let mut cfg = loaded.config;
    let device =
        crate::util::parse_device(&cfg.run.device).unwrap_or(crate::util::DeviceSpec::Auto);
    if a.find_batch {
        return find_batch(&cfg, device);
    }
    if a.gpus > 1 {
        return data_parallel(&a, overrides);
    }
    if let Err(code) = fit::resolve_auto(&mut cfg, device, None, false) {
        return Ok(code);
    }
    let run_dir: PathBuf =
        std::env::temp_dir().join(format!("cockpit-bench-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating the scratch run dir {}", run_dir.display()))?;
    let engine = Engine::spawn(EngineOptions {
        profile_kernels: a.profile,
        ..EngineOptions::new(cfg, run_dir.clone(), device)
    })?;
    let (mut info, mut steps) = (None::<RunInfo>, Vec::new());
    let mut trace = MemoryTrace::default();
    let failure = fit::drain(&engine, |ev| match ev {
        Event::RunStarted(i) => info = Some(i),
        Event::Step(s) if s.step > a.warmup => {
            if a.soak {
                let gpu = info.as_ref().is_some_and(|i| i.device.starts_with("cuda"));
                trace.push(&s, gpu);
                // A soak judges the bench's own memory too: keep the first timed step
                // and the latest ones only, so the record does not grow with the steps.
                if steps.len() >= 512 {
                    steps.drain(1..257);
                }
            }
            steps.push(s);
        }
        Event::Warning { message, .. } => crate::errln!("cockpit bench: {message}"),
        _ => {}
    });
    let joined = engine.thread.wait();
    let _ = std::fs::remove_dir_all(&run_dir);
    joined?;
    if let Some(m) = failure {
        crate::errln!("cockpit bench: the run did not complete: {m}");
        return Ok(EXIT_FAILURE);
    }
    let (Some(info), false) = (info, steps.is_empty()) else {
        crate::errln!(
            "cockpit bench: no timed steps (warm-up {} of {total})",
            a.warmup
        );
        return Ok(EXIT_FAILURE);
    };
    let report = summarize(&info, a.warmup, &steps);
    crate::outln!("{report}");
    let soaked = if a.soak {
        soak(a.warmup, &trace)
    } else {
        Vec::new()
    };
    for s in &soaked {
        crate::outln!("{s}");
    }
    if let Some(p) = a.json {
        let mut value = serde_json::to_value(&report)?;
        if a.soak {
            value["soak"] = serde_json::to_value(&soaked)?;
        }
        let text = serde_json::to_string_pretty(&value)?;
        std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    if a.soak && soaked.is_empty() {
        crate::errln!(
            "cockpit bench: --soak: too few steps after the warm-up to judge memory (at least {} needed)",
            crate::advisor::trend::WARMUP_STEPS + 2
        );
        return Ok(EXIT_FAILURE);
    }
    if soaked.iter().any(|s| s.leak) {
        crate::errln!("cockpit bench: memory grows step after step: a leak (see the soak lines)");
        return Ok(EXIT_FAILURE);
    }
    Ok(EXIT_OK)
}

/// `cockpit bench --gpus N`: the job runs as `cockpit train --gpus N` would (the launcher, a
/// worker per GPU, headless) in a scratch run dir; the report comes from rank 0's step events,
/// which carry every rank's timings.
fn data_parallel(a: &BenchArgs, overrides: Vec<String>) -> anyhow::Result<i32> {
    let run_dir: PathBuf =
        std::env::temp_dir().join(format!("cockpit-bench-dp-{}", std::process::id()));
    let gpus = u16::try_from(a.gpus).context("--gpus")?;
    let code = super::train(super::args::TrainArgs {
        config: a.config.map(Path::to_path_buf),
        no_tui: true,
        run_dir: Some(run_dir.clone()),
        set: overrides,
        device: a.device.map(str::to_string),
        gpus: Some(gpus),
        ..Default::default()
    });
    let events = read_events(&run_dir.join("metrics.jsonl"));
    let _ = std::fs::remove_dir_all(&run_dir);
    let code = code?;
    if code != EXIT_OK {
        crate::errln!("cockpit bench: the data-parallel run failed (exit code {code})");
        return Ok(code);
    }
    let (info, steps) = events?;
    let timed: Vec<StepStats> = steps.into_iter().filter(|s| s.step > a.warmup).collect();
    let Some(info) = info.filter(|_| !timed.is_empty()) else {
        crate::errln!("cockpit bench: the data-parallel run recorded no timed steps");
        return Ok(EXIT_FAILURE);
    };
    let report = summarize(&info, a.warmup, &timed);
    crate::outln!("{report}");
    if let Some(p) = a.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(EXIT_OK)
}

/// A run's start and step events from its metrics.jsonl.
fn read_events(path: &Path) -> anyhow::Result<(Option<RunInfo>, Vec<StepStats>)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let (mut info, mut steps) = (None, Vec::new());
    for line in text.lines() {
        match serde_json::from_str::<Event>(line) {
            Ok(Event::RunStarted(i)) => info = Some(i),
            Ok(Event::Step(s)) => steps.push(s),
            _ => {}
        }
    }
    Ok((info, steps))
}

/// `cockpit bench --find-batch`: double the micro-batch until it no longer fits, then bisect;
/// print each trial, the largest that fits, and one 10% below it (allocator fragmentation and
/// longer evaluation batches need some room).
fn find_batch(cfg: &config::Config, device: crate::util::DeviceSpec) -> anyhow::Result<i32> {
    if !fit::has_cuda(device) {
        crate::errln!("cockpit bench --find-batch: needs a CUDA device (host memory is not what limits the batch on the CPU)");
        return Ok(crate::process::EXIT_USAGE);
    }
    let report = |mb: usize, t: &fit::Trial| crate::outln!("{}", fit::describe(mb, t));
    let Some((good, at_limit)) = fit::largest(cfg, device, report)? else {
        crate::errln!("cockpit bench: micro-batch 1 does not fit this device (shorter model.seq_len, model.recompute = \"full\" or \"offload\", or LoRA)");
        return Ok(EXIT_FAILURE);
    };
    let margin = fit::with_margin(good);
    crate::outln!(
        "largest micro-batch that fits: {good}{}; with a 10% margin: optim.micro_batch = {margin}",
        if at_limit {
            format!(" (the limit, {})", fit::LIMIT)
        } else {
            String::new()
        }
    );
    Ok(EXIT_OK)
}
