//! Dashboard state: plain data updated from engine events and monitor updates, rendered by
//! the views. Nothing here draws or reads a clock.

pub mod commands;
pub mod compare;
pub mod eta;
pub mod history;
pub mod log;
pub mod run;
pub mod telemetry;

pub use commands::{CommandKind, CommandState, CommandStatus};
pub use compare::{CompareArm, CompareChart, CompareState};
pub use eta::Eta;
pub use history::{Ema, History, RecentSeries, Ring, ThinnedSeries};
pub use log::{EventLog, LogEntry, LogLevel};
pub use run::{ChartSeries, Finished, HistorySizes, MarkKind, RunState, SMOOTHING_LEVELS};
pub use telemetry::{GpuPoint, GpuState, ProcessRow, TelemetryState};
