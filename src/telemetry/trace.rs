//! Telemetry traces: JSON lines, one [`Snapshot`] per line, written by `--record` and played
//! back by [`Replay`].

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::sampler::{Sampler, SourceBody, SourceKind};
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
    let reader = BufReader::new(File::open(path).map_err(read_err)?);
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

/// Plays a recorded trace back through a [`Sampler`], the same handle a live session reads.
pub struct Replay;

impl Replay {
    /// Read the trace at `path` (all of it, so a bad line is reported now) and start playing
    /// it back.
    ///
    /// `speed` scales the recorded gaps between snapshots: `1.0` is real time, `10.0` ten
    /// times faster, `0.0` as fast as the reader takes them. The returned sampler's channel
    /// disconnects after the last snapshot.
    pub fn open(path: &Path, speed: f64) -> Result<Sampler, TelemetryError> {
        let (kind, notice, body) = replay_parts(path, speed)?;
        Sampler::from_parts(kind, notice, body)
    }
}

/// Load a trace and build the body of its replay thread.
pub(crate) fn replay_parts(
    path: &Path,
    speed: f64,
) -> Result<(SourceKind, Option<String>, SourceBody), TelemetryError> {
    if !speed.is_finite() || speed < 0.0 {
        return Err(TelemetryError::BadSpeed(speed));
    }
    let snapshots = read_trace(path)?;
    let notice = snapshots.first().and_then(|s| s.gpu_notice.clone());
    let kind = SourceKind::Replay {
        path: path.to_path_buf(),
        speed,
    };
    Ok((kind, notice, replay_body(snapshots, speed)))
}

fn replay_body(snapshots: Vec<Snapshot>, speed: f64) -> SourceBody {
    Box::new(move |stop, sink| {
        let start = Instant::now();
        let t0 = snapshots.first().map_or(0, |s| s.timestamp_ms);
        for snapshot in snapshots {
            let stopped = if speed > 0.0 {
                let offset_s = snapshot.timestamp_ms.saturating_sub(t0) as f64 / 1000.0 / speed;
                let deadline = Duration::try_from_secs_f64(offset_s)
                    .ok()
                    .and_then(|offset| start.checked_add(offset));
                match deadline {
                    Some(deadline) => stop.wait_until(deadline),
                    // Too far away to represent: wait until stopped.
                    None => stop.wait_forever(),
                }
            } else {
                stop.stopped()
            };
            if stopped || !sink.deliver(snapshot) {
                return;
            }
        }
    })
}
