//! [`Replay`]: a recorded trace played back through a [`Sampler`].

use std::path::Path;
use std::time::{Duration, Instant};

use super::sampler::{Sampler, SourceBody, SourceKind};
use super::trace::read_trace;
use super::{Snapshot, TelemetryError};

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
