//! What the run writes as it goes: every event to metrics.jsonl and the front end, and JSON
//! files in the run dir.

use super::{io_err, Trainer};
use crate::engine::events::{Event, EventTx};
use crate::engine::EngineError;

/// Writes every event to metrics.jsonl and forwards it to the channel (which never blocks).
pub(super) struct Recorder {
    pub(super) file: crate::engine::records::RecordFile,
    pub(super) tx: EventTx,
    /// A write failed (said once; later records are still tried, each whole or absent).
    pub(super) failed: bool,
}

impl Recorder {
    pub(super) fn emit(&mut self, ev: Event) {
        // One write per record, cut back when it fails: whole or absent (engine::records).
        // Written at once: `cockpit attach` backfills from this file while the run goes on.
        if let Err(e) = self.file.append_json(&ev) {
            if !self.failed {
                self.failed = true;
                let message = format!("could not write metrics.jsonl ({e}): records that fail are left out whole; events still reach the front end");
                let _ = self.tx.send(Event::Warning {
                    step: ev.step(),
                    message,
                });
            }
        }
        let _ = self.tx.send(ev);
    }
    pub(super) fn flush(&mut self) {}
}

impl Trainer {
    pub(super) fn write_json(
        &self,
        name: &str,
        value: &impl serde::Serialize,
    ) -> Result<(), EngineError> {
        let path = self.out_dir.join(name);
        let text =
            serde_json::to_vec_pretty(value).map_err(|e| EngineError::Config(e.to_string()))?;
        crate::util::atomic_write(&path, &text).map_err(io_err(&path))
    }
}
