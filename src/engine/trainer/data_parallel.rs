//! The trainer's side of data parallelism: what it lends the run's strategy
//! ([`super::parallel`]: single process, DDP or ZeRO-1) at each point of a step.

use super::parallel::{Local, Parts, Penalty, Reduced};
use super::Trainer;
use crate::engine::EngineError;
use candle_core::Tensor;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

impl Trainer {
    /// The parts of the trainer a strategy works on.
    fn parts(&mut self) -> (&mut dyn super::parallel::DataParallel, Parts<'_>) {
        (
            self.parallel.as_mut(),
            Parts {
                opt: &mut self.opt,
                whole: self.whole_step.as_mut(),
                device: &self.device,
            },
        )
    }

    /// Several processes train this job.
    pub(super) fn multi_process(&self) -> bool {
        self.parallel.backend().is_some()
    }

    /// Every rank takes rank 0's weights.
    pub(super) fn sync_weights(&mut self) -> Result<(), EngineError> {
        self.weights_copied = false;
        self.parallel.sync_weights(&self.model.params)
    }

    /// After the backward: the mean of the gradients and of the loss over the ranks (so
    /// every rank takes the same optimizer step and SCU sees the global loss), and every
    /// rank's timings. A single process passes its values through.
    pub(super) fn reduce_step(
        &mut self,
        ce: f64,
        grads: Vec<Tensor>,
        wait: Duration,
        compute: Duration,
    ) -> Result<Reduced, EngineError> {
        let gauge = |g: Option<&AtomicU32>| {
            g.map(|a| a.load(Ordering::Relaxed))
                .filter(|&v| v != u32::MAX)
                .map(f64::from)
        };
        let local = Local {
            ce,
            grads,
            compute,
            wait,
            memory: self.step_memory,
            util: gauge(self.progress.as_deref().map(|p| &p.gpu_util_pct)),
            temp: gauge(self.progress.as_deref().map(|p| &p.gpu_temp_c)),
            time_due: self.time_due,
        };
        let lambda = self.scu.lambda;
        let grad_factor = if lambda == 0.0 {
            0.0
        } else {
            2.0 * lambda * self.penalty_coef() * self.scaler.scale
        };
        let sumsq_due = self.control_due();
        let multi = self.multi_process();
        self.set_waiting(multi);
        let reg_slots = std::mem::take(&mut self.reg_slots);
        let penalty = Penalty {
            reg_slots: &reg_slots,
            sumsq_due,
            grad_factor,
        };
        let (strategy, parts) = self.parts();
        let r = strategy.reduce(parts, local, penalty);
        self.reg_slots = reg_slots;
        self.set_waiting(false);
        r
    }

    /// The optimizer step on the reduced gradients (scaled by `f`).
    pub(super) fn apply_update(&mut self, r: &Reduced, lr: f64, f: f64) -> Result<(), EngineError> {
        let (strategy, parts) = self.parts();
        self.weights_copied = strategy.update(parts, r, lr, f)?;
        Ok(())
    }

    /// Every rank's fp32 master weights made whole (ZeRO-1 after updates that left them
    /// partial; a collective there). Nothing to do otherwise.
    pub(super) fn full_masters(&mut self) -> Result<(), EngineError> {
        let (strategy, parts) = self.parts();
        strategy.whole_masters(parts)
    }

    /// ZeRO-1: every slot's full moments for a checkpoint (on rank 0). None: the
    /// optimizer holds them.
    pub(super) fn gather_moments(&mut self) -> Result<Option<Vec<(String, Tensor)>>, EngineError> {
        let (strategy, parts) = self.parts();
        strategy.gather_moments(parts)
    }

    /// ZeRO-1 is on: several ranks and `distributed.shard_optimizer`.
    pub(super) fn sharding(&self) -> bool {
        self.parallel.sharded()
    }

    pub(super) fn set_waiting(&self, on: bool) {
        if let Some(p) = &self.progress {
            p.waiting.store(on, Ordering::Relaxed);
        }
    }
}
