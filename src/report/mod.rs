//! Plots of runs and monitor sessions (plotters, PNG and SVG).
//!
//! * [`plot_run`] reads a run directory (`metrics.jsonl`, and `telemetry.jsonl` when present)
//!   and writes `plots/<chart>.png` and `plots/<chart>.svg` there: loss, S-ratio with its
//!   setpoint, λ, learning rate, throughput, GPU utilization and GPU memory.
//! * [`plot_monitor`] plots a monitor session (a slice of [`Snapshot`]s): GPU utilization and
//!   memory per GPU, host CPU and RAM.
//! * [`load_metrics`] and [`load_telemetry`] read the JSON-lines files into series, for the
//!   plots and for anything else that wants to backfill history (e.g. attaching to a run).
//!
//! Charts without data are skipped, not drawn empty. Text needs a TrueType font, looked up at
//! run time in the usual system and user font directories, or taken from the file named by
//! the `COCKPIT_FONT` environment variable (see [`font_status`]). Nothing is bundled or
//! fetched; without a font the SVG charts still carry their text, the PNG charts are drawn
//! without it, and the summary carries a one-line notice saying so.

mod chart;
pub mod compare;
mod font;
mod load;
mod monitor;
mod run;

use std::fmt;
use std::path::{Path, PathBuf};

use crate::telemetry::Snapshot;

pub use font::{font_status, FontStatus, FONT_ENV};
pub use load::{load_metrics, load_telemetry, RunMetrics, Telemetry};

/// File name of the event log inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// File name of the GPU/host telemetry log inside a run directory.
pub const TELEMETRY_FILE: &str = "telemetry.jsonl";
/// Folder inside a run directory that [`plot_run`] writes into.
pub const PLOTS_DIR: &str = "plots";

/// Everything that can stop a report from being written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading a file or creating the output folder failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line that is not the last one in a JSON-lines file does not parse.
    #[error("{}: line {line}: not a valid record: {source}", path.display())]
    Parse {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// The directory given to [`plot_run`] holds no `metrics.jsonl`.
    #[error("{}: no {METRICS_FILE} here; is this a run directory?", dir.display())]
    MissingMetrics { dir: PathBuf },
    /// plotters failed to draw or encode a chart.
    #[error("{}: drawing failed: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

/// A chart that was not drawn, and why (e.g. "no SCU events").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedChart {
    /// Chart name, the file stem it would have had (e.g. `"lambda"`).
    pub chart: String,
    pub reason: String,
}

/// What a plotting call did: files written, charts skipped, and one-line notices (a missing
/// font, a skipped truncated line, points left out because they were NaN or infinite).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlotSummary {
    /// Every file written, PNG and SVG, in chart order.
    pub written: Vec<PathBuf>,
    pub skipped: Vec<SkippedChart>,
    pub notices: Vec<String>,
}

impl PlotSummary {
    /// Names of the charts that were drawn, in order (each has a `.png` and a `.svg`).
    pub fn charts(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for path in &self.written {
            if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                if !names.iter().any(|n| n == stem) {
                    names.push(stem.to_string());
                }
            }
        }
        names
    }

    fn skip(&mut self, chart: &str, reason: impl Into<String>) {
        self.skipped.push(SkippedChart {
            chart: chart.to_string(),
            reason: reason.into(),
        });
    }
}

impl fmt::Display for PlotSummary {
    /// A few human lines: what was written where, what was skipped, and the notices.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let charts = self.charts();
        if charts.is_empty() {
            write!(f, "no charts written")?;
        } else {
            let dir = self
                .written
                .first()
                .and_then(|p| p.parent())
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            write!(
                f,
                "wrote {} chart(s) (PNG + SVG) to {dir}: {}",
                charts.len(),
                charts.join(", ")
            )?;
        }
        for s in &self.skipped {
            write!(f, "\nskipped {}: {}", s.chart, s.reason)?;
        }
        for n in &self.notices {
            write!(f, "\nnote: {n}")?;
        }
        Ok(())
    }
}

/// Plot a run directory into `<run_dir>/plots/`; returns the files written (PNG and SVG).
///
/// Skipped charts and notices are logged with `tracing`; use [`plot_run_detailed`] to get them.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let summary = plot_run_detailed(run_dir)?;
    log_summary(&summary);
    Ok(summary.written)
}

/// Plot a run directory into `<run_dir>/plots/` and say what was written and skipped.
pub fn plot_run_detailed(run_dir: &Path) -> Result<PlotSummary, ReportError> {
    run::plot_run(run_dir)
}

/// Plot a monitor session into `out_dir` (created if missing); returns the files written.
///
/// Skipped charts and notices are logged with `tracing`; use [`plot_monitor_detailed`] to get
/// them.
pub fn plot_monitor(snapshots: &[Snapshot], out_dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let summary = plot_monitor_detailed(snapshots, out_dir)?;
    log_summary(&summary);
    Ok(summary.written)
}

/// Plot a monitor session into `out_dir` and say what was written and skipped.
pub fn plot_monitor_detailed(
    snapshots: &[Snapshot],
    out_dir: &Path,
) -> Result<PlotSummary, ReportError> {
    monitor::plot_monitor(snapshots, out_dir)
}

fn log_summary(summary: &PlotSummary) {
    for s in &summary.skipped {
        tracing::info!(chart = %s.chart, "chart skipped: {}", s.reason);
    }
    for n in &summary.notices {
        tracing::warn!("{n}");
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    }
}
