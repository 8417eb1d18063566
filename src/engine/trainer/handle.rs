//! The engine's public handle: what to run, the thread it trains on, how the run ended.

use super::Trainer;
use crate::config::Config;
use crate::engine::events::{self, Command, EvalStats, Event, EventRx, FinishReason};
use crate::engine::faults::Faults;
use crate::engine::EngineError;
use crate::util::DeviceSpec;
use std::path::PathBuf;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;

/// What to run.
#[derive(Debug)]
pub struct EngineOptions {
    pub config: Config,
    pub run_dir: PathBuf,
    pub device: DeviceSpec,
    /// Resume from this checkpoint (a step dir, a checkpoints dir or a run dir).
    pub resume: Option<PathBuf>,
    /// Undelivered Step events the channel holds before dropping new ones.
    pub max_queued_steps: usize,
    /// Data parallelism: this rank after the rendezvous (None: a single process).
    /// `run_dir` is then the job's run dir (rank 0's); ranks other than 0 write their own
    /// metrics under `run_dir/ranks/rank-N/` and never write checkpoints.
    pub dist: Option<crate::distributed::Joined>,
    /// Set to the step number after every optimizer step, and to `u64::MAX` when the run
    /// ends: a watchdog can tell a run stuck (e.g. in a collective) from a slow one.
    pub progress: Option<std::sync::Arc<events::Progress>>,
    /// Time every kernel of the whole-model CUDA step with CUDA events and report the GPU
    /// time per kernel group in each step's `kernels` (`cockpit bench --profile`).
    pub profile_kernels: bool,
    /// Faults to inject, for tests (inert without the `fault-injection` feature).
    #[doc(hidden)]
    pub faults: Faults,
}

impl EngineOptions {
    /// A fresh run of `config` in `run_dir` on `device`: no resume, a deep event queue, no
    /// data parallelism, no fault injection. Set the other fields with `..` where needed.
    pub fn new(config: Config, run_dir: PathBuf, device: DeviceSpec) -> Self {
        Self {
            config,
            run_dir,
            device,
            resume: None,
            max_queued_steps: 1_000_000,
            dist: None,
            progress: None,
            profile_kernels: false,
            faults: Faults::default(),
        }
    }
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    pub reason: FinishReason,
    pub step: u64,
    pub last_loss: Option<f64>,
    pub last_val: Option<EvalStats>,
    pub last_checkpoint: Option<PathBuf>,
    pub entropy_floor_bpt: Option<f64>,
    pub final_lambda: f64,
    pub final_s: Option<f64>,
}

/// A running engine: send commands, receive events, then wait for the summary.
pub struct Engine {
    pub commands: Sender<Command>,
    pub events: EventRx,
    pub thread: EngineThread,
}

pub struct EngineThread(JoinHandle<Result<RunSummary, EngineError>>);

impl EngineThread {
    pub fn wait(self) -> Result<RunSummary, EngineError> {
        self.0.join().map_err(|_| EngineError::Panicked)?
    }
}

impl Engine {
    /// Set up (device, data, model, optimiser, resume) on the calling thread — so setup errors
    /// surface before any UI starts — then train on a new thread.
    pub fn spawn(opts: EngineOptions) -> Result<Engine, EngineError> {
        let trainer = Trainer::new(opts)?;
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (ev_tx, ev_rx) = events::channel(trainer.max_queued_steps);
        let handle = std::thread::Builder::new()
            .name("cockpit-engine".into())
            .spawn(move || {
                let panic_tx = ev_tx.clone();
                // A bug in the engine must not take the front end down with it: report it as
                // a failed run instead of unwinding into nowhere.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    trainer.run(cmd_rx, ev_tx)
                })) {
                    Ok(r) => r,
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        panic_tx.send(Event::Finished {
                            step: 0,
                            reason: FinishReason::Failed,
                            message: format!("engine panicked: {msg}"),
                            elapsed_s: 0.0,
                        });
                        Err(EngineError::Panicked)
                    }
                }
            })
            .map_err(|e| EngineError::Io {
                path: "engine thread".into(),
                source: e,
            })?;
        Ok(Engine {
            commands: cmd_tx,
            events: ev_rx,
            thread: EngineThread(handle),
        })
    }
}
