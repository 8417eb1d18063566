//! Errors of the telemetry layer (starting samplers, reading and writing traces).

use std::path::PathBuf;

/// What can go wrong when starting a sampler or reading/writing a trace.
///
/// Sampling itself never fails: a metric the hardware refuses is recorded as missing.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The sampling interval was zero.
    #[error("the sampling interval must be greater than zero")]
    ZeroInterval,
    /// A replay speed that is negative or not a number.
    #[error(
        "invalid replay speed {0}: use a number >= 0 (1 = real time, 0 = as fast as possible)"
    )]
    BadSpeed(f64),
    /// The trace file to record into could not be created.
    #[error("cannot create trace file {}: {source}", path.display())]
    CreateTrace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The trace file to replay could not be opened or read.
    #[error("cannot read trace file {}: {source}", path.display())]
    ReadTrace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of a trace is not a JSON snapshot.
    #[error("{}:{line}: not a telemetry snapshot: {source}", path.display())]
    BadTraceLine {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// A trace without a single snapshot.
    #[error("trace file {} holds no snapshots", path.display())]
    EmptyTrace { path: PathBuf },
    /// The operating system refused to start the sampler thread.
    #[error("cannot start the {name} thread: {source}")]
    Spawn {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
}
