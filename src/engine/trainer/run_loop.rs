//! The training loop: commands at step boundaries, forward/backward, the data-parallel
//! reduction, the optimizer step (skipping non-finite steps, recovering from out of memory),
//! SCU control, evaluation and checkpoints.

use super::handle::RunSummary;
use super::recorder::Recorder;
use super::{io_err, Trainer};
use crate::engine::events::{Command, Event, EventTx, FinishReason, StepStats};
use crate::engine::optim::lr_at;
use crate::engine::{device, EngineError};
use std::sync::mpsc::Receiver;
use std::time::Instant;

impl Trainer {
    pub(super) fn run(
        mut self,
        commands: Receiver<Command>,
        tx: EventTx,
    ) -> Result<RunSummary, EngineError> {
        let metrics_path = self.out_dir.join("metrics.jsonl");
        let (file, repair) = crate::engine::records::RecordFile::open(&metrics_path)
            .map_err(io_err(&metrics_path))?;
        let mut out = Recorder {
            file,
            tx,
            failed: false,
        };
        if let Some(message) = repair.message(&metrics_path) {
            out.emit(Event::Warning {
                step: self.step,
                message,
            });
        }
        let result = self.train(&commands, &mut out);
        if let Some(p) = &self.progress {
            p.step.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(d) = self.parallel.group() {
            match &result {
                Ok(_) => d.finish(),
                // Another rank's failure: it has told everyone already.
                Err(e) if e.is_peer_failure() => {}
                Err(e) => d.abort(&e.to_string()),
            }
        }
        let (reason, message) = match &result {
            Ok((r, m)) => (*r, m.clone()),
            Err(e) => (FinishReason::Failed, e.to_string()),
        };
        let elapsed = self.elapsed_before;
        if let Err(e) = self.write_scu_files() {
            out.emit(Event::Warning {
                step: self.step,
                message: format!("could not write SCU files: {e}"),
            });
        }
        out.emit(Event::Finished {
            step: self.step,
            reason,
            message: message.clone(),
            elapsed_s: elapsed,
        });
        out.flush();
        result?;
        Ok(RunSummary {
            reason,
            step: self.step,
            last_loss: self.summary.last_loss,
            last_val: self.summary.last_val.clone(),
            last_checkpoint: self.summary.last_checkpoint.clone(),
            entropy_floor_bpt: self.dataset.entropy_floor_bpt,
            final_lambda: self.scu.lambda,
            final_s: self.summary.last_s,
        })
    }

    pub(super) fn elapsed(&self, start: Instant) -> f64 {
        self.elapsed_before + start.elapsed().as_secs_f64()
    }

    pub(super) fn train(
        &mut self,
        commands: &Receiver<Command>,
        out: &mut Recorder,
    ) -> Result<(FinishReason, String), EngineError> {
        self.write_json("training_config.json", &self.cfg)?;
        self.write_json("scu_config.json", &self.cfg.scu)?;
        out.emit(Event::RunStarted(self.run_info()));
        let start = Instant::now();
        let mut last_ckpt = Instant::now();
        let mut paused = false;
        let mut prev_batch: Option<usize> = None;
        let mut nonfinite_in_a_row = 0u32;
        for message in self.dataset.warnings.clone() {
            out.emit(Event::Warning {
                step: self.step,
                message,
            });
        }
        for note in std::mem::take(&mut self.resume_notes) {
            out.emit(Event::Warning {
                step: self.step,
                message: format!("resumed with a changed config: {note}"),
            });
        }
        let max_steps = self.cfg.run.max_steps;
        let seq_len = self.model.spec.seq_len;
        while self.step < max_steps {
            // Commands: only here, at the optimizer-step boundary.
            if let Some(end) =
                self.step_boundary_commands(commands, &mut paused, &mut prev_batch, start, out)?
            {
                return Ok(end);
            }

            let t_step = Instant::now();
            let step_cursor = self.loader.cursor();
            let every_min = self.cfg.checkpoint.every_minutes;
            self.time_due =
                every_min > 0.0 && last_ckpt.elapsed().as_secs_f64() >= every_min * 60.0;
            self.faults.hang_at(self.step + 1);
            self.faults.fail_at(self.step + 1)?;
            let (ce, sumsq, grads, wait, compute) = match self.forward_backward(self.scu.lambda) {
                Ok(v) => {
                    if let Some(why) = self.per_op_reason.take() {
                        out.emit(Event::Warning {
                            step: self.step,
                            message: format!(
                                "the per-op CUDA path runs (several times slower than the \
                                 whole-model step): {why}"
                            ),
                        });
                    }
                    v
                }
                // Out of memory: a smaller micro-batch, and the step redone.
                Err(e) => {
                    if self.data_fault.is_some() {
                        return Err(self.step_error(e));
                    }
                    self.redo_after_oom(e, &mut prev_batch, step_cursor, out)?;
                    continue;
                }
            };
            prev_batch = None;
            // Data parallelism: mean gradients and loss over the ranks, and every rank's timings.
            let t_comm = Instant::now();
            let mut reduced = self.reduce_step(ce, grads, wait, compute)?;
            let (ce, time_due) = (reduced.ce, reduced.time_due);
            let sumsq = reduced.reg_sumsq.unwrap_or(sumsq);
            let ranks = std::mem::take(&mut reduced.ranks);
            // The whole-model step's gradients still carry fp16's loss scale (the per-op path
            // divides it out itself): the update takes it out with the other factors.
            let grad_scale = match &self.whole_step {
                Some(_) => reduced.grad_scale / self.scaler.scale,
                None => reduced.grad_scale,
            };
            let comm = if ranks.is_empty() {
                0.0
            } else {
                t_comm.elapsed().as_secs_f64() * 1e3
            };
            let t_opt = Instant::now();
            let norm = reduced.grad_norm(grad_scale)?;
            let finite = norm.is_finite() && ce.is_finite();
            let lr =
                lr_at(&self.cfg.schedule, self.cfg.optim.lr, self.step, max_steps) * self.lr_scale;
            let mut applied = 0.0;
            if self.scaler.update(finite) {
                nonfinite_in_a_row = 0;
                let clip = self.cfg.optim.grad_clip;
                // Clipping (and data parallelism's 1/world where the gradients hold the ranks'
                // sum, and fp16's 1/loss scale where they still carry it) is a gradient scale
                // the (fused) update applies itself. What the penalty's gradient meets is the
                // clipping alone: the other factors only undo how the gradients are held.
                let clipped = if clip > 0.0 && norm > clip {
                    clip / (norm + 1e-6)
                } else {
                    1.0
                };
                let f = grad_scale * clipped;
                applied = clipped;
                self.apply_update(&reduced, lr, f)?;
            } else if self.skip_non_finite_step(&mut nonfinite_in_a_row, out)? {
                continue;
            }
            self.device.synchronize()?;
            let optim = t_opt.elapsed();
            self.step += 1;
            if let Some(p) = &self.progress {
                p.step
                    .store(self.step, std::sync::atomic::Ordering::Relaxed);
            }
            let step_tokens = (self.micro_batch * self.accum * seq_len * self.world) as u64;
            self.tokens += step_tokens;
            let step_s = t_step.elapsed().as_secs_f64();
            let kernels = match &self.whole_step {
                Some(w) => w.take_profile()?,
                None => Vec::new(),
            };
            self.summary.last_loss = Some(ce);
            out.emit(Event::Step(StepStats {
                step: self.step,
                loss: ce,
                lr,
                grad_norm: norm,
                tokens_per_sec: step_tokens as f64 / step_s.max(1e-9),
                step_ms: step_s * 1e3,
                data_wait_ms: wait.as_secs_f64() * 1e3,
                compute_ms: compute.as_secs_f64() * 1e3,
                optim_ms: optim.as_secs_f64() * 1e3,
                micro_batch: self.micro_batch,
                accum: self.accum,
                tokens: self.tokens,
                epoch: self.tokens as f64 / self.dataset.train.len().max(1) as f64,
                elapsed_s: self.elapsed(start),
                memory_bytes: self.step_memory,
                host_rss_bytes: device::rss_bytes(),
                dropped_before: 0,
                comm_ms: comm,
                ranks,
                kernels,
                trained_share: match std::mem::take(&mut self.trained_slots) {
                    (_, 0) => None,
                    (n, all) => Some(n as f64 / all as f64),
                },
            }));

            self.scu.observe_step(ce, lr, applied);
            if self.step.is_multiple_of(self.cfg.scu.control_every) {
                if let Some(mean_ce) = self.scu.take_window_mean() {
                    self.control(mean_ce, sumsq, out)?;
                }
            }
            let every = self.cfg.eval.every;
            let last = self.step == max_steps;
            let eval_due =
                (every > 0 && self.step.is_multiple_of(every)) || (last && self.cfg.eval.at_end);
            // Rank 0 evaluates (the held-out loss does not depend on the rank), with whole
            // weights (ZeRO-1's are gathered first: a collective, so on every rank).
            if eval_due {
                self.full_masters()?;
            }
            if eval_due && self.rank == 0 {
                let ev = self.evaluate().map_err(|e| self.step_error(e))?;
                if self.best_val.is_none_or(|b| ev.val_loss < b) {
                    self.best_val = Some(ev.val_loss);
                }
                self.summary.last_val = Some(ev.clone());
                out.emit(Event::Eval(ev));
                if let Some(ev) = self.sample_text()? {
                    out.emit(ev);
                }
                if let Some(ev) = self.sample_diversity()? {
                    out.emit(ev);
                }
            }
            let c = &self.cfg.checkpoint;
            let due_steps = c.every_steps > 0 && self.step.is_multiple_of(c.every_steps);
            // (Rank 0's clock decides for every rank: a sharded optimizer's checkpoint is a
            // collective.)
            let due_time = time_due;
            if due_steps || due_time || (last && c.at_end) {
                self.checkpoint_event(start, out)?;
                last_ckpt = Instant::now();
            }
        }
        self.elapsed_before = self.elapsed(start);
        self.full_masters()?;
        Ok((
            FinishReason::Completed,
            format!("reached max_steps ({max_steps})"),
        ))
    }
}
