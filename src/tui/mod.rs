//! The ratatui dashboard (training and monitor views), keymap and themes.
//!
//! Structure: [`state`] holds plain data updated from engine [`Event`]s and
//! [`MonitorUpdate`]s; [`views`] are widgets that draw that state; [`App`] is the pure state
//! machine tying them together (events, updates and keys in; [`Action`]s out), testable on
//! ratatui's `TestBackend`; [`run_training`] and [`run_monitor`] are the thin loops that
//! drive it on a real terminal. [`run_compare`] shows `cockpit compare`'s table and charts
//! ([`state::CompareState`] drawn by [`views::compare`]).
//!
//! [`Event`]: crate::engine::events::Event

pub mod app;
pub mod fmt;
pub mod keymap;
mod run;
pub mod state;
pub mod term;
pub mod theme;
pub mod views;

pub use app::{Action, App, Mode, QuitChoice, RunStatus, TuiExit, Viewer, MIN_SETPOINT};
pub use keymap::{KeyAction, KeyBinding, Keymap, KeymapError};
pub use theme::{ColorSupport, Rgb, Theme, ThemeError};

use crate::advisor::MonitorUpdate;
use crate::engine::events::{Command, EventRx};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

/// How the dashboard looks and behaves.
#[derive(Clone, Debug)]
pub struct TuiOptions {
    /// Frames per second (clamped to 1..=60).
    pub fps: u32,
    /// Colours, as loaded (truecolor); resolved for the terminal by `color`.
    pub theme: Theme,
    /// Colour depth; `None` detects it from `COCKPIT_COLOR`, `COLORTERM` and `TERM`.
    pub color: Option<ColorSupport>,
    /// Key bindings.
    pub keymap: Keymap,
    /// SCU setpoint change per `]`/`[` press, as a fraction (0.001 = 0.1 percentage point).
    pub setpoint_step: f64,
    /// Also append the event log to this file.
    pub log_path: Option<PathBuf>,
    /// Steps kept at full resolution for the charts' recent-window view, which shows the last
    /// fifth of the run (at least 10 steps, at most this many).
    pub recent_window: usize,
    /// Points kept per chart series for the whole run (thinned by halving beyond this).
    pub history_capacity: usize,
    /// A viewer attached to a run owned by another process (`cockpit attach`): it steers the
    /// run like its owner, the header says it is attached, and `q`, Ctrl+C and signals
    /// detach and never stop the run.
    pub attached: bool,
    /// An attached viewer may stop the run: `Q` opens the confirm popup (`q` still detaches).
    pub allow_stop: bool,
    /// Where the data comes from when it is not live, e.g. "replay of trace.jsonl at 10×";
    /// shown in the monitor header so a recording is never mistaken for the machine.
    pub source: Option<String>,
}

impl TuiOptions {
    /// Default frame rate.
    pub const DEFAULT_FPS: u32 = 10;
    /// Default setpoint step: 0.1 percentage point.
    pub const DEFAULT_SETPOINT_STEP: f64 = 0.001;

    fn resolved(&self) -> TuiOptions {
        let support = self.color.unwrap_or_else(ColorSupport::detect);
        TuiOptions {
            theme: self.theme.clone().with_color_support(support),
            ..self.clone()
        }
    }
}

impl Default for TuiOptions {
    fn default() -> Self {
        TuiOptions {
            fps: Self::DEFAULT_FPS,
            theme: Theme::default(),
            color: None,
            keymap: Keymap::default(),
            setpoint_step: Self::DEFAULT_SETPOINT_STEP,
            log_path: None,
            recent_window: 500,
            history_capacity: 2048,
            attached: false,
            allow_stop: false,
            source: None,
        }
    }
}

/// Runs the training dashboard until the user leaves, the run ends after a stop request, or
/// SIGINT/SIGTERM/SIGQUIT arrives (which sends `Command::Interrupt`). Events are drained
/// with `try_recv` each frame; commands go out on `commands`. The terminal is always
/// restored, also on error or panic. The caller should join the engine afterwards: for
/// [`TuiExit::StopRequested`] and [`TuiExit::Interrupted`] it may still be saving.
pub fn run_training(
    events: EventRx,
    commands: Sender<Command>,
    telemetry: Receiver<MonitorUpdate>,
    opts: TuiOptions,
) -> anyhow::Result<TuiExit> {
    run_training_handback(events, commands, telemetry, opts).map(|end| end.exit)
}

/// How the training dashboard ended, with the channels it ran on: after
/// [`TuiExit::HangUp`] (the terminal went away) the run goes on and the caller follows it
/// headless on these.
pub struct TrainingEnd {
    pub exit: TuiExit,
    pub events: Option<EventRx>,
    pub commands: Option<Sender<Command>>,
    pub telemetry: Option<Receiver<MonitorUpdate>>,
    /// The run, as its `RunStarted` event described it (when it came).
    pub run: Option<crate::engine::events::RunInfo>,
}

/// [`run_training`], handing the channels back.
pub fn run_training_handback(
    events: EventRx,
    commands: Sender<Command>,
    telemetry: Receiver<MonitorUpdate>,
    opts: TuiOptions,
) -> anyhow::Result<TrainingEnd> {
    let opts = opts.resolved();
    let app = App::training(&opts);
    let (exit, sources, run) = run::run(
        app,
        run::Sources {
            events: Some(events),
            telemetry: Some(telemetry),
            commands: Some(commands),
        },
        &opts,
        None,
    )?;
    Ok(TrainingEnd {
        exit,
        events: sources.events,
        commands: sources.commands,
        telemetry: sources.telemetry,
        run,
    })
}

/// Runs the monitor dashboard until the user quits, `duration` passes, or SIGINT/SIGTERM.
pub fn run_monitor(
    updates: Receiver<MonitorUpdate>,
    opts: TuiOptions,
    duration: Option<Duration>,
) -> anyhow::Result<()> {
    let opts = opts.resolved();
    let app = App::monitor(&opts);
    let until = duration.map(|d| Instant::now() + d);
    run::run(
        app,
        run::Sources {
            events: None,
            telemetry: Some(updates),
            commands: None,
        },
        &opts,
        until,
    )?;
    Ok(())
}

/// Shows `cockpit compare`'s table and overlaid charts (see [`state::CompareState`]) until
/// the user leaves (q, Esc, Ctrl+C: [`TuiExit::Closed`]), a signal arrives
/// ([`TuiExit::Interrupted`]) or the terminal hangs up ([`TuiExit::HangUp`]; output is then
/// sent to /dev/null). The terminal is always restored.
pub fn run_compare(state: &mut state::CompareState, opts: &TuiOptions) -> anyhow::Result<TuiExit> {
    let opts = opts.resolved();
    run::run_compare(state, &opts.theme)
}
