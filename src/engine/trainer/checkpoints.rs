//! Checkpoint I/O: the training state, writing a checkpoint (and the LoRA adapter), and the
//! `CheckpointSaved` event.

use super::recorder::Recorder;
use super::Trainer;
use crate::engine::checkpoint::{self, TrainState};
use crate::engine::events::Event;
use crate::engine::EngineError;
use candle_core::Tensor;
use std::path::PathBuf;
use std::time::Instant;

impl Trainer {
    pub(super) fn state(&self, elapsed: f64) -> TrainState {
        TrainState {
            step: self.step,
            optim_t: self.opt.t,
            cursor: self.loader.cursor(),
            micro_batch: self.micro_batch,
            accum: self.accum,
            tokens: self.tokens,
            elapsed_s: elapsed,
            scaler: self.scaler.clone(),
            scu: self.scu.clone(),
            best_val_loss: self.best_val,
            lr_scale: self.lr_scale,
            shape_hash: self.shape_hash.clone(),
            seed: self.cfg.run.seed,
            skipped_steps: self.skipped_steps,
            restores: self.restores,
            config: serde_json::to_value(&self.cfg).unwrap_or_default(),
        }
    }

    pub(super) fn save_checkpoint(
        &mut self,
        elapsed: f64,
        val_loss: Option<f64>,
        moments: Option<Vec<(String, Tensor)>>,
    ) -> Result<(PathBuf, u64, f64), EngineError> {
        let t0 = Instant::now();
        let optim: Vec<(String, Tensor)> = match moments {
            Some(m) => m,
            None => self
                .opt
                .slots
                .iter()
                .flat_map(|s| {
                    [
                        (format!("{}.m", s.name), s.m.clone()),
                        (format!("{}.v", s.name), s.v.clone()),
                    ]
                })
                .collect(),
        };
        let c = &self.cfg.checkpoint;
        let saved = checkpoint::save(
            &self.run_dir.join("checkpoints"),
            &self.state(elapsed),
            &self.model.named_tensors(),
            &optim,
            val_loss,
            c.keep_last,
            c.keep_best,
        )?;
        let (dir, bytes) = saved;
        if self.cfg.lora.enabled {
            // The adapter alone, PEFT layout, always the newest: RUN_DIR/adapter/.
            crate::engine::lora::save_adapter(
                &self.run_dir.join("adapter"),
                &self.model,
                &self.cfg.lora,
            )?;
        }
        Ok((dir, bytes, t0.elapsed().as_secs_f64() * 1e3))
    }

    pub(super) fn checkpoint_event(
        &mut self,
        start: Instant,
        out: &mut Recorder,
    ) -> Result<(), EngineError> {
        // ZeRO-1: the weights and the moments are gathered from every rank first (collectives).
        self.full_masters()?;
        let moments = self.gather_moments()?;
        if self.rank != 0 {
            // Rank 0 writes the job's checkpoints; the ranks hold the same state.
            return Ok(());
        }
        let val = self
            .summary
            .last_val
            .as_ref()
            .filter(|v| v.step == self.step)
            .map(|v| v.val_loss);
        let (dir, bytes, ms) = self.save_checkpoint(self.elapsed(start), val, moments)?;
        out.emit(Event::CheckpointSaved {
            step: self.step,
            path: dir.display().to_string(),
            bytes,
            ms,
        });
        self.summary.last_checkpoint = Some(dir);
        Ok(())
    }
}
