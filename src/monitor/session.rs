//! [`MonitorSession`]: what a monitor session collected — the snapshot history (for plots) and
//! running statistics — and the [`MonitorSummary`] written to `monitor_summary.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::advisor::{MonitorUpdate, Severity};
use crate::telemetry::{GpuSample, Snapshot};

/// Name of the summary file written into the output folder.
pub const SUMMARY_FILE: &str = "monitor_summary.json";

/// Schema tag of [`MonitorSummary`].
pub const SUMMARY_SCHEMA: &str = "cockpit.monitor_summary.v1";

/// Most snapshots kept in the history; past that, every other one is dropped and later
/// snapshots are kept at half the rate, so a long session stays bounded in memory and still
/// covers its whole length. Summary statistics are exact regardless.
const DEFAULT_MAX_HISTORY: usize = 20_000;

/// Everything a monitor session collected.
#[derive(Clone, Debug)]
pub struct MonitorSession {
    source: String,
    history: Vec<Snapshot>,
    max_history: usize,
    /// Keep one snapshot in `stride` once the history has been thinned.
    stride: u64,
    samples: u64,
    started_ms: Option<u64>,
    ended_ms: u64,
    gpu_notice: Option<String>,
    gpus: BTreeMap<u32, GpuStats>,
    host: HostStats,
    advice: BTreeMap<(String, Option<u32>), AdviceSeen>,
}

impl MonitorSession {
    /// An empty session; `source` says where the snapshots come from (for the summary).
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            history: Vec::new(),
            max_history: DEFAULT_MAX_HISTORY,
            stride: 1,
            samples: 0,
            started_ms: None,
            ended_ms: 0,
            gpu_notice: None,
            gpus: BTreeMap::new(),
            host: HostStats::default(),
            advice: BTreeMap::new(),
        }
    }

    /// Add one pipeline update.
    pub fn push(&mut self, update: &MonitorUpdate) {
        let snapshot = &update.snapshot;
        let t = snapshot.timestamp_ms;
        let started = *self.started_ms.get_or_insert(t);
        self.ended_ms = self.ended_ms.max(t);
        if self.gpu_notice.is_none() {
            self.gpu_notice.clone_from(&snapshot.gpu_notice);
        }
        for gpu in &snapshot.gpus {
            self.gpus
                .entry(gpu.index)
                .or_insert_with(|| GpuStats::new(gpu))
                .add(gpu);
        }
        self.host.add(snapshot);
        for rec in &update.advice {
            let seen = self
                .advice
                .entry((rec.id.clone(), rec.gpu))
                .or_insert_with(|| AdviceSeen {
                    id: rec.id.clone(),
                    gpu: rec.gpu,
                    severity: rec.severity,
                    message: rec.message.clone(),
                    first_seen_ms: t,
                    last_seen_ms: t,
                    first_seen_s: 0.0,
                    last_seen_s: 0.0,
                    updates: 0,
                });
            seen.severity = rec.severity;
            seen.message.clone_from(&rec.message);
            seen.last_seen_ms = t;
            seen.first_seen_s = seconds_between(started, seen.first_seen_ms);
            seen.last_seen_s = seconds_between(started, t);
            seen.updates += 1;
        }
        if self.samples.is_multiple_of(self.stride) {
            self.history.push(snapshot.clone());
            if self.history.len() >= self.max_history.max(2) {
                let mut i = 0;
                self.history.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                self.stride *= 2;
            }
        }
        self.samples += 1;
    }

    /// The snapshots collected, oldest first (thinned evenly on very long sessions) — what
    /// the report module plots.
    pub fn snapshots(&self) -> &[Snapshot] {
        &self.history
    }

    /// Number of snapshots seen (all of them, including those thinned out of the history).
    pub fn sample_count(&self) -> u64 {
        self.samples
    }

    /// Time between the first and the last snapshot, in seconds.
    pub fn duration_s(&self) -> f64 {
        self.started_ms
            .map_or(0.0, |start| seconds_between(start, self.ended_ms))
    }

    /// The summary as written to `monitor_summary.json`.
    pub fn summary(&self) -> MonitorSummary {
        let mut advice: Vec<AdviceSeen> = self.advice.values().cloned().collect();
        advice
            .sort_by(|a, b| (a.first_seen_ms, &a.id, a.gpu).cmp(&(b.first_seen_ms, &b.id, b.gpu)));
        MonitorSummary {
            schema: SUMMARY_SCHEMA.to_string(),
            source: self.source.clone(),
            started_ms: self.started_ms.unwrap_or(0),
            ended_ms: self.ended_ms,
            duration_s: self.duration_s(),
            samples: self.samples,
            gpu_notice: self.gpu_notice.clone(),
            gpus: self.gpus.values().map(GpuStats::summary).collect(),
            host: self.host.summary(),
            advice,
        }
    }

    /// Write `monitor_summary.json` into `dir` (created if missing); returns its path.
    pub fn write_summary(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create output folder {}", dir.display()))?;
        let path = dir.join(SUMMARY_FILE);
        let json = serde_json::to_string_pretty(&self.summary())?;
        std::fs::write(&path, json + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(path)
    }
}

fn seconds_between(from_ms: u64, to_ms: u64) -> f64 {
    to_ms.saturating_sub(from_ms) as f64 / 1000.0
}

/// Contents of `monitor_summary.json` (schema `cockpit.monitor_summary.v1`; see the
/// [module docs](crate::monitor)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MonitorSummary {
    /// Always [`SUMMARY_SCHEMA`].
    pub schema: String,
    /// Where the snapshots came from, e.g. "live, every 1 s" or "replay of trace.jsonl".
    pub source: String,
    /// First snapshot, ms since the Unix epoch.
    pub started_ms: u64,
    /// Last snapshot, ms since the Unix epoch.
    pub ended_ms: u64,
    /// `ended_ms - started_ms`, in seconds.
    pub duration_s: f64,
    /// Number of snapshots.
    pub samples: u64,
    /// Why GPU metrics were missing, when they were.
    pub gpu_notice: Option<String>,
    /// One entry per GPU seen, by index.
    pub gpus: Vec<GpuSummary>,
    pub host: HostSummary,
    /// Every piece of advice given, in order of first appearance.
    pub advice: Vec<AdviceSeen>,
}

/// Per-GPU statistics of a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSummary {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    /// Snapshots that included this GPU.
    pub samples: u64,
    pub util_gpu_avg_pct: Option<f64>,
    pub util_gpu_peak_pct: Option<u32>,
    /// GPM SM activity (Hopper+), when reported.
    pub sm_activity_avg_pct: Option<f64>,
    pub mem_total_bytes: u64,
    pub mem_used_avg_bytes: u64,
    pub mem_used_peak_bytes: u64,
    /// `mem_used_peak_bytes / mem_total_bytes` (0 when the total is unknown).
    pub mem_used_peak_frac: f64,
    pub temperature_peak_c: Option<u32>,
    pub power_avg_w: Option<f64>,
    pub power_peak_w: Option<f64>,
}

/// Host statistics of a session.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostSummary {
    pub cpu_avg_pct: f64,
    pub cpu_peak_pct: f64,
    pub cpu_cores: usize,
    pub ram_total_bytes: u64,
    pub ram_used_avg_bytes: u64,
    pub ram_used_peak_bytes: u64,
    /// Peak resident set size of cockpit itself.
    pub self_rss_peak_bytes: u64,
}

/// One piece of advice and when it stood.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdviceSeen {
    pub id: String,
    pub gpu: Option<u32>,
    pub severity: Severity,
    /// The latest wording.
    pub message: String,
    pub first_seen_ms: u64,
    pub last_seen_ms: u64,
    /// Seconds from the session start.
    pub first_seen_s: f64,
    pub last_seen_s: f64,
    /// Number of updates it stood in.
    pub updates: u64,
}

/// A mean over the values that were present.
#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    sum: f64,
    n: u64,
}

impl Mean {
    fn add(&mut self, value: Option<f64>) {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            self.sum += v;
            self.n += 1;
        }
    }

    fn get(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

fn max_opt<T: PartialOrd + Copy>(current: Option<T>, value: Option<T>) -> Option<T> {
    match (current, value) {
        (Some(a), Some(b)) => Some(if b > a { b } else { a }),
        (a, b) => a.or(b),
    }
}

#[derive(Clone, Debug)]
struct GpuStats {
    index: u32,
    name: String,
    uuid: String,
    samples: u64,
    util: Mean,
    util_peak: Option<u32>,
    sm_activity: Mean,
    mem_total: u64,
    mem_used: Mean,
    mem_peak: u64,
    temp_peak: Option<u32>,
    power: Mean,
    power_peak: Option<f64>,
}

impl GpuStats {
    fn new(gpu: &GpuSample) -> Self {
        Self {
            index: gpu.index,
            name: gpu.name.clone(),
            uuid: gpu.uuid.clone(),
            samples: 0,
            util: Mean::default(),
            util_peak: None,
            sm_activity: Mean::default(),
            mem_total: 0,
            mem_used: Mean::default(),
            mem_peak: 0,
            temp_peak: None,
            power: Mean::default(),
            power_peak: None,
        }
    }

    fn add(&mut self, gpu: &GpuSample) {
        self.samples += 1;
        self.util.add(gpu.util_gpu.map(f64::from));
        self.util_peak = max_opt(self.util_peak, gpu.util_gpu);
        self.sm_activity.add(gpu.sm_activity_pct);
        if gpu.mem_total_bytes > 0 {
            self.mem_total = gpu.mem_total_bytes;
            self.mem_used.add(Some(gpu.mem_used_bytes as f64));
            self.mem_peak = self.mem_peak.max(gpu.mem_used_bytes);
        }
        self.temp_peak = max_opt(self.temp_peak, gpu.temperature_c);
        self.power.add(gpu.power_w);
        self.power_peak = max_opt(self.power_peak, gpu.power_w.filter(|w| w.is_finite()));
    }

    fn summary(&self) -> GpuSummary {
        GpuSummary {
            index: self.index,
            name: self.name.clone(),
            uuid: self.uuid.clone(),
            samples: self.samples,
            util_gpu_avg_pct: self.util.get(),
            util_gpu_peak_pct: self.util_peak,
            sm_activity_avg_pct: self.sm_activity.get(),
            mem_total_bytes: self.mem_total,
            mem_used_avg_bytes: self.mem_used.get().map_or(0, |b| b.round() as u64),
            mem_used_peak_bytes: self.mem_peak,
            mem_used_peak_frac: if self.mem_total > 0 {
                self.mem_peak as f64 / self.mem_total as f64
            } else {
                0.0
            },
            temperature_peak_c: self.temp_peak,
            power_avg_w: self.power.get(),
            power_peak_w: self.power_peak,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct HostStats {
    cpu: Mean,
    cpu_peak: f64,
    cpu_cores: usize,
    ram_total: u64,
    ram_used: Mean,
    ram_peak: u64,
    rss_peak: u64,
}

impl HostStats {
    fn add(&mut self, snapshot: &Snapshot) {
        let host = &snapshot.host;
        self.cpu.add(Some(host.cpu_pct));
        if host.cpu_pct.is_finite() {
            self.cpu_peak = self.cpu_peak.max(host.cpu_pct);
        }
        self.cpu_cores = self.cpu_cores.max(host.cpu_cores);
        self.ram_total = self.ram_total.max(host.ram_total_bytes);
        self.ram_used.add(Some(host.ram_used_bytes as f64));
        self.ram_peak = self.ram_peak.max(host.ram_used_bytes);
        self.rss_peak = self.rss_peak.max(host.self_rss_bytes);
    }

    fn summary(&self) -> HostSummary {
        HostSummary {
            cpu_avg_pct: self.cpu.get().unwrap_or(0.0),
            cpu_peak_pct: self.cpu_peak,
            cpu_cores: self.cpu_cores,
            ram_total_bytes: self.ram_total,
            ram_used_avg_bytes: self.ram_used.get().map_or(0, |b| b.round() as u64),
            ram_used_peak_bytes: self.ram_peak,
            self_rss_peak_bytes: self.rss_peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(t: u64, util: u32) -> MonitorUpdate {
        MonitorUpdate {
            snapshot: Snapshot {
                timestamp_ms: t,
                gpus: vec![GpuSample {
                    index: 0,
                    util_gpu: Some(util),
                    mem_used_bytes: u64::from(util),
                    mem_total_bytes: 100,
                    ..GpuSample::default()
                }],
                ..Snapshot::default()
            },
            advice: Vec::new(),
            processes: Vec::new(),
        }
    }

    #[test]
    fn long_sessions_are_thinned_but_summarised_exactly() {
        let mut session = MonitorSession::new("test");
        session.max_history = 8;
        for i in 0..100u32 {
            session.push(&update(u64::from(i) * 1000, i));
        }
        assert!(session.snapshots().len() < 8);
        assert_eq!(session.snapshots()[0].timestamp_ms, 0);
        let ts: Vec<u64> = session.snapshots().iter().map(|s| s.timestamp_ms).collect();
        assert!(ts.windows(2).all(|w| w[0] < w[1]));
        let summary = session.summary();
        assert_eq!(summary.samples, 100);
        assert_eq!(summary.gpus[0].util_gpu_peak_pct, Some(99));
        assert_eq!(summary.gpus[0].util_gpu_avg_pct, Some(49.5));
        assert_eq!(summary.gpus[0].mem_used_peak_bytes, 99);
        assert!((summary.duration_s - 99.0).abs() < 1e-9);
    }
}
