//! Commands, applied at optimizer-step boundaries (and, in a data-parallel run, rank 0's
//! commands shared with every rank).

use super::recorder::Recorder;
use super::{Trainer, MAX_MICRO_BATCH};
use crate::engine::events::{Command, Event, FinishReason};
use crate::engine::EngineError;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

enum Flow {
    Continue,
    /// `interrupted`: the signal that asked for it (the run ends `Interrupted`).
    Stop {
        save: bool,
        interrupted: Option<String>,
    },
}

/// How a run that was told to stop ends: `Interrupted` by a signal, else `Stopped`.
fn stop_reason(interrupted: Option<String>, step: u64) -> (FinishReason, String) {
    match interrupted {
        Some(signal) => (
            FinishReason::Interrupted,
            format!("interrupted by {signal} at step {step}"),
        ),
        None => (
            FinishReason::Stopped,
            format!("stopped by command at step {step}"),
        ),
    }
}

impl Trainer {
    /// At a step boundary: the commands sent since the last one, applied (while paused,
    /// waited for). In a data-parallel run rank 0's commands are broadcast and every rank
    /// applies the same ones. `Some` (how the run ends) when they stop the run.
    pub(super) fn step_boundary_commands(
        &mut self,
        commands: &Receiver<Command>,
        paused: &mut bool,
        prev_batch: &mut Option<usize>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<Option<(FinishReason, String)>, EngineError> {
        if self.multi_process() {
            if let Some((save, interrupted)) =
                self.shared_commands(commands, prev_batch, start, out)?
            {
                return self.stop(save, interrupted, start, out).map(Some);
            }
        }
        while !self.multi_process() {
            let cmd = if *paused {
                match commands.recv_timeout(Duration::from_millis(100)) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        return Ok(Some((
                            FinishReason::Stopped,
                            "the controller went away while paused".into(),
                        )))
                    }
                }
            } else {
                match commands.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            if let Flow::Stop { save, interrupted } =
                self.apply(cmd, paused, prev_batch, start, out)?
            {
                return self.stop(save, interrupted, start, out).map(Some);
            }
        }
        Ok(None)
    }

    /// A stop: the time so far kept, a checkpoint where asked for, the weights made whole.
    fn stop(
        &mut self,
        save: bool,
        interrupted: Option<String>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<(FinishReason, String), EngineError> {
        self.elapsed_before = self.elapsed(start);
        if save {
            self.checkpoint_event(start, out)?;
        }
        self.full_masters()?;
        Ok(stop_reason(interrupted, self.step))
    }

    /// Data parallelism, at a step boundary: rank 0 hands out the commands its front end
    /// sent, and every rank applies the same ones in the same order (the other ranks' own
    /// front ends do not steer the job). `Some(save)` when they include a stop.
    fn shared_commands(
        &mut self,
        commands: &Receiver<Command>,
        prev_batch: &mut Option<usize>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<Option<(bool, Option<String>)>, EngineError> {
        let mine: Vec<Command> = commands.try_iter().collect();
        let mine = if self.rank == 0 { mine } else { Vec::new() };
        let bytes = serde_json::to_vec(&mine).map_err(|e| EngineError::Config(e.to_string()))?;
        self.set_waiting(true);
        let Some(d) = self.parallel.group() else {
            return Ok(None);
        };
        let got = d.broadcast_bytes(bytes);
        self.set_waiting(false);
        let got = got?;
        let cmds: Vec<Command> = serde_json::from_slice(&got).map_err(|e| {
            crate::distributed::CommError::Setup(format!("commands from rank 0: {e}"))
        })?;
        let mut paused = false;
        for cmd in cmds {
            if matches!(cmd, Command::Pause | Command::Resume) {
                out.emit(Event::CommandRejected {
                    step: self.step,
                    command: cmd,
                    reason: "pause is not available in a multi-process run (the other ranks would wait inside a collective); stop with a checkpoint and resume instead".into(),
                });
                continue;
            }
            if let Flow::Stop { save, interrupted } =
                self.apply(cmd, &mut paused, prev_batch, start, out)?
            {
                return Ok(Some((save, interrupted)));
            }
        }
        Ok(None)
    }

    fn apply(
        &mut self,
        cmd: Command,
        paused: &mut bool,
        prev_batch: &mut Option<usize>,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<Flow, EngineError> {
        let step = self.step;
        let reject = |out: &mut Recorder, command: Command, reason: String| {
            out.emit(Event::CommandRejected {
                step,
                command,
                reason,
            });
            Ok(Flow::Continue)
        };
        match cmd {
            Command::SetBatchSize { micro_batch } => {
                if micro_batch == 0 || micro_batch > MAX_MICRO_BATCH {
                    return reject(
                        out,
                        cmd,
                        format!("micro-batch must be in [1, {MAX_MICRO_BATCH}]"),
                    );
                }
                if micro_batch == self.micro_batch {
                    return reject(out, cmd, format!("micro-batch is already {micro_batch}"));
                }
                let old = self.micro_batch;
                *prev_batch = (micro_batch > old).then_some(old);
                self.micro_batch = micro_batch;
                self.loader.set_batch_size(micro_batch);
                let eff = micro_batch * self.accum;
                let detail = format!(
                    "micro-batch {old} → {micro_batch}, accum {}, effective batch {eff} sequences ({} tokens/step)",
                    self.accum,
                    eff * self.model.spec.seq_len
                );
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail,
                });
            }
            Command::SetScuSetpoint { target } => {
                if !(target > 0.0 && target < 1.0) {
                    return reject(
                        out,
                        cmd,
                        "the setpoint must be in (0, 1) — a fraction, 0.01 = 1%".into(),
                    );
                }
                let old = self.scu.target;
                self.scu.set_target(target);
                let detail = format!(
                    "S* {:.2}% → {:.2}% (bumpless: λ stays {:.4})",
                    old * 100.0,
                    target * 100.0,
                    self.scu.lambda
                );
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail,
                });
            }
            Command::CheckpointNow => {
                self.checkpoint_event(start, out)?;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("checkpoint at step {step}"),
                });
            }
            Command::Pause => {
                if *paused {
                    return reject(out, cmd, "already paused".into());
                }
                *paused = true;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("paused at step {step}"),
                });
                out.emit(Event::Paused { step });
            }
            Command::Resume => {
                if !*paused {
                    return reject(out, cmd, "not paused".into());
                }
                *paused = false;
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: format!("resumed at step {step}"),
                });
                out.emit(Event::Resumed { step });
            }
            Command::Stop { save } => {
                out.emit(Event::CommandApplied {
                    step,
                    command: cmd,
                    detail: if save {
                        "saving, then stopping".into()
                    } else {
                        "stopping".into()
                    },
                });
                return Ok(Flow::Stop {
                    save,
                    interrupted: None,
                });
            }
            Command::Interrupt { signal } => {
                out.emit(Event::CommandApplied {
                    step,
                    command: Command::Interrupt {
                        signal: signal.clone(),
                    },
                    detail: format!("{signal}: saving, then stopping"),
                });
                return Ok(Flow::Stop {
                    save: true,
                    interrupted: Some(signal),
                });
            }
        }
        Ok(Flow::Continue)
    }
}
