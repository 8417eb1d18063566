//! Glue between the engine and the front ends: telemetry + advisor pipeline, the TUI, the
//! headless printer, the monitor and the plots.

use super::args::MonitorArgs;
use super::{EXIT_OK, EXIT_USAGE};
use crate::advisor::MonitorUpdate;
use crate::config::Config;
use crate::engine::events::{self, Command, EventRx};
use crate::headless::{self, HeadlessOutcome};
use crate::monitor::{self, MonitorOptions, MonitorSession, PipelineFeed};
use crate::process::SignalFlags;
use crate::tui::{self, Keymap, Theme, TuiExit, TuiOptions};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

/// A dashboard setting that cannot be used: its config key and why.
#[derive(Debug)]
struct TuiSettingError {
    key: &'static str,
    why: String,
}

impl std::fmt::Display for TuiSettingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = if self.key == "run.theme" {
            "theme"
        } else {
            self.key
        };
        write!(f, "{name}: {}", self.why)
    }
}

/// Theme, keymap and options for the dashboard from the config (errors are usage errors).
fn tui_options(
    cfg: &Config,
    theme: &str,
    run_dir: Option<&Path>,
) -> Result<TuiOptions, TuiSettingError> {
    let bad = |key, e: &dyn std::fmt::Display| TuiSettingError {
        key,
        why: e.to_string(),
    };
    let theme = Theme::load(theme).map_err(|e| bad("run.theme", &e))?;
    let keys: HashMap<String, String> = cfg
        .tui
        .keys
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let keymap = Keymap::from_names(&keys).map_err(|e| bad("tui.keys", &e))?;
    Ok(TuiOptions {
        fps: cfg.tui.fps,
        theme,
        keymap,
        setpoint_step: cfg.tui.setpoint_step,
        log_path: run_dir.map(|d| d.join("events.log")),
        ..TuiOptions::default()
    })
}

/// Check the TUI settings before training starts, so a bad theme is a usage error up front.
/// Err: the key at fault (`run.theme`, `tui.keys`) and the message.
pub fn validate_tui(cfg: &Config) -> Result<(), (&'static str, String)> {
    match tui_options(cfg, &cfg.run.theme, None) {
        Ok(_) => Ok(()),
        Err(e) if e.key == "run.theme" => {
            Err((e.key, format!("run.theme = {:?}: {}", cfg.run.theme, e.why)))
        }
        Err(e) => Err((e.key, e.to_string())),
    }
}

/// Telemetry and the advisor while training: samples go to `RUN_DIR/telemetry.jsonl` too.
/// Returns the updates and the feed the engine's events must reach (step timings, dtype).
pub fn training_telemetry(
    cfg: &Config,
    run_dir: &Path,
) -> Option<(Receiver<MonitorUpdate>, PipelineFeed)> {
    if !cfg.monitor.enabled {
        return None;
    }
    let opts = MonitorOptions {
        interval: Duration::from_secs_f64(cfg.monitor.interval_secs),
        record: Some(run_dir.join("telemetry.jsonl")),
        out_dir: run_dir.to_path_buf(),
        ..MonitorOptions::default()
    };
    match monitor::spawn_pipeline(&opts) {
        Ok(p) => {
            if let Some(n) = p.notice() {
                tracing::info!("telemetry: {n}");
            }
            let feed = p.feeder();
            Some((p.into_receiver(), feed))
        }
        Err(e) => {
            tracing::warn!("telemetry off: {e}");
            None
        }
    }
}

/// Forward engine events to a front end, feeding the advisor on the way. Never blocks the
/// engine: the new channel drops Step events when the front end falls behind.
fn tee(events: EventRx, feed: PipelineFeed) -> EventRx {
    let (tx, rx) = events::channel(256);
    let spawned = std::thread::Builder::new()
        .name("cockpit-tee".into())
        .spawn(move || {
            while let Some(ev) = events.recv() {
                feed.feed(&ev);
                if !tx.send(ev) {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("advisor feed thread: {e}");
    }
    rx
}

/// How the front end of a training run ended.
pub struct Frontend {
    pub outcome: HeadlessOutcome,
    /// The attach server, to be shut down once the engine thread has been joined.
    pub attach: Option<crate::attach::RelayGuard>,
    /// The TensorBoard/MLflow writer, to be waited for once the engine thread has been joined.
    pub tracking: Option<crate::tracking::TrackingGuard>,
}

/// Where the run's output goes once its terminal is gone.
pub fn hangup_log(run_dir: &Path) -> std::path::PathBuf {
    run_dir.join("cockpit.out")
}

/// The front end of a training run: the dashboard, or progress lines. When the dashboard's
/// terminal hangs up the run goes on headless (output in `RUN_DIR/cockpit.out`; its control
/// socket stays up, so `cockpit attach` brings a dashboard back). `track`: write TensorBoard
/// and MLflow logs (rank 0).
pub fn run_frontend(
    use_tui: bool,
    track: bool,
    events: EventRx,
    commands: Sender<Command>,
    cfg: &Config,
    run_dir: &Path,
    flags: &SignalFlags,
) -> anyhow::Result<Frontend> {
    let telemetry = training_telemetry(cfg, run_dir);
    // TensorBoard/MLflow: a copy of both streams, before every front end (TUI or headless)
    let tracking_opts = track
        .then(|| crate::tracking::TrackingOptions::from_config(cfg, run_dir))
        .flatten();
    let (events, telemetry, tracking) = match (tracking_opts, telemetry) {
        (Some(opts), Some((rx, feed))) => {
            let (events, rx, guard) = crate::tracking::tee(events, Some(rx), opts);
            (events, rx.map(|rx| (rx, feed)), guard)
        }
        (Some(opts), None) => {
            let (events, _, guard) = crate::tracking::tee(events, None, opts);
            (events, None, guard)
        }
        (None, telemetry) => (events, telemetry, None),
    };
    let (events, updates) = match telemetry {
        Some((rx, feed)) => (tee(events, feed), Some(rx)),
        None => (events, None),
    };
    // Serve the run on RUN_DIR's owner-only socket so `cockpit attach` can watch and steer it.
    let (events, updates, attach_guard) = match crate::attach::Server::start(run_dir) {
        Ok(server) => {
            tracing::info!("attach with: cockpit attach {}", run_dir.display());
            if !use_tui {
                crate::errln!(
                    "attach a dashboard with: cockpit attach {}",
                    run_dir.display()
                );
            }
            let r = server.relay(events, commands.clone(), updates);
            (r.events, r.telemetry, Some(r.guard))
        }
        Err(e) => {
            tracing::warn!("attach: this run cannot be attached to: {e}");
            (events, updates, None)
        }
    };
    if use_tui {
        let opts =
            tui_options(cfg, &cfg.run.theme, Some(run_dir)).map_err(|e| anyhow::anyhow!("{e}"))?;
        // Without telemetry the dashboard still wants a receiver: one that never delivers.
        let (_keep, empty) = mpsc::channel();
        let end = tui::run_training_handback(events, commands, updates.unwrap_or(empty), opts)?;
        let (finished, interrupted) = match end.exit {
            TuiExit::Finished { reason } => (Some(reason), false),
            TuiExit::Interrupted => (None, true),
            TuiExit::HangUp => {
                let (Some(events), Some(commands)) = (end.events, end.commands) else {
                    return Ok(Frontend {
                        outcome: HeadlessOutcome::default(),
                        attach: attach_guard,
                        tracking,
                    });
                };
                // The terminal is gone: follow the run headless from here on.
                crate::process::register(flags)?;
                let mut err = crate::stdio::BestEffort::stderr();
                headless::hang_up(&hangup_log(run_dir), &mut err);
                let outcome = headless::run(
                    events,
                    commands,
                    end.telemetry,
                    flags,
                    Duration::from_secs_f64(cfg.run.log_every_secs),
                    headless::Output {
                        out: &mut err,
                        hangup_log: Some(&hangup_log(run_dir)),
                        run: end.run,
                    },
                );
                return Ok(Frontend {
                    outcome,
                    attach: attach_guard,
                    tracking,
                });
            }
            TuiExit::StopRequested { .. }
            | TuiExit::EngineGone
            | TuiExit::Closed
            | TuiExit::Detached => (None, false),
        };
        Ok(Frontend {
            outcome: HeadlessOutcome {
                finished,
                interrupted,
            },
            attach: attach_guard,
            tracking,
        })
    } else {
        let log_every = Duration::from_secs_f64(cfg.run.log_every_secs);
        let outcome = headless::run(
            events,
            commands,
            updates,
            flags,
            log_every,
            headless::Output {
                out: &mut crate::stdio::BestEffort::stderr(),
                hangup_log: Some(&hangup_log(run_dir)),
                run: None,
            },
        );
        Ok(Frontend {
            outcome,
            attach: attach_guard,
            tracking,
        })
    }
}

/// Plots at the end of a run, however it ended (failures are logged, never fatal): where
/// they went, or why there are none, for the summary.
pub fn after_run(run_dir: &Path) -> String {
    match crate::report::plot_run_detailed(run_dir) {
        Ok(summary) => {
            tracing::info!("plots: {summary}");
            let charts = summary.charts().len();
            format!("{} ({charts} charts)", run_dir.join("plots").display())
        }
        Err(e) => {
            tracing::warn!("plots: {e}");
            format!("none ({e})")
        }
    }
}

/// `cockpit plot RUN_DIR`.
pub fn plot_run(run_dir: &Path) -> anyhow::Result<i32> {
    use crate::report::ReportError;
    let summary = match crate::report::plot_run_detailed(run_dir) {
        Ok(s) => s,
        // records that are not records (or not a file): bad input, named, exit 2
        Err(e @ (ReportError::Parse { .. } | ReportError::MissingMetrics { .. })) => {
            crate::errln!("cockpit: plot: {e}");
            return Ok(EXIT_USAGE);
        }
        Err(e) => return Err(e.into()),
    };
    crate::outln!("{summary}");
    Ok(EXIT_OK)
}

fn secs(flag: &str, v: Option<f64>) -> Result<Option<Duration>, String> {
    match v {
        None => Ok(None),
        Some(s) if s > 0.0 && s.is_finite() => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|e| format!("{flag} {s}: {e}")),
        Some(s) => Err(format!("{flag} {s}: must be a positive number of seconds")),
    }
}

/// `cockpit monitor` / `cockpit --monitor-only`.
pub fn monitor(m: MonitorArgs) -> anyhow::Result<i32> {
    let cfg = Config::default();
    let interval = match secs("--interval", m.interval.or(Some(cfg.monitor.interval_secs))) {
        Ok(i) => i.unwrap_or(Duration::from_secs(1)),
        Err(e) => return usage(&e),
    };
    let duration = match secs("--duration", m.duration) {
        Ok(d) => d,
        Err(e) => return usage(&e),
    };
    if m.record.is_some() && m.replay.is_some() {
        return usage("--record and --replay cannot be combined");
    }
    if m.replay.as_ref().is_some_and(|p| !p.is_file()) {
        return usage(&format!(
            "--replay {}: no such file",
            m.replay
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ));
    }
    if !(m.replay_speed >= 0.0 && m.replay_speed.is_finite()) {
        return usage(&format!(
            "--replay-speed {}: must be ≥ 0 (0 = as fast as possible)",
            m.replay_speed
        ));
    }
    use std::io::IsTerminal;
    let use_tui = !m.no_tui && !m.once && !m.json && std::io::stdout().is_terminal();
    let out_dir = m.out_dir.clone().unwrap_or_else(|| {
        Path::new(&cfg.run.runs_root).join(format!("monitor-{}", super::timestamp()))
    });
    let opts = MonitorOptions {
        no_tui: !use_tui,
        once: m.once,
        json: m.json,
        interval,
        duration,
        record: m.record.clone(),
        replay: m.replay.clone(),
        replay_speed: m.replay_speed,
        out_dir: out_dir.clone(),
    };
    let session = if use_tui {
        let theme = m.theme.clone().unwrap_or_else(|| cfg.run.theme.clone());
        let mut tui_opts = match tui_options(&cfg, &theme, None) {
            Ok(o) => o,
            Err(e) => return usage(&e.to_string()),
        };
        tui_opts.source = m.replay.as_ref().map(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let speed = if m.replay_speed == 0.0 {
                "as fast as possible".to_string()
            } else {
                format!("at {}×", m.replay_speed)
            };
            format!("REPLAY of {name} {speed}")
        });
        let pipeline = monitor::spawn_pipeline(&opts)?;
        let source = format!("{:?}", pipeline.source());
        let upstream = pipeline.into_receiver();
        // Keep the history for the summary and plots while the dashboard renders.
        let (tx, rx) = mpsc::channel();
        let collector = std::thread::spawn(move || {
            let mut session = MonitorSession::new(source);
            while let Ok(u) = upstream.recv() {
                session.push(&u);
                if tx.send(u).is_err() {
                    break;
                }
            }
            session
        });
        tui::run_monitor(rx, tui_opts, duration)?;
        collector
            .join()
            .map_err(|_| anyhow::anyhow!("the monitor collector panicked"))?
    } else {
        let stop = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register_conditional_shutdown(
                sig,
                super::EXIT_INTERRUPTED,
                stop.clone(),
            )?;
            signal_hook::flag::register(sig, stop.clone())?;
        }
        let mut stdout = std::io::stdout();
        let session = monitor::run_headless(&opts, &mut stdout, &stop)?;
        if m.once {
            return Ok(EXIT_OK);
        }
        let _ = stop.load(Ordering::SeqCst);
        session
    };
    if session.sample_count() > 0 {
        if use_tui {
            // The headless session writes its own summary; the dashboard's is written here.
            let path = session.write_summary(&out_dir)?;
            crate::errln!("wrote {}", path.display());
        }
        match crate::report::plot_monitor_detailed(session.snapshots(), &out_dir) {
            Ok(s) => crate::errln!("{s}"),
            Err(e) => crate::errln!("plots: {e}"),
        }
    }
    Ok(EXIT_OK)
}

/// `cockpit attach RUN_DIR`.
pub fn attach(
    run_dir: &Path,
    no_tui: bool,
    allow_stop: bool,
    theme: Option<&str>,
) -> anyhow::Result<i32> {
    follow(run_dir, no_tui, allow_stop, theme, false)
}

/// Show a run served on its control socket. `owner`: the viewer is the run's own front end
/// (the `--gpus N` launcher), so quitting stops the run rather than detaching.
pub fn follow(
    run_dir: &Path,
    no_tui: bool,
    allow_stop: bool,
    theme: Option<&str>,
    owner: bool,
) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    // The run's own config, for its theme and keys; the defaults when it cannot be read.
    let cfg: Config = std::fs::read_to_string(run_dir.join("training_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let tui = if !no_tui && std::io::stdout().is_terminal() {
        match tui_options(&cfg, theme.unwrap_or(&cfg.run.theme), None) {
            Ok(o) => Some(o),
            Err(e) => {
                crate::errln!("cockpit attach: {e}");
                return Ok(EXIT_USAGE);
            }
        }
    } else {
        None
    };
    let opts = crate::attach::AttachOptions {
        tui,
        allow_stop,
        log_every: Duration::from_secs_f64(cfg.run.log_every_secs),
        owner,
    };
    crate::attach::run_attach(run_dir, opts)
}

fn usage(msg: &str) -> anyhow::Result<i32> {
    crate::errln!("cockpit monitor: {msg}");
    Ok(EXIT_USAGE)
}
