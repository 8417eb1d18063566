//! `cockpit monitor` / `--monitor-only`: headless status lines, JSON snapshots, summaries.
//!
//! # GPU monitor (README section)
//!
//! `cockpit monitor` watches the GPUs (through NVML) and the host, and runs the advisor over
//! a sliding 30-second window, without training anything. Without an NVIDIA driver it says
//! so once ("NVML not available (...): GPU metrics off, host metrics only") and keeps
//! reporting host metrics.
//!
//! | flags | what it does |
//! |---|---|
//! | `--once` | print one human-readable status block and exit |
//! | `--once --json` | print one JSON object (schema below) and exit |
//! | `--no-tui` | one status line per interval until Ctrl-C or `--duration` |
//! | `--no-tui --json` | one JSON object per line (same schema as `--once --json`) |
//! | `--interval SECS` | time between samples (default 1) |
//! | `--duration SECS` | stop after this much (trace) time |
//! | `--out-dir DIR` | where `monitor_summary.json` goes |
//! | `--record FILE.jsonl` | also write every snapshot to a trace |
//! | `--replay FILE.jsonl [--replay-speed N]` | play a trace back instead of sampling (N=1 real time, 0 as fast as possible) |
//!
//! A status line reads
//! `12:00:01  gpu0 87% 41.2/80.0G 64°C 310W | cpu 23% ram 12.1/24.0G | advice: data_bound(gpu0) +1`
//! (per GPU: utilization, memory used/total in GiB, temperature, power; then host CPU and
//! RAM; then the most severe advice and how many more stand).
//!
//! When a streaming session ends, `monitor_summary.json` is written into the output folder.
//!
//! ## `--once --json` (and each line of `--json`)
//!
//! ```text
//! {
//!   "timestamp_ms": 1767225600000,          // ms since the Unix epoch
//!   "gpus": [ {                             // empty without NVML
//!       "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-…",
//!       "util_gpu": 87, "util_mem": 40,     // % (null: not reported by the device)
//!       "mem_used_bytes": 44291850240, "mem_total_bytes": 85899345920,
//!       "temperature_c": 64, "power_w": 310.5, "power_limit_w": 700.0,
//!       "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980,
//!       "mem_clock_mhz": 2619, "mem_clock_max_mhz": 2619,
//!       "throttle_reasons": ["sw_power_cap"],   // also: gpu_idle, applications_clocks_setting,
//!                                               // hw_slowdown, sync_boost, sw_thermal_slowdown,
//!                                               // hw_thermal_slowdown, hw_power_brake_slowdown,
//!                                               // display_clock_setting
//!       "pcie_rx_kbps": 1200, "pcie_tx_kbps": 300, "fan_pct": null,
//!       "sm_activity_pct": 74.2, "sm_occupancy_pct": 31.0,   // GPM, Hopper+ only, else null
//!       "compute_capability": [9, 0],
//!       "processes": [ { "pid": 1234, "name": "python", "user": "alice",
//!                        "gpu_memory_bytes": 43000000000, "kind": "compute" } ]
//!   } ],
//!   "host": { "cpu_pct": 23.1, "cpu_cores": 16, "ram_used_bytes": 12991000000,
//!             "ram_total_bytes": 25769803776, "self_rss_bytes": 47185920 },
//!   "gpu_notice": null,                     // or "NVML not available (…): GPU metrics off, host metrics only"
//!   "advice": [ {
//!       "id": "data_bound", "severity": "warn",  // info | warn | critical; most severe first
//!       "gpu": 0,                                // null: about the whole job
//!       "message": "GPU 0 waits on the input pipeline: 41% of step time is data wait",
//!       "evidence": [["util_gpu_avg", "34%"], ["data_wait_share", "41%"]],
//!       "action": "Raise data.prefetch_depth …",
//!       "key": null                              // a cockpit key that acts on it, e.g. "+"
//!   } ]
//! }
//! ```
//!
//! `--once` judges a single snapshot (no window, no confirmation streak), so its advice is a
//! first impression; a streaming session gives the windowed, hysteresis-filtered advice.
//!
//! ## `monitor_summary.json`
//!
//! ```text
//! {
//!   "schema": "cockpit.monitor_summary.v1",
//!   "source": "live, every 1 s",            // or "replay of FILE at 10x"
//!   "started_ms": 1767225600000, "ended_ms": 1767225660000,
//!   "duration_s": 60.0, "samples": 61,
//!   "gpu_notice": null,
//!   "gpus": [ { "index": 0, "name": "…", "uuid": "…", "samples": 61,
//!               "util_gpu_avg_pct": 71.3, "util_gpu_peak_pct": 100,
//!               "sm_activity_avg_pct": null,
//!               "mem_total_bytes": 85899345920, "mem_used_avg_bytes": 40000000000,
//!               "mem_used_peak_bytes": 44291850240, "mem_used_peak_frac": 0.52,
//!               "temperature_peak_c": 71, "power_avg_w": 402.0, "power_peak_w": 655.3 } ],
//!   "host": { "cpu_avg_pct": 21.0, "cpu_peak_pct": 64.0, "cpu_cores": 16,
//!             "ram_total_bytes": 25769803776, "ram_used_avg_bytes": 12000000000,
//!             "ram_used_peak_bytes": 13000000000, "self_rss_peak_bytes": 50000000 },
//!   "advice": [ { "id": "data_bound", "gpu": 0, "severity": "warn", "message": "…",
//!                 "first_seen_ms": …, "last_seen_ms": …,
//!                 "first_seen_s": 12.0, "last_seen_s": 47.0, "updates": 36 } ]
//! }
//! ```
//!
//! ## Traces (`--record` / `--replay`)
//!
//! JSON lines, one snapshot per line: the `--once --json` object without `advice` (and
//! without `gpu_notice` when there is none). Replays run through the same sampler → advisor
//! pipeline as live sessions, so a trace reproduces the advice it was recorded with.

mod pipeline;
mod procstat;
mod render;
mod session;

pub use pipeline::{spawn_pipeline, spawn_pipeline_with, Pipeline, PipelineFeed};
pub use render::{status_block, status_line, update_json};
pub use session::{
    AdviceSeen, GpuSummary, HostSummary, MonitorSession, MonitorSummary, SUMMARY_FILE,
    SUMMARY_SCHEMA,
};

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use anyhow::{bail, Context as _};

use crate::advisor::{Advisor, AdvisorOptions, MonitorUpdate};
use crate::telemetry::{read_trace, sample_once, SourceKind};

/// How often the headless loop looks at the stop flag while waiting for a sample.
const STOP_POLL: Duration = Duration::from_millis(100);

/// Options of `cockpit monitor`.
#[derive(Clone, Debug, PartialEq)]
pub struct MonitorOptions {
    /// Headless (no TUI). [`run_headless`] is always headless; the flag is for the caller.
    pub no_tui: bool,
    /// Print one snapshot and exit.
    pub once: bool,
    /// JSON instead of text (one object for `once`, else one object per line).
    pub json: bool,
    /// Time between live samples.
    pub interval: Duration,
    /// Stop after this much time (measured on snapshot timestamps, so on trace time when
    /// replaying).
    pub duration: Option<Duration>,
    /// Record the live snapshots to this trace (JSON lines).
    pub record: Option<PathBuf>,
    /// Replay this trace instead of sampling.
    pub replay: Option<PathBuf>,
    /// Replay speed: 1 = real time, 0 = as fast as possible.
    pub replay_speed: f64,
    /// Where `monitor_summary.json` goes.
    pub out_dir: PathBuf,
}

impl Default for MonitorOptions {
    fn default() -> Self {
        Self {
            no_tui: false,
            once: false,
            json: false,
            interval: Duration::from_secs(1),
            duration: None,
            record: None,
            replay: None,
            replay_speed: 1.0,
            out_dir: PathBuf::from("runs/monitor"),
        }
    }
}

/// Human description of a snapshot source, for the summary.
fn describe_source(kind: &SourceKind) -> String {
    match kind {
        SourceKind::Live { interval } => format!("live, every {}", human_duration(*interval)),
        SourceKind::Replay { path, speed } if *speed > 0.0 => {
            format!("replay of {} at {speed}x", path.display())
        }
        SourceKind::Replay { path, .. } => {
            format!("replay of {} as fast as possible", path.display())
        }
    }
}

fn human_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// Run the headless monitor, writing to `out` (stdout in the CLI).
///
/// * `once`: one snapshot, printed as a status block or (with `json`) one JSON object;
///   nothing is written to disk.
/// * otherwise: one status line (or JSON line) per snapshot until `duration` has passed,
///   the replayed trace ends, or `stop` is set (the CLI sets it on Ctrl-C); then
///   `monitor_summary.json` is written into `out_dir`.
///
/// Returns the session (snapshot history and statistics) for plotting.
pub fn run_headless(
    opts: &MonitorOptions,
    out: &mut dyn Write,
    stop: &AtomicBool,
) -> anyhow::Result<MonitorSession> {
    if opts.record.is_some() && opts.replay.is_some() {
        bail!("--record and --replay cannot be combined: a replay already is a recording");
    }
    if opts.once {
        return run_once(opts, out);
    }

    let pipeline = spawn_pipeline(opts).context("cannot start the monitor")?;
    let mut session = MonitorSession::new(describe_source(pipeline.source()));
    if let (Some(notice), false) = (pipeline.notice(), opts.json) {
        writeln!(out, "note: {notice}")?;
    }
    let limit_ms = opts
        .duration
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let mut first_ms = None;
    while !stop.load(Ordering::Relaxed) {
        let update = match pipeline.recv_timeout(STOP_POLL) {
            Ok(update) => update,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if opts.json {
            writeln!(out, "{}", update_json(&update)?)?;
        } else {
            writeln!(out, "{}", status_line(&update))?;
        }
        out.flush()?;
        session.push(&update);
        let t = update.snapshot.timestamp_ms;
        let start = *first_ms.get_or_insert(t);
        if limit_ms.is_some_and(|limit| t.saturating_sub(start) >= limit) {
            break;
        }
    }
    drop(pipeline);

    let path = session.write_summary(&opts.out_dir)?;
    if !opts.json {
        writeln!(out, "summary: {}", path.display())?;
    }
    Ok(session)
}

/// `--once`: one snapshot (the first of the trace when replaying), judged on its own.
fn run_once(opts: &MonitorOptions, out: &mut dyn Write) -> anyhow::Result<MonitorSession> {
    let (snapshot, source) = match &opts.replay {
        Some(path) => {
            let first = read_trace(path)?.into_iter().next();
            let snapshot = first.with_context(|| format!("{} is empty", path.display()))?;
            (snapshot, format!("first snapshot of {}", path.display()))
        }
        None => (sample_once(), "one live snapshot".to_string()),
    };
    let mut advisor = Advisor::new(AdvisorOptions::instant());
    advisor.observe_snapshot(&snapshot);
    let update = MonitorUpdate {
        snapshot,
        advice: advisor.recommendations(),
        ..MonitorUpdate::default()
    };
    if opts.json {
        writeln!(out, "{}", update_json(&update)?)?;
    } else {
        write!(out, "{}", status_block(&update))?;
    }
    out.flush()?;
    let mut session = MonitorSession::new(source);
    session.push(&update);
    Ok(session)
}
