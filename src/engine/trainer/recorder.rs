//! What the run writes as it goes: every event to metrics.jsonl and the front end, and JSON
//! files in the run dir.

use super::{io_err, Trainer};
use crate::engine::events::{Event, EventTx};
use crate::engine::EngineError;
use std::io::{BufWriter, Write};

/// Writes every event to metrics.jsonl and forwards it to the channel (which never blocks).
pub(super) struct Recorder {
    pub(super) file: BufWriter<std::fs::File>,
    pub(super) tx: EventTx,
    pub(super) failed: bool,
}

impl Recorder {
    pub(super) fn emit(&mut self, ev: Event) {
        if !self.failed {
            let ok = serde_json::to_writer(&mut self.file, &ev).is_ok()
                && self.file.write_all(b"\n").is_ok();
            // Flushed per event: `cockpit attach` backfills from this file while the run goes on.
            let ok = ok && self.file.flush().is_ok();
            if !ok {
                self.failed = true;
                let msg = "could not write metrics.jsonl; events still reach the front end";
                let _ = self.tx.send(Event::Warning {
                    step: ev.step(),
                    message: msg.into(),
                });
            }
        }
        let _ = self.tx.send(ev);
    }
    pub(super) fn flush(&mut self) {
        let _ = self.file.flush();
    }
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
