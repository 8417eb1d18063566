//! The advisor: rules over a sliding window of telemetry and step timings.
//!
//! [`Advisor`] is a plain struct (no thread): feed it [`Snapshot`]s, the run's [`RunInfo`]
//! and [`StepStats`], and ask for the [`Recommendation`]s standing now. Every figure is taken
//! over a sliding window (default 30 s, on snapshot timestamps, so a replayed trace gives the
//! same advice as the live session did). Each rule has separate fire and clear thresholds
//! (a [`Band`]) and must hold on several consecutive evaluations
//! ([`AdvisorOptions::confirm_samples`]) before its advice appears or goes away, so a single
//! spike neither raises nor clears anything.
//!
//! Rules (ids in [`ids`]), per GPU unless noted:
//! * `idle` — no process and ~0% utilization, no training attached; the only advice for
//!   that GPU while it stands.
//! * `data_bound` — low utilization while a large share of step time is data wait (needs
//!   step timings; job-level when no GPU is visible).
//! * `launch_bound` — low utilization with little data wait: batch too small or host-bound
//!   kernel launches (key `+`).
//! * `underutilized` — low utilization with a job on the GPU but no step timings
//!   (monitor-only).
//! * `mem_low` / `mem_high` — memory under 30% (key `+`) / over 90% (key `-`).
//! * `fp32_on_tensor_cores` — an fp32 run on compute capability ≥ 7.0.
//! * `thermal_throttle` / `power_throttle` — clocks cut for heat / at the power limit.
//! * `gpu_contention` — other processes on the GPU.
//! * `well_utilized` — high utilization and no warning standing.
//! * `memory_climb` (job-level) — host RSS or the run's device memory grows step after step
//!   past the warm-up (a leak), with the steps left until memory is full; critical when that
//!   comes before `max_steps`.
//! * `lambda_clamped` (job-level) — SCU's λ pinned at a clamp (λ_max with Ŝ above S*, λ_min
//!   below it) for many control steps: the setpoint is out of the controller's reach.
//! * `loss_stuck` (job-level) — the training loss has not come down from where the run
//!   started, many steps in.
//! * `loss_diverging` (job-level, critical) — the smoothed loss has climbed well above the
//!   best it reached, or the loss is no longer finite.
mod recommendation;
pub use recommendation::*;

mod latch;
mod options;
mod rules;
pub mod trend;
mod window;

pub use options::{AdvisorOptions, Band, Level};

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::engine::events::{Event, RunInfo, StepStats};
use crate::telemetry::Snapshot;

use latch::Latch;
use rules::{Candidate, Context};
use window::Window;

/// Stable recommendation ids.
pub mod ids {
    /// GPU with no process and no activity.
    pub const IDLE: &str = "idle";
    /// Low utilization because the step waits for data.
    pub const DATA_BOUND: &str = "data_bound";
    /// Low utilization with data ready: batch too small or host-bound launches.
    pub const LAUNCH_BOUND: &str = "launch_bound";
    /// Low utilization of a GPU with a job on it, without step timings.
    pub const UNDERUTILIZED: &str = "underutilized";
    /// Memory mostly unused: room for a larger batch.
    pub const MEM_LOW: &str = "mem_low";
    /// Memory nearly full.
    pub const MEM_HIGH: &str = "mem_high";
    /// fp32 training on a GPU with tensor cores.
    pub const FP32_ON_TENSOR_CORES: &str = "fp32_on_tensor_cores";
    /// Clocks cut for heat.
    pub const THERMAL_THROTTLE: &str = "thermal_throttle";
    /// Clocks held at the power limit.
    pub const POWER_THROTTLE: &str = "power_throttle";
    /// Other processes share the GPU.
    pub const GPU_CONTENTION: &str = "gpu_contention";
    /// All good.
    pub const WELL_UTILIZED: &str = "well_utilized";
    /// Data parallelism: one rank is slower than the rest, and all of them wait for it.
    pub const STRAGGLER: &str = "straggler";
    /// Host or device memory grows step after step: a leak that ends the run when memory
    /// runs out.
    pub const MEMORY_CLIMB: &str = "memory_climb";
    /// SCU's λ pinned at a clamp: the setpoint is out of reach.
    pub const LAMBDA_CLAMPED: &str = "lambda_clamped";
    /// The loss has not come down since the start.
    pub const LOSS_STUCK: &str = "loss_stuck";
    /// The loss climbs away from the best it reached, or is not finite.
    pub const LOSS_DIVERGING: &str = "loss_diverging";
}

/// Identifies one rule's standing: (rule id, GPU index or `None` for the whole job).
type LatchKey = (String, Option<u32>);

/// Turns telemetry and step timings into recommendations. See the [module docs](self).
#[derive(Debug)]
pub struct Advisor {
    opts: AdvisorOptions,
    window: Window,
    run: Option<RunInfo>,
    latches: BTreeMap<LatchKey, Latch>,
}

impl Advisor {
    /// An advisor with no history.
    pub fn new(opts: AdvisorOptions) -> Self {
        Self {
            window: Window::new(opts.window),
            opts,
            run: None,
            latches: BTreeMap::new(),
        }
    }

    /// The options it judges by.
    pub fn options(&self) -> &AdvisorOptions {
        &self.opts
    }

    /// Add a snapshot and re-evaluate every rule. Snapshots are the advisor's clock.
    pub fn observe_snapshot(&mut self, snapshot: &Snapshot) {
        self.window.push_snapshot(snapshot);
        self.evaluate();
    }

    /// A training run is attached (or restarted with new settings).
    pub fn observe_run(&mut self, run: &RunInfo) {
        self.run = Some(run.clone());
        self.window.reset_memory();
    }

    /// The attached run ended: back to monitor-only judgement.
    pub fn end_run(&mut self) {
        self.run = None;
    }

    /// Add one optimizer step's timings (stamped with the latest snapshot's time).
    pub fn observe_step(&mut self, step: &StepStats) {
        self.window.push_step(step);
    }

    /// Feed an engine event: `RunStarted`, `Step` and `Scu` are used, `Finished` detaches
    /// the run, the rest is ignored.
    pub fn observe_event(&mut self, event: &Event) {
        match event {
            Event::RunStarted(run) => self.observe_run(run),
            Event::Step(step) => self.observe_step(step),
            Event::Scu(scu) => self.window.push_control(scu),
            Event::Finished { .. } => self.end_run(),
            _ => {}
        }
    }

    /// The advice standing now, most severe first (then by GPU, then by id).
    ///
    /// While a GPU is `idle`, that is the only advice given for it.
    pub fn recommendations(&self) -> Vec<Recommendation> {
        let idle: BTreeSet<Option<u32>> = self
            .latches
            .iter()
            .filter(|((id, _), latch)| id == ids::IDLE && latch.active())
            .map(|((_, gpu), _)| *gpu)
            .collect();
        let mut recs: Vec<Recommendation> = self
            .latches
            .iter()
            .filter(|((id, gpu), latch)| latch.active() && (id == ids::IDLE || !idle.contains(gpu)))
            .map(|(_, latch)| latch.rec().clone())
            .collect();
        recs.sort_by(|a, b| {
            (Reverse(a.severity), a.gpu, &a.id).cmp(&(Reverse(b.severity), b.gpu, &b.id))
        });
        recs
    }

    fn evaluate(&mut self) {
        let gpus: Vec<u32> = self
            .window
            .latest()
            .map(|s| s.gpus.iter().map(|g| g.index).collect())
            .unwrap_or_default();

        let mut candidates = Vec::new();
        {
            let ctx = self.context();
            for &index in &gpus {
                rules::gpu_rules(&ctx, index, &mut candidates);
            }
            rules::job_rules(&ctx, &mut candidates);
        }
        self.apply(candidates, |id| id != ids::WELL_UTILIZED);

        // "All good" only where no warning stands, for the GPU or for the whole job.
        let warned: BTreeSet<Option<u32>> = self
            .latches
            .iter()
            .filter(|(_, latch)| latch.active() && latch.rec().severity >= Severity::Warn)
            .map(|((_, gpu), _)| *gpu)
            .collect();
        let job_warned = warned.contains(&None);
        let candidates: Vec<Candidate> = {
            let ctx = self.context();
            gpus.iter()
                .filter_map(|&index| {
                    let blocked = job_warned || warned.contains(&Some(index));
                    rules::well_utilized(&ctx, index, blocked)
                })
                .collect()
        };
        self.apply(candidates, |id| id == ids::WELL_UTILIZED);
    }

    fn context(&self) -> Context<'_> {
        Context {
            opts: &self.opts,
            window: &self.window,
            run: self.run.as_ref(),
        }
    }

    /// Feed this evaluation's verdicts to the latches of the rules selected by `covers`; a
    /// covered latch without a verdict (the rule no longer applies) is fed `Clear`.
    fn apply(&mut self, candidates: Vec<Candidate>, covers: impl Fn(&str) -> bool) {
        let confirm = self.opts.confirm_samples;
        let mut seen = BTreeSet::new();
        for Candidate { level, rec } in candidates {
            let key = (rec.id.clone(), rec.gpu);
            seen.insert(key.clone());
            match self.latches.get_mut(&key) {
                Some(latch) => latch.update(level, confirm, Some(rec)),
                None if level == Level::Fire => {
                    let mut latch = Latch::new(rec);
                    latch.update(level, confirm, None);
                    self.latches.insert(key, latch);
                }
                None => {}
            }
        }
        for (key, latch) in self.latches.iter_mut() {
            if covers(&key.0) && !seen.contains(key) {
                latch.update(Level::Clear, confirm, None);
            }
        }
        self.latches.retain(|_, latch| !latch.dormant());
    }
}
