//! Recovery from a run that keeps producing non-finite steps (back to the last checkpoint
//! with a lower LR), and what counts as out of memory.

use super::recorder::Recorder;
use super::Trainer;
use crate::engine::events::Event;
use crate::engine::{checkpoint, EngineError};

/// Non-finite steps in a row after which the run fails.
pub(super) const MAX_NONFINITE_IN_A_ROW: u32 = 20;

pub(super) fn is_oom(e: &candle_core::Error) -> bool {
    let s = e.to_string().to_ascii_lowercase();
    s.contains("out of memory") || s.contains("out_of_memory")
}

impl Trainer {
    /// Repeated non-finite steps: restore the last checkpoint and lower the LR, or fail.
    pub(super) fn recover(&mut self, out: &mut Recorder) -> Result<(), EngineError> {
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
