//! Synthetic telemetry shared by the advisor, telemetry and monitor tests, and the generator
//! of the trace fixtures in `tests/traces/`.
#![allow(dead_code)]

use std::path::PathBuf;

use cockpit::advisor::{Advisor, AdvisorOptions, Recommendation};
use cockpit::engine::events::{RunInfo, StepStats};
use cockpit::telemetry::{GpuProcess, GpuSample, HostSample, Snapshot};

pub const GIB: u64 = 1 << 30;
/// A fixed start time (2026-01-01T00:00:00Z), so fixtures are reproducible.
pub const T0_MS: u64 = 1_767_225_600_000;
/// The pid the advisor takes for "this cockpit" in tests.
pub const OWN_PID: u32 = 4242;

/// A GPU with 80 GiB, compute capability 9.0, cool and unthrottled.
pub fn gpu(index: u32, util: u32, mem_frac: f64) -> GpuSample {
    let total = 80 * GIB;
    GpuSample {
        index,
        name: "Synthetic GPU 80GB".to_string(),
        uuid: format!("GPU-00000000-0000-0000-0000-00000000000{index}"),
        util_gpu: Some(util),
        util_mem: Some(util / 2),
        mem_used_bytes: (total as f64 * mem_frac) as u64,
        mem_total_bytes: total,
        temperature_c: Some(40 + util / 3),
        power_w: Some(80.0 + 6.0 * f64::from(util)),
        power_limit_w: Some(700.0),
        sm_clock_mhz: Some(1980),
        sm_clock_max_mhz: Some(1980),
        mem_clock_mhz: Some(2619),
        mem_clock_max_mhz: Some(2619),
        throttle_reasons: Vec::new(),
        pcie_rx_kbps: Some(1000),
        pcie_tx_kbps: Some(200),
        fan_pct: None,
        sm_activity_pct: None,
        sm_occupancy_pct: None,
        compute_capability: Some((9, 0)),
        processes: Vec::new(),
    }
}

/// Add a compute process to a GPU sample.
pub fn with_process(mut g: GpuSample, pid: u32, name: &str) -> GpuSample {
    g.processes.push(GpuProcess {
        pid,
        name: name.to_string(),
        user: Some("alice".to_string()),
        gpu_memory_bytes: Some(g.mem_used_bytes),
        kind: "compute".to_string(),
        sm_pct: Some(90),
    });
    g
}

/// Set throttle reasons on a GPU sample.
pub fn throttled(mut g: GpuSample, reasons: &[&str]) -> GpuSample {
    g.throttle_reasons = reasons.iter().map(|r| r.to_string()).collect();
    g
}

pub fn host() -> HostSample {
    HostSample {
        cpu_pct: 20.0,
        cpu_cores: 16,
        ram_used_bytes: 12 * GIB,
        ram_total_bytes: 64 * GIB,
        self_rss_bytes: 50 << 20,
    }
}

/// A snapshot `sec` seconds after [`T0_MS`].
pub fn snapshot(sec: u64, gpus: Vec<GpuSample>) -> Snapshot {
    Snapshot {
        timestamp_ms: T0_MS + sec * 1000,
        gpus,
        host: host(),
        gpu_notice: None,
    }
}

pub fn run_info(dtype: &str, device: &str) -> RunInfo {
    RunInfo {
        run_name: "test".to_string(),
        run_dir: "runs/test".to_string(),
        device: device.to_string(),
        dtype: dtype.to_string(),
        dtype_reason: "configured".to_string(),
        params_total: 1_000_000,
        params_trainable: 1_000_000,
        start_step: 0,
        max_steps: 1000,
        micro_batch: 8,
        accum: 1,
        seq_len: 256,
        vocab_size: 256,
        train_tokens: 1_000_000,
        entropy_floor_bpt: None,
        flops_per_token: 6e6,
        peak_flops: None,
        attention_flops_fwd: None,
        mamba_flops: None,
        scu_enabled: false,
        scu_target: 0.01,
        summary: "test model".to_string(),
    }
}

/// A step of a run that learns: the loss comes down from 5 towards 2.
pub fn step(n: u64, step_ms: f64, data_wait_ms: f64) -> StepStats {
    StepStats {
        step: n,
        loss: 2.0 + 3.0 * (-(n as f64) / 100.0).exp(),
        lr: 1e-3,
        grad_norm: 1.0,
        tokens_per_sec: 10_000.0,
        step_ms,
        data_wait_ms,
        compute_ms: step_ms - data_wait_ms,
        optim_ms: 1.0,
        micro_batch: 8,
        accum: 1,
        tokens: n * 2048,
        epoch: 0.0,
        elapsed_s: n as f64 * step_ms / 1000.0,
        memory_bytes: None,
        host_rss_bytes: None,
        dropped_before: 0,
        comm_ms: 0.0,
        ranks: vec![],
        kernels: vec![],
        trained_share: None,
    }
}

/// Advisor options for tests: defaults, with [`OWN_PID`] as this cockpit.
pub fn options() -> AdvisorOptions {
    AdvisorOptions {
        own_pid: OWN_PID,
        ..AdvisorOptions::default()
    }
}

/// Drives an advisor one second at a time.
pub struct Session {
    pub advisor: Advisor,
    pub sec: u64,
    steps: u64,
}

impl Session {
    pub fn new() -> Self {
        Self::with(options())
    }

    pub fn with(opts: AdvisorOptions) -> Self {
        Self {
            advisor: Advisor::new(opts),
            sec: 0,
            steps: 0,
        }
    }

    /// Attach a training run on `device` in `dtype`.
    pub fn attach(&mut self, dtype: &str, device: &str) {
        self.advisor.observe_run(&run_info(dtype, device));
    }

    /// One second: four steps with these (step_ms, data_wait_ms), if any, then a snapshot.
    /// Returns the ids standing afterwards.
    pub fn tick(&mut self, gpus: Vec<GpuSample>, steps: Option<(f64, f64)>) -> Vec<String> {
        if let Some((step_ms, wait_ms)) = steps {
            for _ in 0..4 {
                self.steps += 1;
                self.advisor
                    .observe_step(&step(self.steps, step_ms, wait_ms));
            }
        }
        self.advisor.observe_snapshot(&snapshot(self.sec, gpus));
        self.sec += 1;
        ids(&self.advisor.recommendations())
    }

    /// `n` ticks of the same conditions; the ids standing after each.
    pub fn run(
        &mut self,
        n: usize,
        gpus: impl Fn() -> Vec<GpuSample>,
        steps: Option<(f64, f64)>,
    ) -> Vec<Vec<String>> {
        (0..n).map(|_| self.tick(gpus(), steps)).collect()
    }

    pub fn recs(&self) -> Vec<Recommendation> {
        self.advisor.recommendations()
    }

    pub fn find(&self, id: &str) -> Option<Recommendation> {
        self.recs().into_iter().find(|r| r.id == id)
    }
}

pub fn ids(recs: &[Recommendation]) -> Vec<String> {
    recs.iter().map(|r| r.id.clone()).collect()
}

// ---- trace fixtures -------------------------------------------------------------------------

/// Path of a fixture under `tests/traces/`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/traces")
        .join(name)
}

/// The fixtures: file name and snapshots.
pub fn fixtures() -> Vec<(&'static str, Vec<Snapshot>)> {
    vec![
        ("idle_gpu.jsonl", idle_trace()),
        ("data_starved.jsonl", data_starved_trace()),
        ("hot_and_full.jsonl", hot_and_full_trace()),
    ]
}

/// 45 s of an idle GPU: no process, 0% utilization, a little memory held by the driver.
pub fn idle_trace() -> Vec<Snapshot> {
    (0..45)
        .map(|s| snapshot(s, vec![gpu(0, 0, 0.006)]))
        .collect()
}

/// 60 s of a job that keeps the GPU mostly waiting (util 15–30%, one process): what a
/// data-bound run looks like from the monitor; the last 30 s it recovers (util ~92%).
pub fn data_starved_trace() -> Vec<Snapshot> {
    (0..90)
        .map(|s| {
            let util = if s < 60 {
                15 + (s * 7 % 16) as u32
            } else {
                88 + (s % 9) as u32
            };
            snapshot(s, vec![with_process(gpu(0, util, 0.55), 31337, "python")])
        })
        .collect()
}

/// 60 s of a busy GPU whose memory is nearly full; from 20 s on it runs hot and throttles.
pub fn hot_and_full_trace() -> Vec<Snapshot> {
    (0..60)
        .map(|s| {
            let mut g = with_process(gpu(0, 97, 0.95), 31337, "python");
            if s >= 20 {
                g = throttled(g, &["hw_thermal_slowdown", "sw_thermal_slowdown"]);
                g.temperature_c = Some(91);
                g.sm_clock_mhz = Some(1200);
            }
            snapshot(s, vec![g])
        })
        .collect()
}
