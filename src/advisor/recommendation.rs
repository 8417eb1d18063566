//! What the advisor says: a recommendation with the evidence that fired it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Info,
    Warn,
    Critical,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    /// Stable id, e.g. "data_bound", "mem_low", "idle", "well_utilized".
    pub id: String,
    pub severity: Severity,
    /// GPU index it is about (None: the whole job / host).
    pub gpu: Option<u32>,
    pub message: String,
    /// The figures that fired it, as (name, value) pairs, e.g. ("util_gpu_avg", "34%").
    pub evidence: Vec<(String, String)>,
    /// What to do about it.
    pub action: String,
    /// A key in the cockpit TUI that acts on it, e.g. "+".
    pub key: Option<String>,
}

/// One tick of the monitor pipeline: the latest sample and the advice standing after it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MonitorUpdate {
    pub snapshot: crate::telemetry::Snapshot,
    pub advice: Vec<Recommendation>,
    /// Host CPU and memory of the processes on the GPUs, when the machine sampled is this
    /// one (not in a replay).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessStat>,
}

/// A GPU process as the host sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessStat {
    pub pid: u32,
    /// CPU time over the last interval, % of one core (needs two samples).
    pub cpu_pct: Option<f64>,
    /// Resident memory, bytes.
    pub rss_bytes: Option<u64>,
}
