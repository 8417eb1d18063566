//! Non-finite steps: skipped and counted; a run that keeps producing them in full precision
//! goes back to its last checkpoint with a lower LR, or fails.

use super::recorder::Recorder;
use super::Trainer;
use crate::engine::events::Event;
use crate::engine::{checkpoint, EngineError};

/// Non-finite steps in a row after which the run fails.
const MAX_NONFINITE_IN_A_ROW: u32 = 20;

impl Trainer {
    /// A step whose loss or gradients are not finite: skipped (counted in `in_a_row` and in
    /// the run's skipped steps). `Ok(true)` when the last checkpoint was restored (the loop
    /// starts over from its step); an error when the run cannot go on.
    pub(super) fn skip_non_finite_step(
        &mut self,
        in_a_row: &mut u32,
        out: &mut Recorder,
    ) -> Result<bool, EngineError> {
        *in_a_row += 1;
        self.skipped_steps += 1;
        out.emit(Event::Warning {
            step: self.step + 1,
            message: format!(
                "non-finite loss or gradients: step {} skipped ({} in a row, {} in all{})",
                self.step + 1,
                in_a_row,
                self.skipped_steps,
                if self.scaler.enabled {
                    format!(", loss scale now {}", self.scaler.scale)
                } else {
                    String::new()
                }
            ),
        });
        // fp16 overflow is the scaler's business; a run that keeps producing NaN in full
        // precision is diverging: go back to the last checkpoint with a lower LR.
        if !self.scaler.enabled && *in_a_row >= self.cfg.checkpoint.max_nonfinite_in_a_row {
            *in_a_row = 0;
            self.restore_last_checkpoint(out)?;
            return Ok(true);
        }
        if *in_a_row >= MAX_NONFINITE_IN_A_ROW {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                count: *in_a_row,
            });
        }
        Ok(false)
    }

    /// Repeated non-finite steps: restore the last checkpoint and lower the LR, or fail.
    fn restore_last_checkpoint(&mut self, out: &mut Recorder) -> Result<(), EngineError> {
        let root = self.run_dir.join("checkpoints");
        if self.restores >= self.cfg.checkpoint.max_restores {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                count: self.cfg.checkpoint.max_nonfinite_in_a_row,
            });
        }
        let Ok(dir) = checkpoint::resolve(&root) else {
            return Err(EngineError::Diverged {
                step: self.step + 1,
                message:
                    "no checkpoint to restore from; lower optim.lr or enable checkpoint.every_steps"
                        .into(),
            });
        };
        let (skipped, restores, from) = (self.skipped_steps, self.restores + 1, self.step);
        let lr_scale = self.lr_scale * self.cfg.checkpoint.restore_lr_factor;
        self.restore(&dir, false)?;
        self.skipped_steps = skipped;
        self.restores = restores;
        self.lr_scale = lr_scale;
        out.emit(Event::Warning {
            step: self.step,
            message: format!(
                "diverging at step {from}: restored {} (step {}), LR × {} (restore {}/{})",
                dir.display(),
                self.step,
                self.lr_scale,
                self.restores,
                self.cfg.checkpoint.max_restores
            ),
        });
        Ok(())
    }
}
