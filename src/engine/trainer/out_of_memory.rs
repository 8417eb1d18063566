//! Out of memory in a step's forward/backward: back to the micro-batch that fit (after a
//! larger one was asked for), or the micro-batch split with more accumulation; the step is
//! redone from its first sequence either way.

use super::recorder::Recorder;
use super::Trainer;
use crate::engine::data::loader::Cursor;
use crate::engine::events::Event;

pub(super) fn is_oom(e: &candle_core::Error) -> bool {
    crate::engine::device::is_out_of_memory(e)
}

impl Trainer {
    /// After a failed forward/backward: `Ok` when the step is to be redone with a smaller
    /// micro-batch (the loader is back at `step_cursor`), else the error. `prev_batch`: the
    /// micro-batch before the last command that raised it (the one to go back to).
    pub(super) fn redo_after_oom(
        &mut self,
        e: candle_core::Error,
        prev_batch: &mut Option<usize>,
        step_cursor: Cursor,
        out: &mut Recorder,
    ) -> Result<(), candle_core::Error> {
        if !is_oom(&e) || self.multi_process() {
            return Err(e);
        }
        if prev_batch.is_some() {
            let (failed, old) = (self.micro_batch, prev_batch.take().unwrap_or(1));
            self.micro_batch = old;
            self.loader.seek(step_cursor);
            self.loader.set_batch_size(old);
            out.emit(Event::Warning {
                step: self.step,
                message: format!("out of memory at micro-batch {failed}: back to {old}, step {} redone (nothing lost)", self.step + 1),
            });
            return Ok(());
        }
        // Out of memory anywhere else: split the micro-batch and accumulate more, so the
        // optimizer step stays the same sequences.
        if self.micro_batch > 1 {
            let mb = self.micro_batch;
            let k = (2..=mb).find(|k| mb.is_multiple_of(*k)).unwrap_or(mb);
            self.micro_batch = mb / k;
            self.accum *= k;
            self.loader.seek(step_cursor);
            self.loader.set_batch_size(self.micro_batch);
            out.emit(Event::Warning {
                step: self.step,
                message: format!(
                    "out of memory at micro-batch {mb}: micro-batch {} × accumulation {} from now on (the same {} sequences a step), step {} redone",
                    self.micro_batch,
                    self.accum,
                    self.micro_batch * self.accum,
                    self.step + 1
                ),
            });
            return Ok(());
        }
        Err(e)
    }
}
