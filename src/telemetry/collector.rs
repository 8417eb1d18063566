//! [`Collector`]: one [`Snapshot`] of all GPUs and the host, on demand.

use std::time::{SystemTime, UNIX_EPOCH};

use super::gpu::GpuSampler;
use super::host::HostSampler;
use super::Snapshot;

/// Takes snapshots of every GPU (through NVML, when present) and of the host.
///
/// NVML is initialised once per process, on the first `Collector`; later ones reuse it.
/// Without NVML the collector still works: its snapshots carry host metrics only and
/// [`Collector::notice`] in [`Snapshot::gpu_notice`].
pub struct Collector {
    gpu: Option<GpuSampler>,
    host: HostSampler,
    notice: Option<String>,
}

impl Collector {
    /// Open NVML (if it is there) and prime the host counters.
    ///
    /// CPU usage is measured between two snapshots; the first one is meaningful only after
    /// [`sysinfo::MINIMUM_CPU_UPDATE_INTERVAL`] (200 ms) has passed since this call.
    pub fn new() -> Self {
        let (gpu, notice) = match GpuSampler::new() {
            Ok(gpu) => (Some(gpu), None),
            Err(notice) => {
                tracing::info!("{notice}");
                (None, Some(notice))
            }
        };
        Self {
            gpu,
            host: HostSampler::new(),
            notice,
        }
    }

    /// Why there are no GPU metrics, when there are none.
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// Take one snapshot now.
    pub fn sample(&mut self) -> Snapshot {
        let timestamp_ms = now_ms();
        let mut gpus = self
            .gpu
            .as_mut()
            .map(GpuSampler::sample)
            .unwrap_or_default();
        self.host
            .describe_processes(gpus.iter_mut().flat_map(|g| g.processes.iter_mut()));
        Snapshot {
            timestamp_ms,
            gpus,
            host: self.host.sample(),
            gpu_notice: self.notice.clone(),
        }
    }
}

impl Default for Collector {
    fn default() -> Self {
        Self::new()
    }
}

/// One snapshot, for `cockpit monitor --once`.
///
/// Blocks for [`sysinfo::MINIMUM_CPU_UPDATE_INTERVAL`] (200 ms) so that CPU usage, and on
/// Hopper+ GPUs SM activity, are measured over a real interval.
pub fn sample_once() -> Snapshot {
    let mut collector = Collector::new();
    // The first sample only primes the GPM counters (SM activity needs two).
    let _ = collector.sample();
    std::thread::sleep(sysinfo::MINIMUM_CPU_UPDATE_INTERVAL);
    collector.sample()
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
