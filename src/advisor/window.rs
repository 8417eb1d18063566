//! Sliding windows of snapshots and step timings, and the figures the rules read off them.

use std::collections::VecDeque;
use std::time::Duration;

use crate::engine::events::{ScuStats, StepStats};
use crate::telemetry::{GpuProcess, GpuSample, Snapshot};

/// Throttle reasons that mean "too hot" (hw_slowdown is mostly thermal; NVML lumps in
/// external power brakes).
const THERMAL_REASONS: [&str; 3] = ["sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"];
/// Throttle reasons that mean "at the power limit".
const POWER_REASONS: [&str; 2] = ["sw_power_cap", "hw_power_brake_slowdown"];

/// One step's timing, stamped with the advisor clock when it was observed.
#[derive(Clone, Debug)]
struct StepTiming {
    at_ms: u64,
    step_ms: f64,
    data_wait_ms: f64,
    /// Data parallelism: each rank's compute time, by rank.
    ranks: Vec<f64>,
}

/// Steps of memory history kept for the leak check (by step, not time: a leak is per step).
const MEMORY_STEPS: usize = 512;

/// One step's memory: host RSS and the device's memory in use (bytes), where known.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MemoryPoint {
    pub(crate) step: u64,
    pub(crate) host: Option<u64>,
    pub(crate) device: Option<u64>,
}

/// Steps of loss history kept for the stuck/diverging checks.
const LOSS_STEPS: usize = 1024;
/// SCU control steps kept for the clamp check.
const SCU_STEPS: usize = 1024;

/// One SCU control step, as the clamp check reads it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ControlPoint {
    pub(crate) step: u64,
    pub(crate) lambda: f64,
    /// Ŝ − S*.
    pub(crate) error: f64,
    pub(crate) target: f64,
    pub(crate) control: bool,
}

/// The last `length` of snapshots and step timings, on the snapshot clock.
#[derive(Debug)]
pub(crate) struct Window {
    length_ms: u64,
    snapshots: VecDeque<Snapshot>,
    steps: VecDeque<StepTiming>,
    /// The last [`MEMORY_STEPS`] steps' memory, on the step clock.
    memory: VecDeque<MemoryPoint>,
    /// Data parallelism: the ranks of the latest step (their GPUs' utilization, temperature).
    last_ranks: Vec<crate::engine::events::RankStat>,
    /// The last [`LOSS_STEPS`] training losses, by step.
    losses: VecDeque<(u64, f64)>,
    /// The last [`SCU_STEPS`] SCU control steps.
    control: VecDeque<ControlPoint>,
}

impl Window {
    pub(crate) fn new(length: Duration) -> Self {
        Self {
            length_ms: u64::try_from(length.as_millis()).unwrap_or(u64::MAX),
            snapshots: VecDeque::new(),
            steps: VecDeque::new(),
            memory: VecDeque::new(),
            last_ranks: Vec::new(),
            losses: VecDeque::new(),
            control: VecDeque::new(),
        }
    }

    /// The advisor clock: the timestamp of the latest snapshot (0 before the first).
    pub(crate) fn now_ms(&self) -> u64 {
        self.snapshots.back().map_or(0, |s| s.timestamp_ms)
    }

    /// Add a snapshot and drop what fell out of the window. A clock that jumps backwards
    /// (e.g. a new trace) starts the window afresh.
    pub(crate) fn push_snapshot(&mut self, snapshot: &Snapshot) {
        if snapshot.timestamp_ms < self.now_ms() {
            self.snapshots.clear();
            self.steps.clear();
            self.memory.clear();
        }
        self.snapshots.push_back(snapshot.clone());
        let oldest = self.now_ms().saturating_sub(self.length_ms);
        while self
            .snapshots
            .front()
            .is_some_and(|s| s.timestamp_ms < oldest)
        {
            self.snapshots.pop_front();
        }
        while self.steps.front().is_some_and(|s| s.at_ms < oldest) {
            self.steps.pop_front();
        }
    }

    /// Add a step timing, stamped with the current advisor clock.
    pub(crate) fn push_step(&mut self, step: &StepStats) {
        self.push_memory(step);
        if self.losses.back().is_some_and(|&(s, _)| s >= step.step) {
            self.losses.clear();
        }
        self.losses.push_back((step.step, step.loss));
        while self.losses.len() > LOSS_STEPS {
            self.losses.pop_front();
        }
        if step.step_ms.is_finite() && step.data_wait_ms.is_finite() && step.step_ms > 0.0 {
            self.steps.push_back(StepTiming {
                at_ms: self.now_ms(),
                step_ms: step.step_ms,
                data_wait_ms: step.data_wait_ms.clamp(0.0, step.step_ms),
                ranks: step.ranks.iter().map(|r| r.compute_ms).collect(),
            });
            self.last_ranks.clone_from(&step.ranks);
        }
    }

    /// A step's memory. `device`: whether `memory_bytes` is device memory (a CUDA run) or
    /// the process's RSS (the CPU). A step that does not follow the last (a new run, a resume
    /// from an earlier checkpoint) starts the history afresh.
    fn push_memory(&mut self, step: &StepStats) {
        if self.memory.back().is_some_and(|m| m.step >= step.step) {
            self.memory.clear();
        }
        self.memory.push_back(MemoryPoint {
            step: step.step,
            host: step.host_rss_bytes,
            device: step.memory_bytes,
        });
        while self.memory.len() > MEMORY_STEPS {
            self.memory.pop_front();
        }
    }

    /// The memory history (oldest first).
    pub(crate) fn memory(&self) -> &VecDeque<MemoryPoint> {
        &self.memory
    }

    /// A new run: its memory, losses and control are judged from its own first step.
    pub(crate) fn reset_memory(&mut self) {
        self.memory.clear();
        self.losses.clear();
        self.control.clear();
    }

    /// Add an SCU control step. One that does not follow the last starts afresh.
    pub(crate) fn push_control(&mut self, s: &ScuStats) {
        if self.control.back().is_some_and(|c| c.step >= s.step) {
            self.control.clear();
        }
        self.control.push_back(ControlPoint {
            step: s.step,
            lambda: s.lambda,
            error: s.s_hat - s.target,
            target: s.target,
            control: s.control,
        });
        while self.control.len() > SCU_STEPS {
            self.control.pop_front();
        }
    }

    /// The training losses held (oldest first; NaN for a non-finite loss).
    pub(crate) fn losses(&self) -> &VecDeque<(u64, f64)> {
        &self.losses
    }

    /// The SCU control steps held (oldest first).
    pub(crate) fn control(&self) -> &VecDeque<ControlPoint> {
        &self.control
    }

    /// The latest snapshot.
    pub(crate) fn latest(&self) -> Option<&Snapshot> {
        self.snapshots.back()
    }

    /// Step timings in the window.
    pub(crate) fn step_count(&self) -> usize {
        self.steps.len()
    }

    /// Time covered by the window so far, in seconds.
    pub(crate) fn span_s(&self) -> f64 {
        match (self.snapshots.front(), self.snapshots.back()) {
            (Some(first), Some(last)) => (last.timestamp_ms - first.timestamp_ms) as f64 / 1000.0,
            _ => 0.0,
        }
    }

    /// Share of step time spent waiting for data (0..1), when steps were seen.
    pub(crate) fn data_wait_share(&self) -> Option<f64> {
        let step: f64 = self.steps.iter().map(|s| s.step_ms).sum();
        let wait: f64 = self.steps.iter().map(|s| s.data_wait_ms).sum();
        (step > 0.0).then(|| wait / step)
    }

    /// Data parallelism: each rank's mean compute time over the window's steps, by rank
    /// (empty for a single process or a world size that changed within the window).
    pub(crate) fn rank_compute_means(&self) -> Vec<f64> {
        let Some(world) = self.steps.back().map(|s| s.ranks.len()) else {
            return Vec::new();
        };
        let steps: Vec<&StepTiming> = self
            .steps
            .iter()
            .filter(|s| s.ranks.len() == world)
            .collect();
        if world < 2 || steps.is_empty() {
            return Vec::new();
        }
        (0..world)
            .map(|r| steps.iter().map(|s| s.ranks[r]).sum::<f64>() / steps.len() as f64)
            .collect()
    }

    /// Data parallelism: rank `r` of the latest step.
    pub(crate) fn last_rank(&self, r: usize) -> Option<&crate::engine::events::RankStat> {
        self.last_ranks.iter().find(|s| s.rank == r)
    }

    /// Mean step time in the window, in ms.
    pub(crate) fn mean_step_ms(&self) -> Option<f64> {
        mean(self.steps.iter().map(|s| s.step_ms))
    }

    /// The window's samples of GPU `index`.
    pub(crate) fn gpu(&self, index: u32) -> GpuWindow<'_> {
        GpuWindow {
            samples: self
                .snapshots
                .iter()
                .filter_map(|s| s.gpus.iter().find(|g| g.index == index))
                .collect(),
        }
    }
}

/// The samples of one GPU in the window (oldest first).
pub(crate) struct GpuWindow<'a> {
    samples: Vec<&'a GpuSample>,
}

impl<'a> GpuWindow<'a> {
    pub(crate) fn len(&self) -> usize {
        self.samples.len()
    }

    pub(crate) fn latest(&self) -> Option<&'a GpuSample> {
        self.samples.last().copied()
    }

    /// Mean GPU utilization (%), over the samples that report it.
    pub(crate) fn util_avg(&self) -> Option<f64> {
        mean(
            self.samples
                .iter()
                .filter_map(|s| s.util_gpu.map(f64::from)),
        )
    }

    /// Mean SM activity (%, GPM), when the GPU reports it.
    pub(crate) fn sm_activity_avg(&self) -> Option<f64> {
        mean(self.samples.iter().filter_map(|s| s.sm_activity_pct))
    }

    /// Mean fraction of memory in use, over the samples that know the total.
    pub(crate) fn mem_frac_avg(&self) -> Option<f64> {
        mean(
            self.samples
                .iter()
                .filter(|s| s.mem_total_bytes > 0)
                .map(|s| s.mem_used_frac()),
        )
    }

    /// Fraction of samples for which `pred` holds (0 for an empty window).
    pub(crate) fn frac(&self, pred: impl Fn(&GpuSample) -> bool) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        self.samples.iter().filter(|s| pred(s)).count() as f64 / self.samples.len() as f64
    }

    /// Fraction of samples with no process and (almost) no activity.
    pub(crate) fn idle_frac(&self, idle_util_pct: f64) -> f64 {
        self.frac(|s| {
            s.processes.is_empty() && s.util_gpu.is_none_or(|u| f64::from(u) <= idle_util_pct)
        })
    }

    /// Fraction of samples with work on the GPU: a process listed, or utilization above
    /// `idle_util_pct` (NVML lists no process from inside some containers).
    pub(crate) fn busy_frac(&self, idle_util_pct: f64) -> f64 {
        1.0 - self.idle_frac(idle_util_pct)
    }

    /// Fraction of samples throttled for heat.
    pub(crate) fn thermal_frac(&self) -> f64 {
        self.frac(|s| has_any(s, &THERMAL_REASONS))
    }

    /// Fraction of samples throttled at the power limit.
    pub(crate) fn power_frac(&self) -> f64 {
        self.frac(|s| has_any(s, &POWER_REASONS))
    }

    /// Fraction of samples where processes compete for the GPU (see [`competitors`]).
    pub(crate) fn contention_frac(&self, own_pid: u32) -> f64 {
        self.frac(|s| !competitors(s, own_pid).is_empty())
    }

    /// The highest temperature seen (°C).
    pub(crate) fn temperature_max(&self) -> Option<u32> {
        self.samples.iter().filter_map(|s| s.temperature_c).max()
    }

    /// Mean power draw (W).
    pub(crate) fn power_avg(&self) -> Option<f64> {
        mean(self.samples.iter().filter_map(|s| s.power_w))
    }

    /// Mean SM clock (MHz).
    pub(crate) fn sm_clock_avg(&self) -> Option<f64> {
        mean(
            self.samples
                .iter()
                .filter_map(|s| s.sm_clock_mhz.map(f64::from)),
        )
    }
}

/// Processes that compete with the workload on a GPU: when this cockpit is on it, every
/// other process; otherwise (monitoring someone else's job), all of them once there are two
/// or more.
pub(crate) fn competitors(sample: &GpuSample, own_pid: u32) -> Vec<&GpuProcess> {
    let ours = sample.processes.iter().any(|p| p.pid == own_pid);
    if ours {
        sample
            .processes
            .iter()
            .filter(|p| p.pid != own_pid)
            .collect()
    } else if sample.processes.len() >= 2 {
        sample.processes.iter().collect()
    } else {
        Vec::new()
    }
}

fn has_any(sample: &GpuSample, reasons: &[&str]) -> bool {
    sample
        .throttle_reasons
        .iter()
        .any(|r| reasons.contains(&r.as_str()))
}

/// The active throttle reasons of a sample that belong to `group` ("thermal" or "power").
pub(crate) fn throttle_reasons_in(sample: &GpuSample, thermal: bool) -> Vec<&str> {
    let group: &[&str] = if thermal {
        &THERMAL_REASONS
    } else {
        &POWER_REASONS
    };
    sample
        .throttle_reasons
        .iter()
        .map(String::as_str)
        .filter(|r| group.contains(r))
        .collect()
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(sum, n), v| (sum + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}
