//! The NVML side of the sampler: one [`GpuSample`] per device.
//!
//! NVML is initialised at most once per process (a process-wide [`OnceLock`]); every sampler
//! after the first reuses that handle, and a failed initialisation is remembered as the notice
//! shown to the user. Each metric is queried on its own: whatever a device refuses
//! (`NotSupported`, `NoPermission`, ...) is recorded as `None`, never as an error.
//!
//! On GPUs with GPM (Hopper+), SM activity, SM occupancy and PCIe throughput are computed
//! between consecutive samples (non-blocking, averaged over the whole interval; `None` on a
//! device's first sample). Elsewhere PCIe throughput comes from NVML's own measurement, which
//! blocks about 20 ms per direction. (The cumulative PCIe byte counters are 32-bit and wrap
//! several times a second under load, so they are not used.)

use std::sync::OnceLock;

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, GpmSample, Nvml};

use super::{round_pct, GpuProcess, GpuSample};

/// Suffix of every "GPU metrics are off" notice.
const NOTICE_TAIL: &str = "GPU metrics off, host metrics only";

/// Throttle-reason flags and the names recorded in [`GpuSample::throttle_reasons`].
const THROTTLE_NAMES: [(ThrottleReasons, &str); 9] = [
    (ThrottleReasons::GPU_IDLE, "gpu_idle"),
    (
        ThrottleReasons::APPLICATIONS_CLOCKS_SETTING,
        "applications_clocks_setting",
    ),
    (ThrottleReasons::SW_POWER_CAP, "sw_power_cap"),
    (ThrottleReasons::HW_SLOWDOWN, "hw_slowdown"),
    (ThrottleReasons::SYNC_BOOST, "sync_boost"),
    (ThrottleReasons::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
    (ThrottleReasons::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
    (
        ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
        "hw_power_brake_slowdown",
    ),
    (
        ThrottleReasons::DISPLAY_CLOCK_SETTING,
        "display_clock_setting",
    ),
];

/// The process-wide NVML handle, or the notice explaining why there is none.
fn nvml() -> Result<&'static Nvml, &'static str> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| unavailable_notice(&e)))
        .as_ref()
        .map_err(String::as_str)
}

/// One readable line for a failed NVML initialisation.
fn unavailable_notice(err: &NvmlError) -> String {
    let why = match err {
        NvmlError::LibloadingError(_) => "libnvidia-ml.so.1 not found".to_string(),
        NvmlError::DriverNotLoaded => "the NVIDIA driver is not loaded".to_string(),
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".to_string(),
        other => other.to_string(),
    };
    format!("NVML not available ({why}): {NOTICE_TAIL}")
}

/// GPM (Hopper+) state of one device: the previous sample to diff against.
enum Gpm {
    Unsupported,
    Supported {
        previous: Option<GpmSample<'static>>,
    },
}

/// A device and what does not change about it while the process runs.
struct DeviceSlot {
    index: u32,
    name: String,
    uuid: String,
    compute_capability: Option<(u32, u32)>,
    sm_clock_max_mhz: Option<u32>,
    mem_clock_max_mhz: Option<u32>,
    gpm: Gpm,
}

impl DeviceSlot {
    fn probe(index: u32, device: &Device<'static>) -> Self {
        let compute_capability = device
            .cuda_compute_capability()
            .ok()
            .and_then(|cc| Some((u32::try_from(cc.major).ok()?, u32::try_from(cc.minor).ok()?)));
        let gpm = if device.gpm_support().unwrap_or(false) {
            Gpm::Supported { previous: None }
        } else {
            Gpm::Unsupported
        };
        Self {
            index,
            name: device.name().unwrap_or_else(|_| format!("GPU {index}")),
            uuid: device.uuid().unwrap_or_default(),
            compute_capability,
            sm_clock_max_mhz: device.max_clock_info(Clock::SM).ok(),
            mem_clock_max_mhz: device.max_clock_info(Clock::Memory).ok(),
            gpm,
        }
    }

    /// A sample holding only the identity, for a device that cannot be reached right now.
    fn identity_only(&self) -> GpuSample {
        GpuSample {
            index: self.index,
            name: self.name.clone(),
            uuid: self.uuid.clone(),
            compute_capability: self.compute_capability,
            sm_clock_max_mhz: self.sm_clock_max_mhz,
            mem_clock_max_mhz: self.mem_clock_max_mhz,
            ..GpuSample::default()
        }
    }

    /// GPM figures since the previous GPM sample (all `None` without GPM or on the first).
    fn gpm_metrics(&mut self, nvml: &'static Nvml, device: &Device<'static>) -> GpmFigures {
        let Gpm::Supported { previous } = &mut self.gpm else {
            return GpmFigures::default();
        };
        let current = match device.gpm_sample() {
            Ok(sample) => sample,
            Err(err) => {
                tracing::debug!(gpu = self.index, %err, "GPM sample refused; GPM metrics off");
                self.gpm = Gpm::Unsupported;
                return GpmFigures::default();
            }
        };
        let metrics = previous.as_ref().and_then(|prev| {
            let ids = [
                GpmMetricId::SmUtil,
                GpmMetricId::SmOccupancy,
                GpmMetricId::PcieRxPerSec,
                GpmMetricId::PcieTxPerSec,
            ];
            nvml_wrapper::gpm::gpm_metrics_get(nvml, prev, &current, &ids).ok()
        });
        *previous = Some(current);
        let value = |i: usize| -> Option<f64> {
            let result = metrics.as_ref()?.get(i)?.as_ref().ok()?;
            (result.value.is_finite() && result.value >= 0.0).then_some(result.value)
        };
        GpmFigures {
            sm_activity_pct: value(0).map(round_pct),
            sm_occupancy_pct: value(1).map(round_pct),
            pcie_rx_kbps: value(2).map(mib_per_s_to_kbps),
            pcie_tx_kbps: value(3).map(mib_per_s_to_kbps),
        }
    }

    fn has_gpm(&self) -> bool {
        matches!(self.gpm, Gpm::Supported { .. })
    }
}

/// What GPM measured between two samples.
#[derive(Default)]
struct GpmFigures {
    sm_activity_pct: Option<f64>,
    sm_occupancy_pct: Option<f64>,
    pcie_rx_kbps: Option<u32>,
    pcie_tx_kbps: Option<u32>,
}

/// GPM reports PCIe traffic in MiB/s; samples carry KB/s (1 KB = 1000 bytes), as NVML's own
/// PCIe throughput query does.
fn mib_per_s_to_kbps(mib_per_s: f64) -> u32 {
    (mib_per_s * 1_048_576.0 / 1000.0)
        .round()
        .min(f64::from(u32::MAX)) as u32
}

/// Samples every NVIDIA GPU through NVML.
pub(crate) struct GpuSampler {
    nvml: &'static Nvml,
    devices: Vec<DeviceSlot>,
}

impl GpuSampler {
    /// Find the GPUs. `Err` carries the one-line notice for the user when there are none.
    pub(crate) fn new() -> Result<Self, String> {
        let nvml = nvml().map_err(str::to_owned)?;
        let count = nvml
            .device_count()
            .map_err(|e| format!("NVML cannot count GPUs ({e}): {NOTICE_TAIL}"))?;
        if count == 0 {
            return Err(format!("NVML found no NVIDIA GPU: {NOTICE_TAIL}"));
        }
        let devices = (0..count)
            .filter_map(|index| match nvml.device_by_index(index) {
                Ok(device) => Some(DeviceSlot::probe(index, &device)),
                Err(err) => {
                    tracing::warn!(gpu = index, %err, "GPU not accessible; skipping it");
                    None
                }
            })
            .collect::<Vec<_>>();
        if devices.is_empty() {
            return Err(format!(
                "NVML cannot open any of {count} GPU(s): {NOTICE_TAIL}"
            ));
        }
        Ok(Self { nvml, devices })
    }

    /// One sample per GPU. Process names and users are left for the caller to fill in.
    pub(crate) fn sample(&mut self) -> Vec<GpuSample> {
        let nvml = self.nvml;
        self.devices
            .iter_mut()
            .map(|slot| match nvml.device_by_index(slot.index) {
                Ok(device) => sample_device(nvml, slot, &device),
                Err(err) => {
                    tracing::debug!(gpu = slot.index, %err, "GPU not reachable this tick");
                    slot.identity_only()
                }
            })
            .collect()
    }
}

fn sample_device(
    nvml: &'static Nvml,
    slot: &mut DeviceSlot,
    device: &Device<'static>,
) -> GpuSample {
    let utilization = device.utilization_rates().ok();
    let memory = device.memory_info().ok();
    let milliwatts = |mw: u32| f64::from(mw) / 1000.0;
    let power_limit_w = device
        .enforced_power_limit()
        .or_else(|_| device.power_management_limit())
        .ok()
        .map(milliwatts);
    let gpm = slot.gpm_metrics(nvml, device);
    let (pcie_rx_kbps, pcie_tx_kbps) = if slot.has_gpm() {
        (gpm.pcie_rx_kbps, gpm.pcie_tx_kbps)
    } else {
        (
            device.pcie_throughput(PcieUtilCounter::Receive).ok(),
            device.pcie_throughput(PcieUtilCounter::Send).ok(),
        )
    };
    GpuSample {
        util_gpu: utilization.as_ref().map(|u| u.gpu),
        util_mem: utilization.as_ref().map(|u| u.memory),
        mem_used_bytes: memory.as_ref().map_or(0, |m| m.used),
        mem_total_bytes: memory.as_ref().map_or(0, |m| m.total),
        temperature_c: device.temperature(TemperatureSensor::Gpu).ok(),
        power_w: device.power_usage().ok().map(milliwatts),
        power_limit_w,
        sm_clock_mhz: device.clock_info(Clock::SM).ok(),
        mem_clock_mhz: device.clock_info(Clock::Memory).ok(),
        throttle_reasons: device
            .current_throttle_reasons()
            .map(throttle_names)
            .unwrap_or_default(),
        pcie_rx_kbps,
        pcie_tx_kbps,
        fan_pct: device.fan_speed(0).ok(),
        sm_activity_pct: gpm.sm_activity_pct,
        sm_occupancy_pct: gpm.sm_occupancy_pct,
        processes: processes(device),
        ..slot.identity_only()
    }
}

/// Readable names of the active throttle reasons.
fn throttle_names(reasons: ThrottleReasons) -> Vec<String> {
    THROTTLE_NAMES
        .iter()
        .filter(|(flag, _)| reasons.contains(*flag))
        .map(|(_, name)| (*name).to_string())
        .collect()
}

/// Compute and graphics processes on a device, one entry per pid (compute wins).
fn processes(device: &Device<'static>) -> Vec<GpuProcess> {
    let mut out: Vec<GpuProcess> = Vec::new();
    let lists = [
        ("compute", device.running_compute_processes()),
        ("graphics", device.running_graphics_processes()),
    ];
    for (kind, list) in lists {
        for info in list.unwrap_or_default() {
            if out.iter().all(|p| p.pid != info.pid) {
                out.push(gpu_process(kind, &info));
            }
        }
    }
    // Per-process SM use: NVML's samples of the last few seconds, the newest per pid.
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
        .saturating_sub(5_000_000);
    let mut newest: Vec<(u32, u64, u32)> = Vec::new();
    for s in device.process_utilization_stats(since).unwrap_or_default() {
        match newest.iter_mut().find(|(pid, _, _)| *pid == s.pid) {
            Some(e) if e.1 < s.timestamp => *e = (s.pid, s.timestamp, s.sm_util),
            Some(_) => {}
            None => newest.push((s.pid, s.timestamp, s.sm_util)),
        }
    }
    for p in &mut out {
        p.sm_pct = newest.iter().find(|e| e.0 == p.pid).map(|e| e.2);
    }
    out.sort_by_key(|p| p.pid);
    out
}

fn gpu_process(kind: &str, info: &ProcessInfo) -> GpuProcess {
    GpuProcess {
        pid: info.pid,
        name: String::new(),
        user: None,
        gpu_memory_bytes: match info.used_gpu_memory {
            UsedGpuMemory::Used(bytes) => Some(bytes),
            UsedGpuMemory::Unavailable => None,
        },
        kind: kind.to_string(),
        sm_pct: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_flags_map_to_names() {
        let names =
            throttle_names(ThrottleReasons::SW_POWER_CAP | ThrottleReasons::HW_THERMAL_SLOWDOWN);
        assert_eq!(names, vec!["sw_power_cap", "hw_thermal_slowdown"]);
        assert!(throttle_names(ThrottleReasons::NONE).is_empty());
    }

    #[test]
    fn gpm_pcie_traffic_is_converted_to_kilobytes() {
        assert_eq!(mib_per_s_to_kbps(1.0), 1049);
        assert_eq!(mib_per_s_to_kbps(34_360.5), 36_029_596);
        assert_eq!(mib_per_s_to_kbps(1e12), u32::MAX);
    }

    #[test]
    fn missing_library_gives_a_readable_notice() {
        let err = NvmlError::DriverNotLoaded;
        let notice = unavailable_notice(&err);
        assert!(notice.starts_with("NVML not available (the NVIDIA driver is not loaded)"));
        assert!(notice.ends_with(NOTICE_TAIL));
    }
}
