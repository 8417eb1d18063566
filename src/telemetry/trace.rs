//! Telemetry traces: JSON lines, one [`Snapshot`] per line, written by `--record` and played
//! back by [`Replay`](super::Replay).

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{Snapshot, TelemetryError};

/// Writes snapshots to a trace file, one JSON line each, flushed line by line so that a
/// trace cut short (crash, kill) is still readable up to its last full line.
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TraceWriter {
    /// Create (or truncate) the trace file, and its parent folder when missing.
    pub fn create(path: &Path) -> Result<Self, TelemetryError> {
        let create_err = |source| TelemetryError::CreateTrace {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(create_err)?;
        }
        let file = File::create(path).map_err(create_err)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one snapshot as a line.
    pub fn write(&mut self, snapshot: &Snapshot) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, snapshot)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

/// Read a whole trace. Blank lines are skipped; any other line that is not a snapshot is an
/// error naming the file and the line.
pub fn read_trace(path: &Path) -> Result<Vec<Snapshot>, TelemetryError> {
    let read_err = |source| TelemetryError::ReadTrace {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::new(crate::util::open_regular(path).map_err(read_err)?);
    let mut snapshots = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(read_err)?;
        if line.trim().is_empty() {
            continue;
        }
        let snapshot =
            serde_json::from_str(&line).map_err(|source| TelemetryError::BadTraceLine {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })?;
        snapshots.push(snapshot);
    }
    if snapshots.is_empty() {
        return Err(TelemetryError::EmptyTrace {
            path: path.to_path_buf(),
        });
    }
    Ok(snapshots)
}
