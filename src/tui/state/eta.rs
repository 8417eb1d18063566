//! Time left in a run, by one formula for every front end (the dashboard, the headless
//! progress line and attached viewers): the steps left to `max_steps` at the mean wall time per
//! step over the last [`ETA_WINDOW`] steps. Wall time comes from the engine's `elapsed_s`, so
//! evaluations and checkpoints count; an interval that spans a pause does not.

use super::history::Ring;
use crate::engine::events::{Event, StepStats};

/// Steps averaged.
pub const ETA_WINDOW: usize = 50;

/// The ETA estimator. Feed it every event ([`Eta::observe`]).
#[derive(Clone, Debug)]
pub struct Eta {
    /// Seconds per step between consecutive step events.
    per_step: Ring<f64>,
    /// The last step seen, with its `elapsed_s`.
    last: Option<(u64, f64)>,
    /// A pause came since the last step: the next interval holds it and is left out.
    skip_next: bool,
    /// The latest step's own time (ms), for the first interval.
    step_ms: Option<f64>,
}

impl Default for Eta {
    fn default() -> Self {
        Eta {
            per_step: Ring::new(ETA_WINDOW),
            last: None,
            skip_next: false,
            step_ms: None,
        }
    }
}

impl Eta {
    /// Takes in one engine event (steps and pauses matter).
    pub fn observe(&mut self, event: &Event) {
        match event {
            Event::Step(s) => self.on_step(s),
            Event::Paused { .. } | Event::Resumed { .. } => self.skip_next = true,
            _ => {}
        }
    }

    fn on_step(&mut self, s: &StepStats) {
        if let Some((step, elapsed)) = self.last {
            let dt = s.elapsed_s - elapsed;
            if !self.skip_next && s.step > step && dt.is_finite() && dt >= 0.0 {
                self.per_step.push(dt / (s.step - step) as f64);
            }
        }
        self.skip_next = false;
        if s.elapsed_s.is_finite() {
            self.last = Some((s.step, s.elapsed_s));
        }
        if s.step_ms.is_finite() && s.step_ms > 0.0 {
            self.step_ms = Some(s.step_ms);
        }
    }

    /// Mean seconds per step lately, when known.
    pub fn seconds_per_step(&self) -> Option<f64> {
        if self.per_step.is_empty() {
            return self.step_ms.map(|ms| ms / 1000.0);
        }
        Some(self.per_step.iter().sum::<f64>() / self.per_step.len() as f64)
    }

    /// Seconds from `step` to `max_steps`.
    pub fn eta_s(&self, step: u64, max_steps: u64) -> Option<f64> {
        Some(max_steps.saturating_sub(step) as f64 * self.seconds_per_step()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headless::fixtures::step_stats;

    fn step(step: u64, elapsed_s: f64) -> Event {
        Event::Step(step_stats(step, elapsed_s, 100.0))
    }

    #[test]
    fn a_pause_does_not_count() {
        let mut eta = Eta::default();
        eta.observe(&step(1, 0.1));
        assert_eq!(eta.eta_s(1, 11), Some(1.0), "the step's own time at first");
        eta.observe(&step(2, 0.3));
        eta.observe(&step(3, 0.5));
        eta.observe(&Event::Paused { step: 3 });
        eta.observe(&Event::Resumed { step: 3 });
        eta.observe(&step(4, 60.7)); // one minute paused
        eta.observe(&step(6, 61.1)); // a dropped step event: two steps in 0.4 s
        let left = eta.eta_s(6, 16).unwrap();
        assert!((left - 2.0).abs() < 1e-9, "{left}");
    }
}
