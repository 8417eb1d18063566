//! Fault injection for tests: NaN losses, a failing or hanging step, out of memory above a
//! micro-batch.
//!
//! Live only with the `fault-injection` feature. `cargo test` turns it on (the crate's
//! dev-dependency on itself asks for it), so the tests drive these faults through
//! [`EngineOptions::faults`](super::EngineOptions::faults) and, on the binary, the
//! `COCKPIT_FAULT_*` variables; `cargo build` and `cargo install` leave it off, and then a
//! [`Faults`] holds nothing and injects nothing.

use super::EngineError;

/// The faults to inject into a run (none by default).
#[derive(Clone, Debug, Default)]
#[cfg_attr(not(feature = "fault-injection"), non_exhaustive)]
pub struct Faults {
    /// Optimizer steps (1-based) whose loss is made NaN, once each.
    #[cfg(feature = "fault-injection")]
    pub nan_steps: Vec<u64>,
    /// Fail this optimizer step (1-based) with an error.
    #[cfg(feature = "fault-injection")]
    pub fail_step: Option<u64>,
    /// Hang (as a stuck rank would) before this optimizer step (1-based).
    #[cfg(feature = "fault-injection")]
    pub hang_step: Option<u64>,
    /// A forward/backward at a micro-batch above this fails as out of memory (a device
    /// smaller than the batch).
    #[cfg(feature = "fault-injection")]
    pub oom_above: Option<usize>,
}

#[cfg(feature = "fault-injection")]
impl Faults {
    /// The faults the environment asks for, for the process of `rank`:
    /// `COCKPIT_FAULT_NAN_STEPS=10,11,12` makes those steps' loss NaN (once each);
    /// `COCKPIT_FAULT_FAIL=RANK:STEP` makes that rank's engine fail at that optimizer step
    /// (1-based), `COCKPIT_FAULT_HANG=RANK:STEP` hang there.
    pub fn from_env(rank: usize) -> Self {
        let nan_steps = std::env::var("COCKPIT_FAULT_NAN_STEPS")
            .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
            .unwrap_or_default();
        Self {
            nan_steps,
            fail_step: rank_step("COCKPIT_FAULT_FAIL", rank),
            hang_step: rank_step("COCKPIT_FAULT_HANG", rank),
            oom_above: None,
        }
    }

    /// Whether a NaN is injected into optimizer step `step` (1-based); each only once.
    pub(crate) fn take_nan(&mut self, step: u64) -> bool {
        match self.nan_steps.iter().position(|&s| s == step) {
            Some(i) => {
                self.nan_steps.remove(i);
                true
            }
            None => false,
        }
    }

    /// Hang for good when optimizer step `step` (1-based) is the one to hang at.
    pub(crate) fn hang_at(&self, step: u64) {
        if self.hang_step == Some(step) {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }

    /// The error optimizer step `step` (1-based) fails with, when it is the one to fail.
    pub(crate) fn fail_at(&self, step: u64) -> Result<(), EngineError> {
        if self.fail_step == Some(step) {
            return Err(EngineError::Diverged {
                step,
                message: "injected fault (COCKPIT_FAULT_FAIL)".into(),
            });
        }
        Ok(())
    }

    /// Out of memory when a forward/backward at `micro_batch` is to fail.
    pub(crate) fn oom_at(&self, micro_batch: usize) -> candle_core::Result<()> {
        if self.oom_above.is_some_and(|n| micro_batch > n) {
            return Err(candle_core::Error::Msg(
                "injected fault: CUDA_ERROR_OUT_OF_MEMORY, out of memory".into(),
            ));
        }
        Ok(())
    }
}

/// `VAR=RANK:STEP`: STEP when RANK is `rank`.
#[cfg(feature = "fault-injection")]
fn rank_step(var: &str, rank: usize) -> Option<u64> {
    let v = std::env::var(var).ok()?;
    let (r, s) = v.split_once(':')?;
    (r.trim().parse::<usize>().ok()? == rank)
        .then(|| s.trim().parse().ok())
        .flatten()
}

/// Without the feature: nothing is read, nothing is injected.
#[cfg(not(feature = "fault-injection"))]
impl Faults {
    /// No faults: the `COCKPIT_FAULT_*` variables are not read in this build.
    pub fn from_env(_rank: usize) -> Self {
        Self::default()
    }

    #[inline(always)]
    pub(crate) fn take_nan(&mut self, _step: u64) -> bool {
        false
    }

    #[inline(always)]
    pub(crate) fn hang_at(&self, _step: u64) {}

    #[inline(always)]
    pub(crate) fn fail_at(&self, _step: u64) -> Result<(), EngineError> {
        Ok(())
    }

    #[inline(always)]
    pub(crate) fn oom_at(&self, _micro_batch: usize) -> candle_core::Result<()> {
        Ok(())
    }
}
