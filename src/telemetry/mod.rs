//! GPU (NVML) and host (sysinfo) samplers, and record/replay of traces.
//!
//! * [`Collector`] takes one [`Snapshot`] on demand (NVML is initialised once per process);
//!   [`sample_once`] is the one-shot form behind `cockpit monitor --once`.
//! * [`spawn_sampler`] runs a collector on its own thread at a fixed interval and hands the
//!   snapshots out through a [`Sampler`]; with [`SamplerOptions::record`] each snapshot is also
//!   appended to a JSON-lines trace.
//! * [`Replay::open`] plays such a trace back through the same [`Sampler`] handle, at real or
//!   accelerated speed, so tests and demos run the very pipeline a live session does.
//!
//! Without an NVIDIA driver the GPU side switches itself off: snapshots carry host metrics only
//! and one notice in [`Snapshot::gpu_notice`].
mod sample;
pub use sample::*;

mod collector;
mod error;
mod gpu;
mod host;
mod replay;
mod sampler;
mod trace;

pub use collector::{sample_once, Collector};
pub use error::TelemetryError;
pub use replay::Replay;
pub use sampler::{spawn_sampler, Sampler, SamplerOptions, SourceKind};
pub use trace::{read_trace, TraceWriter};

pub(crate) use replay::replay_parts;
pub(crate) use sampler::{live_parts, spawn_source, SnapshotSink, SourceThread};

/// Round a measured percentage to two decimals: finer digits are noise, and short decimals
/// survive a trace's JSON round trip exactly.
fn round_pct(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}
