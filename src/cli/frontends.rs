//! Glue between the engine and the front ends (TUI, telemetry, monitor, report).

use super::args::MonitorArgs;
use crate::advisor::MonitorUpdate;
use crate::config::Config;
use crate::engine::events::{Command, EventRx};
use crate::headless::HeadlessOutcome;
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender};

pub fn run_training_tui(
    events: EventRx,
    commands: Sender<Command>,
    cfg: &Config,
    run_dir: &Path,
) -> anyhow::Result<HeadlessOutcome> {
    let flags = crate::headless::SignalFlags::default();
    let telemetry = training_telemetry(cfg, run_dir);
    Ok(crate::headless::run(
        events,
        commands,
        telemetry,
        &flags,
        std::time::Duration::from_secs(2),
        &mut std::io::stderr(),
    ))
}

pub fn training_telemetry(_cfg: &Config, _run_dir: &Path) -> Option<Receiver<MonitorUpdate>> {
    None
}

/// Plots at the end of a run (failures are logged, never fatal: the run itself succeeded).
pub fn after_run(run_dir: &Path) {
    match crate::report::plot_run_detailed(run_dir) {
        Ok(summary) => tracing::info!("plots: {summary}"),
        Err(e) => tracing::warn!("plots: {e}"),
    }
}

/// `cockpit plot RUN_DIR`.
pub fn plot_run(run_dir: &Path) -> anyhow::Result<i32> {
    let summary = crate::report::plot_run_detailed(run_dir)?;
    println!("{summary}");
    Ok(0)
}

pub fn monitor(_m: MonitorArgs) -> anyhow::Result<i32> {
    Ok(0)
}
