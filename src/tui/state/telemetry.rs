//! GPU/host telemetry and advice, updated from [`MonitorUpdate`]s.

use super::history::Ring;
use crate::advisor::{MonitorUpdate, ProcessStat, Recommendation};
use crate::telemetry::{GpuProcess, GpuSample, HostSample};

/// Samples kept per sparkline.
const SPARK_LEN: usize = 240;

/// One GPU: its latest sample and recent utilisation, memory, temperature and power.
#[derive(Clone, Debug)]
pub struct GpuState {
    /// The latest sample.
    pub sample: GpuSample,
    /// GPU utilisation, percent.
    pub util: Ring<u64>,
    /// Memory used, percent of total.
    pub mem: Ring<u64>,
    /// History for the time-axis chart: (sample time in ms, util %, memory %, °C, power as a
    /// percentage of the limit); NaN where the GPU does not report a figure.
    pub history: Ring<GpuPoint>,
}

/// One GPU sample in the history chart (see [`GpuState::history`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuPoint {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// Utilisation, %.
    pub util: f64,
    /// Memory used, % of total.
    pub mem: f64,
    /// Temperature, °C.
    pub temp: f64,
    /// Power, % of the limit.
    pub power: f64,
}

impl GpuState {
    fn new(sample: &GpuSample) -> GpuState {
        GpuState {
            sample: sample.clone(),
            util: Ring::new(SPARK_LEN),
            mem: Ring::new(SPARK_LEN),
            history: Ring::new(SPARK_LEN),
        }
    }

    fn update(&mut self, sample: &GpuSample, at_ms: u64) {
        self.util.push(u64::from(sample.util_gpu.unwrap_or(0)));
        self.mem
            .push((sample.mem_used_frac() * 100.0).round().clamp(0.0, 100.0) as u64);
        let opt = |v: Option<f64>| v.unwrap_or(f64::NAN);
        self.history.push(GpuPoint {
            at_ms,
            util: opt(sample.util_gpu.map(f64::from)),
            mem: if sample.mem_total_bytes > 0 {
                sample.mem_used_frac() * 100.0
            } else {
                f64::NAN
            },
            temp: opt(sample.temperature_c.map(f64::from)),
            power: match (sample.power_w, sample.power_limit_w) {
                (Some(p), Some(l)) if l > 0.0 => p / l * 100.0,
                _ => f64::NAN,
            },
        });
        self.sample = sample.clone();
    }
}

/// A process using a GPU, with the GPU it runs on.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessRow {
    /// Index of the GPU the process runs on.
    pub gpu: u32,
    /// The process.
    pub process: GpuProcess,
    /// Its host CPU (% of a core) and resident memory, when the host could tell.
    pub host: Option<ProcessStat>,
}

/// Telemetry as the panels show it.
#[derive(Clone, Debug)]
pub struct TelemetryState {
    /// Every GPU in the latest sample, in its order.
    pub gpus: Vec<GpuState>,
    /// The latest host sample.
    pub host: HostSample,
    /// Host CPU, percent.
    pub host_cpu: Ring<u64>,
    /// Host RAM, percent.
    pub host_ram: Ring<u64>,
    /// Sample times (ms since the Unix epoch) of the host histories.
    pub host_times: Ring<u64>,
    /// Why there are no GPU metrics, when there are none.
    pub gpu_notice: Option<String>,
    /// The advice standing after the latest update.
    pub advice: Vec<Recommendation>,
    /// Updates received.
    pub updates: u64,
    /// Host CPU and memory of the GPU processes (from the latest update).
    pub process_stats: Vec<ProcessStat>,
}

impl Default for TelemetryState {
    fn default() -> Self {
        TelemetryState {
            gpus: Vec::new(),
            host: HostSample::default(),
            host_cpu: Ring::new(SPARK_LEN),
            host_ram: Ring::new(SPARK_LEN),
            host_times: Ring::new(SPARK_LEN),
            gpu_notice: None,
            advice: Vec::new(),
            updates: 0,
            process_stats: Vec::new(),
        }
    }
}

impl TelemetryState {
    /// Records one monitor tick.
    pub fn on_update(&mut self, update: &MonitorUpdate) {
        let snap = &update.snapshot;
        // keep histories for GPUs that are still there, matched by index
        let mut gpus = Vec::with_capacity(snap.gpus.len());
        for sample in &snap.gpus {
            let mut state = match self
                .gpus
                .iter()
                .position(|g| g.sample.index == sample.index)
            {
                Some(i) => self.gpus.swap_remove(i),
                None => GpuState::new(sample),
            };
            state.update(sample, snap.timestamp_ms);
            gpus.push(state);
        }
        self.gpus = gpus;
        self.host = snap.host.clone();
        self.host_cpu
            .push(snap.host.cpu_pct.round().clamp(0.0, 100.0) as u64);
        let ram = if snap.host.ram_total_bytes == 0 {
            0.0
        } else {
            snap.host.ram_used_bytes as f64 / snap.host.ram_total_bytes as f64 * 100.0
        };
        self.host_ram.push(ram.round().clamp(0.0, 100.0) as u64);
        self.host_times.push(snap.timestamp_ms);
        self.gpu_notice = snap.gpu_notice.clone();
        let mut advice = update.advice.clone();
        // most severe first; stable, so the advisor's order is kept within a severity
        advice.sort_by_key(|a| std::cmp::Reverse(a.severity));
        self.advice = advice;
        self.process_stats.clone_from(&update.processes);
        self.updates += 1;
    }

    /// Every process on every GPU, largest GPU memory first.
    pub fn processes(&self) -> Vec<ProcessRow> {
        let mut rows: Vec<ProcessRow> = self
            .gpus
            .iter()
            .flat_map(|g| {
                g.sample.processes.iter().map(|p| ProcessRow {
                    gpu: g.sample.index,
                    process: p.clone(),
                    host: self.process_stats.iter().find(|s| s.pid == p.pid).cloned(),
                })
            })
            .collect();
        rows.sort_by(|a, b| {
            b.process
                .gpu_memory_bytes
                .cmp(&a.process.gpu_memory_bytes)
                .then(a.gpu.cmp(&b.gpu))
                .then(a.process.pid.cmp(&b.process.pid))
        });
        rows
    }
}
