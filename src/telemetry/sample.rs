//! Telemetry samples: what the GPU and host samplers produce, what record/replay stores, and
//! what `cockpit monitor --once --json` prints (top-level `gpus` list and `host` object).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub name: String,
    pub user: Option<String>,
    /// GPU memory used by this process, bytes (None when NVML cannot tell).
    pub gpu_memory_bytes: Option<u64>,
    /// "compute" or "graphics"
    pub kind: String,
    /// The share of the SMs this process used over NVML's last sampling interval, percent
    /// (None when the driver keeps no per-process samples).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_pct: Option<u32>,
}

impl GpuProcess {
    /// `1234 python (alice)`: pid, name and, when known, the user.
    pub fn label(&self) -> String {
        match &self.user {
            Some(u) => format!("{} {} ({u})", self.pid, self.name),
            None => format!("{} {}", self.pid, self.name),
        }
    }
}

/// One GPU at one instant. Fields NVML cannot report on a device are `None`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    /// % of time a kernel was running (NVML "utilization.gpu").
    pub util_gpu: Option<u32>,
    /// % of time device memory was read or written.
    pub util_mem: Option<u32>,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub mem_clock_max_mhz: Option<u32>,
    /// Active clock-throttle reasons, e.g. ["sw_power_cap", "hw_thermal_slowdown"].
    pub throttle_reasons: Vec<String>,
    pub pcie_rx_kbps: Option<u32>,
    pub pcie_tx_kbps: Option<u32>,
    pub fan_pct: Option<u32>,
    /// GPM (Hopper+): fraction of SMs busy, 0..100.
    pub sm_activity_pct: Option<f64>,
    /// GPM (Hopper+): achieved warp occupancy, 0..100.
    pub sm_occupancy_pct: Option<f64>,
    /// Compute capability (major, minor), when known.
    pub compute_capability: Option<(u32, u32)>,
    pub processes: Vec<GpuProcess>,
}

impl GpuSample {
    pub fn mem_used_frac(&self) -> f64 {
        if self.mem_total_bytes == 0 {
            0.0
        } else {
            self.mem_used_bytes as f64 / self.mem_total_bytes as f64
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostSample {
    #[serde(deserialize_with = "crate::engine::events::nan_f64")]
    pub cpu_pct: f64,
    pub cpu_cores: usize,
    pub ram_used_bytes: u64,
    pub ram_total_bytes: u64,
    /// Resident set size of this cockpit process.
    pub self_rss_bytes: u64,
}

/// One sampling instant: all GPUs plus the host.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    pub gpus: Vec<GpuSample>,
    pub host: HostSample,
    /// Why GPU metrics are missing, when they are (e.g. "NVML not available: ...").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_notice: Option<String>,
}
