//! The run loop: a thin shell around [`App`] that drains the channels, draws at a fixed
//! rate and turns key presses into commands. The engine never waits on it.

use super::app::{Action, App, TuiExit};
use super::state::{CompareState, LogLevel};
use super::term::TerminalGuard;
use super::theme::Theme;
use super::TuiOptions;
use crate::advisor::MonitorUpdate;
use crate::engine::events::{Command, EventRx};
use anyhow::Context;
use crossterm::event::{self as term_event, Event as TermEvent, KeyEventKind};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

/// At most this many engine events are applied per tick, so a flood cannot stall drawing.
const MAX_EVENTS_PER_TICK: usize = 20_000;

/// Where the dashboard's inputs come from.
pub(crate) struct Sources {
    pub events: Option<EventRx>,
    pub telemetry: Option<Receiver<MonitorUpdate>>,
    pub commands: Option<Sender<Command>>,
}

/// Appends the event log to a file, when asked to.
struct LogFile {
    path: PathBuf,
    out: BufWriter<File>,
    next_seq: u64,
}

impl LogFile {
    fn open(path: Option<PathBuf>) -> anyhow::Result<Option<LogFile>> {
        let Some(path) = path else { return Ok(None) };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open the event log file {}", path.display()))?;
        Ok(Some(LogFile {
            path,
            out: BufWriter::new(file),
            next_seq: 0,
        }))
    }

    fn write_new(&mut self, app: &App) -> std::io::Result<()> {
        let mut wrote = false;
        for entry in app.log().since(self.next_seq) {
            writeln!(self.out, "{}", entry.to_line())?;
            wrote = true;
        }
        self.next_seq = app.log().next_seq();
        if wrote {
            self.out.flush()?;
        }
        Ok(())
    }
}

fn tick(fps: u32) -> Duration {
    Duration::from_secs_f64(1.0 / f64::from(fps.clamp(1, 60)))
}

/// Applies everything queued on the channels, without waiting.
fn drain(app: &mut App, sources: &mut Sources) {
    if let Some(events) = &sources.events {
        for _ in 0..MAX_EVENTS_PER_TICK {
            match events.try_recv() {
                Ok(event) => app.on_event(event),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    app.on_engine_disconnected();
                    sources.events = None;
                    break;
                }
            }
        }
    }
    if let Some(telemetry) = &sources.telemetry {
        loop {
            match telemetry.try_recv() {
                Ok(update) => app.on_update(&update),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    app.on_telemetry_disconnected();
                    sources.telemetry = None;
                    break;
                }
            }
        }
    }
}

fn perform(app: &mut App, sources: &Sources, action: Action) -> bool {
    match action {
        Action::Send(command) => {
            let delivered = sources
                .commands
                .as_ref()
                .is_some_and(|tx| tx.send(command.clone()).is_ok());
            if !delivered {
                app.on_send_failed(command);
            }
            false
        }
        Action::Quit => true,
    }
}

/// Runs the dashboard until it exits, the deadline passes or a signal arrives. Returns why,
/// and the sources (a run whose terminal hung up goes on with them, headless).
pub(crate) fn run(
    mut app: App,
    mut sources: Sources,
    opts: &TuiOptions,
    until: Option<Instant>,
) -> anyhow::Result<(TuiExit, Sources, Option<crate::engine::events::RunInfo>)> {
    let mut log_file = LogFile::open(opts.log_path.clone())?;
    let mut guard = TerminalGuard::enter().context("cannot set up the terminal")?;
    let result = frames(
        &mut app,
        &mut sources,
        opts,
        until,
        &mut guard,
        &mut log_file,
    );
    let hand_over = (guard.hung_up() || result.is_err())
        && app.mode() == crate::tui::Mode::Training
        && app.exit().is_none();
    if guard.hung_up() || hand_over {
        // Nothing can be shown on a terminal that is gone, and writing to it fails (which
        // `eprintln!` turns into a panic): the caller moves the output somewhere useful.
        let _ = crate::process::redirect_output(std::path::Path::new("/dev/null"));
    }
    drop(guard);
    if let Some(file) = &mut log_file {
        // best effort: the dashboard is closing anyway
        let _ = file.write_new(&app);
    }
    if hand_over {
        // The terminal is gone (SIGHUP, or it can no longer be read or drawn on): the run
        // is not the terminal's to end. Hand it back to go on headless.
        if let Err(e) = &result {
            tracing::warn!("the dashboard lost its terminal: {e:#}");
        }
        crate::tui::term::keep_signals_caught()?;
        return Ok((TuiExit::HangUp, sources, app.run().info.clone()));
    }
    result?;
    let exit = app.exit().cloned().unwrap_or(TuiExit::Closed);
    Ok((exit, sources, app.run().info.clone()))
}

/// Draw and handle input until the dashboard exits, a signal arrives, the terminal hangs up
/// or the deadline passes.
fn frames(
    app: &mut App,
    sources: &mut Sources,
    opts: &TuiOptions,
    until: Option<Instant>,
    guard: &mut TerminalGuard,
    log_file: &mut Option<LogFile>,
) -> anyhow::Result<()> {
    let tick = tick(opts.fps);
    let started = Instant::now();
    let mut next_frame = started;
    'run: loop {
        app.tick(started.elapsed().as_secs_f64());
        drain(app, sources);
        if let Some(file) = log_file.as_mut() {
            if let Err(e) = file.write_new(app) {
                let path = file.path.display().to_string();
                *log_file = None;
                app.push_log(
                    LogLevel::Error,
                    format!("stopped writing the event log to {path}: {e}"),
                );
            }
        }
        if app.exit().is_some() {
            break;
        }
        guard.terminal().draw(|frame| app.render(frame))?;
        next_frame += tick;
        let now = Instant::now();
        if next_frame < now {
            // fell behind (slow terminal): do not try to catch up with a burst of frames
            next_frame = now + tick;
        }

        // wait for input until the next frame is due; a key redraws at once
        while let Some(wait) = next_frame.checked_duration_since(Instant::now()) {
            if guard.signalled() || guard.hung_up() || until.is_some_and(|t| Instant::now() >= t) {
                break;
            }
            if !term_event::poll(wait)? {
                break;
            }
            match term_event::read()? {
                TermEvent::Key(key) if key.kind != KeyEventKind::Release => {
                    if let Some(action) = app.on_key(key) {
                        if perform(app, sources, action) {
                            break 'run;
                        }
                    }
                    next_frame = Instant::now();
                    break;
                }
                TermEvent::Resize(..) => {
                    next_frame = Instant::now();
                    break;
                }
                _ => {}
            }
        }

        if guard.hung_up() {
            break;
        }
        if guard.signalled() {
            if let Some(command) = app.on_signal(guard.signal_name()) {
                if let Some(tx) = &sources.commands {
                    let _ = tx.send(command);
                }
            }
            break;
        }
        if until.is_some_and(|t| Instant::now() >= t) {
            break;
        }
    }
    Ok(())
}

/// Runs the comparison view until q/Esc/Ctrl+C, a signal or a hang-up.
pub(crate) fn run_compare(state: &mut CompareState, theme: &Theme) -> anyhow::Result<TuiExit> {
    let mut guard = TerminalGuard::enter().context("cannot set up the terminal")?;
    let result = compare_frames(state, theme, &mut guard);
    let exit = if guard.hung_up() {
        // nothing can be shown on a terminal that is gone, and writing to it fails (which
        // `println!` turns into a panic)
        let _ = crate::process::redirect_output(std::path::Path::new("/dev/null"));
        TuiExit::HangUp
    } else if guard.signalled() {
        TuiExit::Interrupted
    } else {
        TuiExit::Closed
    };
    drop(guard);
    result.map(|()| exit)
}

/// Draw, then wait for a key (a resize redraws) until the view is left.
fn compare_frames(
    state: &mut CompareState,
    theme: &Theme,
    guard: &mut TerminalGuard,
) -> anyhow::Result<()> {
    loop {
        guard.terminal().draw(|frame| state.render(frame, theme))?;
        loop {
            if guard.signalled() || guard.hung_up() {
                return Ok(());
            }
            if !term_event::poll(Duration::from_millis(200))? {
                continue;
            }
            match term_event::read()? {
                TermEvent::Key(key) if key.kind != KeyEventKind::Release => {
                    if state.on_key(key) {
                        return Ok(());
                    }
                    break;
                }
                TermEvent::Resize(..) => break,
                _ => {}
            }
        }
    }
}
