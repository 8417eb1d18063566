//! Advisor tuning: window length, hysteresis, and the thresholds of each rule.

use std::time::Duration;

/// A hysteresis band: a condition fires past `fire` and clears only past `clear`, which lies
/// on the other side of `fire`, so a figure wandering around one threshold does not flap.
///
/// For an "above" rule `fire > clear` (e.g. memory: fire at 0.90, clear at 0.85); for a
/// "below" rule `fire < clear` (e.g. utilization: fire under 50%, clear over 65%).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Band {
    pub fire: f64,
    pub clear: f64,
}

impl Band {
    /// A band with the given fire and clear thresholds.
    pub const fn new(fire: f64, clear: f64) -> Self {
        Self { fire, clear }
    }

    /// Where `value` stands for a rule that fires when the figure is high.
    pub fn above(&self, value: f64) -> Level {
        if value >= self.fire {
            Level::Fire
        } else if value <= self.clear {
            Level::Clear
        } else {
            Level::Hold
        }
    }

    /// Where `value` stands for a rule that fires when the figure is low.
    pub fn below(&self, value: f64) -> Level {
        if value <= self.fire {
            Level::Fire
        } else if value >= self.clear {
            Level::Clear
        } else {
            Level::Hold
        }
    }

    /// The mirror band: fires where this one clears and clears where this one fires.
    pub const fn mirrored(&self) -> Self {
        Self {
            fire: self.clear,
            clear: self.fire,
        }
    }
}

/// Where a rule's condition stands at one evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Past the fire threshold.
    Fire,
    /// Between the thresholds: keep the current state.
    Hold,
    /// Past the clear threshold.
    Clear,
}

impl Level {
    /// Both conditions together: fires when both fire, clears when either clears.
    pub fn and(self, other: Level) -> Level {
        match (self, other) {
            (Level::Fire, Level::Fire) => Level::Fire,
            (Level::Clear, _) | (_, Level::Clear) => Level::Clear,
            _ => Level::Hold,
        }
    }

    /// `Fire` when `cond` holds, `Clear` otherwise.
    pub fn when(cond: bool) -> Level {
        if cond {
            Level::Fire
        } else {
            Level::Clear
        }
    }
}

/// How the advisor judges; every figure is over the sliding window.
#[derive(Clone, Debug, PartialEq)]
pub struct AdvisorOptions {
    /// Length of the sliding window (default 30 s), measured on snapshot timestamps.
    pub window: Duration,
    /// Consecutive evaluations a rule must fire (or clear) before it is shown (or removed).
    pub confirm_samples: u32,
    /// Snapshots the window must hold before GPU rules are judged.
    pub min_window_samples: usize,
    /// Step timings the window must hold before data-wait rules are judged.
    pub min_window_steps: usize,
    /// Mean GPU utilization (%) under which a busy GPU counts as under-used.
    pub util_low: Band,
    /// Mean GPU utilization (%) over which a GPU counts as well utilized.
    pub util_good: Band,
    /// Share of step time spent waiting for data (0..1) that makes a run data-bound.
    pub data_wait: Band,
    /// Mean memory use (fraction of total) under which there is room for a larger batch.
    pub mem_low: Band,
    /// Mean memory use (fraction of total) over which the GPU is close to running out.
    pub mem_high: Band,
    /// A sample counts as idle when it has no process and utilization at most this (%).
    pub idle_util_pct: f64,
    /// Fraction of idle samples that makes the GPU idle.
    pub idle: Band,
    /// Fraction of samples with thermal (or power) throttling that is worth a word.
    pub throttle: Band,
    /// Fraction of samples with a competing process on the GPU.
    pub contention: Band,
    /// Process id of this cockpit (the training engine runs inside it).
    pub own_pid: u32,
    /// Data parallelism: the slowest rank's compute time over the median rank's (every rank
    /// waits for the slowest at each all-reduce).
    pub straggler: Band,
    /// Memory growth over the steps judged, as a share of what counts as a leak (the larger
    /// of [`AdvisorOptions::memory_climb_bytes`] and [`AdvisorOptions::memory_climb_frac`] of
    /// the memory at the first step judged): 1 fires.
    pub memory_climb: Band,
    /// Least growth (bytes) over the steps judged that is a leak.
    pub memory_climb_bytes: f64,
    /// Least growth, as a fraction of the memory in use, that is a leak.
    pub memory_climb_frac: f64,
    /// Steps (after the warm-up) the memory history must hold before it is judged.
    pub memory_climb_steps: usize,
    /// SCU control steps in a row with λ pinned at a clamp (and Ŝ on the side that pushes
    /// it there) that make the setpoint unreachable.
    pub lambda_clamped_steps: usize,
    /// Steps a run must have made before its loss is judged stuck.
    pub loss_stuck_steps: u64,
    /// How far the loss has come down from the run's start, as a fraction of it: under
    /// `fire` it is stuck.
    pub loss_stuck: Band,
    /// How far the smoothed loss has climbed above the best it reached, as a fraction of
    /// that best: past `fire` it diverges.
    pub loss_diverging: Band,
    /// ... and by at least this much (nats), so that a tiny loss's noise is no divergence.
    pub loss_diverging_nats: f64,
}

impl Default for AdvisorOptions {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(30),
            confirm_samples: 3,
            min_window_samples: 5,
            min_window_steps: 3,
            util_low: Band::new(50.0, 65.0),
            util_good: Band::new(80.0, 70.0),
            data_wait: Band::new(0.25, 0.15),
            mem_low: Band::new(0.30, 0.40),
            mem_high: Band::new(0.90, 0.85),
            idle_util_pct: 5.0,
            idle: Band::new(0.95, 0.80),
            throttle: Band::new(0.30, 0.10),
            contention: Band::new(0.50, 0.10),
            straggler: Band::new(1.15, 1.07),
            memory_climb: Band::new(1.0, 0.5),
            memory_climb_bytes: 32.0 * 1024.0 * 1024.0,
            memory_climb_frac: 0.05,
            memory_climb_steps: 50,
            lambda_clamped_steps: 50,
            loss_stuck_steps: 200,
            loss_stuck: Band::new(0.02, 0.05),
            loss_diverging: Band::new(0.25, 0.10),
            loss_diverging_nats: 0.1,
            own_pid: std::process::id(),
        }
    }
}

impl AdvisorOptions {
    /// Options for judging a single snapshot (`cockpit monitor --once`): no confirmation
    /// streak and a one-sample window.
    pub fn instant() -> Self {
        Self {
            confirm_samples: 1,
            min_window_samples: 1,
            min_window_steps: 1,
            ..Self::default()
        }
    }

    /// The same options with a different window length.
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn band_has_a_dead_zone() {
        let mem = Band::new(0.90, 0.85);
        assert_eq!(mem.above(0.95), Level::Fire);
        assert_eq!(mem.above(0.87), Level::Hold);
        assert_eq!(mem.above(0.50), Level::Clear);
        let util = Band::new(50.0, 65.0);
        assert_eq!(util.below(30.0), Level::Fire);
        assert_eq!(util.below(60.0), Level::Hold);
        assert_eq!(util.below(90.0), Level::Clear);
        assert_eq!(util.mirrored().above(70.0), Level::Fire);
    }

    #[test]
    fn levels_combine() {
        assert_eq!(Level::Fire.and(Level::Fire), Level::Fire);
        assert_eq!(Level::Fire.and(Level::Hold), Level::Hold);
        assert_eq!(Level::Hold.and(Level::Clear), Level::Clear);
    }
}
