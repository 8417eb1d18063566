//! The dashboard as a pure state machine: events, monitor updates and key presses in;
//! commands to send and the decision to quit out. It never touches the terminal or a clock,
//! so every behaviour can be driven and rendered in tests.

use super::fmt;
use super::keymap::{KeyAction, Keymap};
use super::state::{
    CommandKind, CommandState, EventLog, Finished, HistorySizes, LogLevel, RunState, TelemetryState,
};
use super::theme::Theme;
use super::TuiOptions;
use crate::advisor::MonitorUpdate;
use crate::engine::events::{Command, Event, FinishReason};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

/// The SCU setpoint never goes below this (0.01 %).
pub const MIN_SETPOINT: f64 = 1e-4;

/// Which dashboard this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `cockpit train`: a run plus telemetry.
    Training,
    /// `cockpit monitor`: telemetry, advice and GPU processes only.
    Monitor,
}

/// What the run loop should do after a key press.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send this command to the engine.
    Send(Command),
    /// Leave the dashboard now; [`App::exit`] says why.
    Quit,
}

/// Why the dashboard closed.
#[derive(Clone, Debug, PartialEq)]
pub enum TuiExit {
    /// The engine sent `Finished` (the run completed, failed, or stopped on request).
    Finished {
        /// How the run ended.
        reason: FinishReason,
    },
    /// The user asked the engine to stop and left before it confirmed; the engine got
    /// `Command::Stop { save }` and may still be shutting down.
    StopRequested {
        /// Whether the stop asked for a checkpoint.
        save: bool,
    },
    /// The engine's event channel closed without a `Finished` event.
    EngineGone,
    /// SIGINT, SIGTERM or SIGQUIT: `Command::Interrupt` (save, then stop) was sent to the
    /// engine.
    Interrupted,
    /// The terminal went away (SIGHUP, or its input failed): the run goes on headless.
    HangUp,
    /// The monitor view was closed.
    Closed,
    /// An attached viewer left; the run goes on in its own process.
    Detached,
}

/// The three answers of the quit popup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuitChoice {
    /// Write a checkpoint, then stop (`Stop { save: true }`).
    SaveAndQuit,
    /// Stop without a checkpoint (`Stop { save: false }`).
    Quit,
    /// Keep training.
    Cancel,
}

impl QuitChoice {
    /// The choices in button order.
    pub const ALL: [QuitChoice; 3] = [
        QuitChoice::SaveAndQuit,
        QuitChoice::Quit,
        QuitChoice::Cancel,
    ];

    fn step(self, forward: bool) -> QuitChoice {
        let i = Self::ALL.iter().position(|c| *c == self).unwrap_or(0);
        let n = Self::ALL.len();
        Self::ALL[if forward {
            (i + 1) % n
        } else {
            (i + n - 1) % n
        }]
    }
}

/// A window drawn over the dashboard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlay {
    /// Nothing over the dashboard.
    None,
    /// The key help.
    Help,
    /// "Stop the run?" with save-and-quit / quit / cancel.
    QuitConfirm {
        /// The highlighted answer.
        selected: QuitChoice,
    },
}

/// A one-line message in the footer, replaced by the next key press.
#[derive(Clone, Debug, PartialEq)]
pub struct Notice {
    /// How the message is coloured.
    pub level: LogLevel,
    /// What it says.
    pub text: String,
}

/// View settings the user toggles.
#[derive(Clone, Debug, PartialEq)]
pub struct UiState {
    /// Loss smoothing: an index into [`SMOOTHING_LEVELS`](super::state::SMOOTHING_LEVELS)
    /// (0: raw). Smoothed, the raw loss is drawn faintly beneath.
    pub smoothing: usize,
    /// Charts show the recent window instead of the whole run.
    pub recent: bool,
    /// GPU panel with the focus.
    pub focus_gpu: usize,
    /// The window drawn over the dashboard, if any.
    pub overlay: Overlay,
    /// A footer message, replaced by the next key press.
    pub notice: Option<Notice>,
}

impl Default for UiState {
    fn default() -> Self {
        UiState {
            smoothing: 1,
            recent: false,
            focus_gpu: 0,
            overlay: Overlay::None,
            notice: None,
        }
    }
}

/// Where the run stands, for the header badge and key handling.
#[derive(Clone, Debug, PartialEq)]
pub enum RunStatus {
    /// No `RunStarted` yet.
    Waiting,
    /// Steps are running.
    Running,
    /// The engine confirmed a pause.
    Paused,
    /// A stop was requested; waiting for `Finished`.
    Stopping {
        /// Whether a checkpoint was asked for.
        save: bool,
    },
    /// The engine sent `Finished`.
    Finished(FinishReason),
    /// The event channel closed without `Finished`.
    EngineGone,
}

/// Who is looking at the run, for the header and the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Viewer {
    /// The process that runs the training (`cockpit train`): `q` asks whether to stop.
    Owner,
    /// `cockpit attach`: steers the run like its owner (batch, S*, checkpoint, pause); `q`
    /// detaches; stopping the run needs `--allow-stop` (then `Q`, confirmed).
    Attached {
        /// Attached with `--allow-stop`.
        allow_stop: bool,
    },
}

/// The dashboard state machine.
pub struct App {
    mode: Mode,
    run: RunState,
    telemetry: TelemetryState,
    log: EventLog,
    commands: CommandState,
    ui: UiState,
    keymap: Keymap,
    theme: Theme,
    setpoint_step: f64,
    stopping: Option<bool>,
    engine_gone: bool,
    exit: Option<TuiExit>,
    /// Attached to a run in another process: leaving detaches, it never stops the run.
    attached: bool,
    /// Attached with permission to stop the run (through `Q` and the confirm popup).
    allow_stop: bool,
    /// Not live: e.g. a replayed trace (see [`TuiOptions::source`]).
    source: Option<String>,
    /// The dashboard's clock (seconds, from [`App::tick`]): how long a pause has lasted.
    now: f64,
}

impl App {
    /// A training dashboard.
    pub fn training(opts: &TuiOptions) -> App {
        App::new(Mode::Training, opts)
    }

    /// A monitor dashboard.
    pub fn monitor(opts: &TuiOptions) -> App {
        App::new(Mode::Monitor, opts)
    }

    fn new(mode: Mode, opts: &TuiOptions) -> App {
        App {
            mode,
            run: RunState::new(HistorySizes {
                capacity: opts.history_capacity,
                recent_window: opts.recent_window,
            }),
            telemetry: TelemetryState::default(),
            log: EventLog::default(),
            commands: CommandState::default(),
            ui: UiState::default(),
            keymap: opts.keymap.clone(),
            theme: opts.theme.clone(),
            setpoint_step: if opts.setpoint_step.is_finite() && opts.setpoint_step > 0.0 {
                opts.setpoint_step
            } else {
                TuiOptions::DEFAULT_SETPOINT_STEP
            },
            stopping: None,
            engine_gone: false,
            exit: None,
            attached: opts.attached,
            allow_stop: opts.allow_stop,
            source: opts.source.clone(),
            now: 0.0,
        }
    }

    /// Advances the dashboard's clock (seconds since it started). The run loop calls it
    /// every frame; nothing else in the app reads a clock.
    pub fn tick(&mut self, now_s: f64) {
        if now_s.is_finite() && now_s >= self.now {
            self.now = now_s;
        }
    }

    /// How long the run has been paused, while it is.
    pub fn paused_for(&self) -> Option<f64> {
        self.run
            .paused_since
            .filter(|_| self.run.paused && self.run.finished.is_none())
            .map(|since| (self.now - since).max(0.0))
    }

    /// Who is looking at the run.
    pub fn viewer(&self) -> Viewer {
        if self.attached {
            Viewer::Attached {
                allow_stop: self.allow_stop,
            }
        } else {
            Viewer::Owner
        }
    }

    /// Which dashboard this is.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The run as known from events.
    pub fn run(&self) -> &RunState {
        &self.run
    }
    /// Telemetry and advice.
    pub fn telemetry(&self) -> &TelemetryState {
        &self.telemetry
    }
    /// The event log.
    pub fn log(&self) -> &EventLog {
        &self.log
    }
    /// Commands sent and their outcomes.
    pub fn commands(&self) -> &CommandState {
        &self.commands
    }
    /// Toggles, focus and overlays.
    pub fn ui(&self) -> &UiState {
        &self.ui
    }
    /// Key bindings.
    pub fn keymap(&self) -> &Keymap {
        &self.keymap
    }
    /// Where the data comes from when it is not live (a replay), for the header.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }
    /// Colours.
    pub fn theme(&self) -> &Theme {
        &self.theme
    }

    /// Set once the dashboard should close, with the reason.
    pub fn exit(&self) -> Option<&TuiExit> {
        self.exit.as_ref()
    }

    /// Where the run stands.
    pub fn status(&self) -> RunStatus {
        if let Some(f) = &self.run.finished {
            RunStatus::Finished(f.reason)
        } else if self.engine_gone {
            RunStatus::EngineGone
        } else if let Some(save) = self.stopping {
            RunStatus::Stopping { save }
        } else if self.run.info.is_none() {
            RunStatus::Waiting
        } else if self.run.paused {
            RunStatus::Paused
        } else {
            RunStatus::Running
        }
    }

    /// Whether the run can still take commands.
    fn accepts_commands(&self) -> bool {
        self.run.finished.is_none() && !self.engine_gone && self.stopping.is_none()
    }

    // ---------------------------------------------------------------- engine events

    /// Applies one engine event.
    pub fn on_event(&mut self, event: Event) {
        self.run.note(&event);
        match event {
            Event::RunStarted(info) => {
                self.run.on_started(&info);
                self.log.push(
                    Some(info.start_step),
                    LogLevel::Info,
                    format!(
                        "run {} started on {} ({}: {})",
                        info.run_name, info.device, info.dtype, info.dtype_reason
                    ),
                );
                if !info.summary.is_empty() {
                    self.log
                        .push(Some(info.start_step), LogLevel::Info, info.summary.clone());
                }
            }
            Event::Step(s) => self.run.on_step(&s),
            Event::Eval(e) => {
                self.run.on_eval(&e);
                self.log.push(
                    Some(e.step),
                    LogLevel::Info,
                    format!(
                        "eval: {} bits/token · val loss {:.4} · ppl {:.2}",
                        crate::util::plus_minus(e.val_bpt, e.val_bpt_se, 3),
                        e.val_loss,
                        e.val_ppl
                    ),
                );
            }
            Event::Scu(s) => self.run.on_scu(&s),
            Event::ScuConverged {
                step,
                s_ratio,
                lambda,
                target,
            } => {
                self.run.converged = true;
                self.log.push(
                    Some(step),
                    LogLevel::Good,
                    format!(
                        "SCU converged: S {:.2}% (S* {:.2}%), λ {}",
                        s_ratio * 100.0,
                        target * 100.0,
                        fmt::value(lambda)
                    ),
                );
            }
            Event::CheckpointSaved {
                step,
                path,
                bytes,
                ms,
            } => {
                self.commands
                    .confirm(CommandKind::Checkpoint, step, &format!("saved {path}"));
                self.log.push(
                    Some(step),
                    LogLevel::Good,
                    format!(
                        "checkpoint saved: {path} ({}, {:.0} ms)",
                        fmt::bytes(bytes),
                        ms
                    ),
                );
            }
            Event::CommandApplied {
                step,
                command,
                detail,
            } => {
                match &command {
                    Command::SetBatchSize { micro_batch } => {
                        self.run.micro_batch = Some(*micro_batch);
                    }
                    Command::SetScuSetpoint { target } => self.run.setpoint = Some(*target),
                    _ => {}
                }
                self.commands.applied(step, &command, &detail);
                self.ui.notice = None;
                let text = if detail.is_empty() {
                    format!("applied: {}", command.label())
                } else {
                    format!("applied: {} ({detail})", command.label())
                };
                self.log.push(Some(step), LogLevel::Good, text);
            }
            Event::CommandRejected {
                step,
                command,
                reason,
            } => {
                self.commands.rejected(step, &command, &reason);
                self.ui.notice = None;
                self.log.push(
                    Some(step),
                    LogLevel::Warn,
                    format!("rejected: {}: {reason}", command.label()),
                );
            }
            Event::Paused { step } => {
                if !self.run.paused {
                    self.run.paused_since = Some(self.now);
                }
                self.run.paused = true;
                self.commands
                    .confirm(CommandKind::PauseResume, step, "paused");
                self.log.push(Some(step), LogLevel::Info, "paused");
            }
            Event::Resumed { step } => {
                let text = match self.paused_for() {
                    Some(s) => format!("resumed after {}", fmt::clock(s)),
                    None => "resumed".to_string(),
                };
                self.run.paused = false;
                self.run.paused_since = None;
                self.commands
                    .confirm(CommandKind::PauseResume, step, "resumed");
                self.log.push(Some(step), LogLevel::Info, text);
            }
            Event::Warning { step, message } => {
                self.log.push(Some(step), LogLevel::Warn, message);
            }
            Event::Sample { step, prompt, text } => {
                // One line: the model's greedy text after the fixed prompt.
                let flat = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
                self.log.push(
                    Some(step),
                    LogLevel::Info,
                    format!("sample: {} ⟶ {}", flat(&prompt), flat(&text)),
                );
            }
            Event::SampleDiversity {
                step,
                prompts,
                samples_per_prompt,
                distinct_1,
                distinct_2,
                cosine_distance,
                ..
            } => {
                let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
                self.log.push(
                    Some(step),
                    LogLevel::Info,
                    format!(
                        "samples: {prompts}×{samples_per_prompt}: distinct-1 {}, distinct-2 {}, cosine distance {}",
                        f(distinct_1),
                        f(distinct_2),
                        f(cosine_distance)
                    ),
                );
            }
            Event::Finished {
                step,
                reason,
                message,
                elapsed_s,
            } => self.on_finished(step, reason, message, elapsed_s),
        }
    }

    fn on_finished(&mut self, step: u64, reason: FinishReason, message: String, elapsed_s: f64) {
        let level = match reason {
            FinishReason::Completed => LogLevel::Good,
            FinishReason::Stopped | FinishReason::Interrupted => LogLevel::Warn,
            FinishReason::Failed => LogLevel::Error,
        };
        let text = if message.is_empty() {
            format!("finished ({})", fmt::finish_reason(reason))
        } else {
            format!("finished ({}): {message}", fmt::finish_reason(reason))
        };
        self.log.push(Some(step), level, text);
        self.run.paused = false;
        self.run.finished = Some(Finished {
            step,
            reason,
            message,
            elapsed_s,
        });
        if matches!(self.ui.overlay, Overlay::QuitConfirm { .. }) {
            self.ui.overlay = Overlay::None;
        }
        if self.stopping.is_some() && self.exit.is_none() {
            self.exit = Some(TuiExit::Finished { reason });
        }
    }

    /// The engine's event channel closed.
    pub fn on_engine_disconnected(&mut self) {
        if self.engine_gone || self.run.finished.is_some() || self.mode == Mode::Monitor {
            return;
        }
        self.engine_gone = true;
        self.log.push(
            self.run.step(),
            LogLevel::Error,
            "the engine stopped without finishing the run",
        );
        if self.stopping.is_some() && self.exit.is_none() {
            self.exit = Some(TuiExit::EngineGone);
        }
    }

    /// A command could not be delivered (the engine is gone).
    pub fn on_send_failed(&mut self, command: Command) {
        self.log.push(
            self.run.step(),
            LogLevel::Error,
            format!("could not send {}: the engine is gone", command.label()),
        );
        self.commands.not_sent(command);
        self.on_engine_disconnected();
    }

    /// The telemetry channel closed: the panels keep the last sample.
    pub fn on_telemetry_disconnected(&mut self) {
        self.log.push(
            self.run.step(),
            LogLevel::Warn,
            "telemetry stopped: showing the last sample",
        );
        if self.mode == Mode::Monitor {
            self.notice(LogLevel::Warn, "telemetry stopped: showing the last sample");
        }
    }

    /// Adds a line to the event log (for the run loop's own news).
    pub fn push_log(&mut self, level: LogLevel, text: impl Into<String>) {
        self.log.push(self.run.step(), level, text);
    }

    /// One telemetry tick with the advice standing after it.
    pub fn on_update(&mut self, update: &MonitorUpdate) {
        self.telemetry.on_update(update);
        let panels = self.telemetry.gpus.len().max(1);
        if self.ui.focus_gpu >= panels {
            self.ui.focus_gpu = 0;
        }
    }

    /// SIGINT or SIGTERM arrived: the dashboard closes. Returns the command to send first
    /// (a saving stop, while the run is going).
    pub fn on_signal(&mut self, signal: &str) -> Option<Command> {
        if self.attached {
            self.exit = Some(TuiExit::Detached);
            return None;
        }
        self.exit = Some(match self.mode {
            Mode::Monitor => TuiExit::Closed,
            Mode::Training => TuiExit::Interrupted,
        });
        if self.mode == Mode::Training && self.accepts_commands() {
            self.stopping = Some(true);
            let command = Command::Interrupt {
                signal: signal.to_string(),
            };
            self.log.push(
                self.run.step(),
                LogLevel::Warn,
                format!("interrupted by a signal: sent {}", command.label()),
            );
            self.commands.sent(command.clone());
            return Some(command);
        }
        None
    }

    // ---------------------------------------------------------------- keys

    /// Handles one key event.
    pub fn on_key(&mut self, key: KeyEvent) -> Option<Action> {
        if key.kind == KeyEventKind::Release {
            return None;
        }
        self.ui.notice = None;
        if key.modifiers.contains(KeyModifiers::CONTROL)
            && matches!(key.code, KeyCode::Char('c' | 'C'))
        {
            return self.on_ctrl_c();
        }
        match self.ui.overlay {
            Overlay::Help => {
                self.ui.overlay = Overlay::None;
                None
            }
            Overlay::QuitConfirm { selected } => self.on_quit_popup_key(key, selected),
            Overlay::None => {
                if self.attached && key.code == KeyCode::Char('Q') {
                    return self.on_attached_stop_key();
                }
                let action = self.keymap.action_for(&key)?;
                self.on_action(action)
            }
        }
    }

    fn on_ctrl_c(&mut self) -> Option<Action> {
        if self.attached {
            return self.quit(TuiExit::Detached);
        }
        match self.mode {
            Mode::Monitor => self.quit(TuiExit::Closed),
            Mode::Training => match self.status() {
                RunStatus::Finished(reason) => self.quit(TuiExit::Finished { reason }),
                RunStatus::EngineGone => self.quit(TuiExit::EngineGone),
                RunStatus::Stopping { save } => self.quit(TuiExit::StopRequested { save }),
                _ => {
                    self.ui.overlay = Overlay::None;
                    self.notice(
                        LogLevel::Warn,
                        "Ctrl+C: stopping with a checkpoint (Ctrl+C again leaves now)",
                    );
                    self.stopping = Some(true);
                    self.send(Command::Interrupt {
                        signal: "Ctrl+C".into(),
                    })
                }
            },
        }
    }

    fn quit(&mut self, exit: TuiExit) -> Option<Action> {
        self.exit = Some(exit);
        Some(Action::Quit)
    }

    fn notice(&mut self, level: LogLevel, text: impl Into<String>) {
        self.ui.notice = Some(Notice {
            level,
            text: text.into(),
        });
    }

    /// The quit popup: Enter (or the quit key again) takes the highlighted answer, which is
    /// "save, then quit" unless chosen otherwise; `s` saves too; Esc, `n`, `c` cancel. Quitting
    /// without saving has its own key ([`Keymap::discard_key`]) that no binding uses.
    fn on_quit_popup_key(&mut self, key: KeyEvent, selected: QuitChoice) -> Option<Action> {
        let discard = self.keymap.discard_key();
        let choice = match key.code {
            KeyCode::Char(c) if Some(c) == discard => QuitChoice::Quit,
            KeyCode::Enter => selected,
            _ if self.keymap.action_for(&key) == Some(KeyAction::Quit) => selected,
            KeyCode::Char('s' | 'S') => QuitChoice::SaveAndQuit,
            KeyCode::Char('c' | 'C' | 'n' | 'N') | KeyCode::Esc => QuitChoice::Cancel,
            KeyCode::Left | KeyCode::Up | KeyCode::BackTab => {
                self.ui.overlay = Overlay::QuitConfirm {
                    selected: selected.step(false),
                };
                return None;
            }
            KeyCode::Right | KeyCode::Down | KeyCode::Tab => {
                self.ui.overlay = Overlay::QuitConfirm {
                    selected: selected.step(true),
                };
                return None;
            }
            _ => return None,
        };
        self.ui.overlay = Overlay::None;
        match choice {
            QuitChoice::SaveAndQuit => self.stop(true),
            QuitChoice::Quit => self.stop(false),
            QuitChoice::Cancel => None,
        }
    }

    fn stop(&mut self, save: bool) -> Option<Action> {
        self.stopping = Some(save);
        self.send(Command::Stop { save })
    }

    fn send(&mut self, command: Command) -> Option<Action> {
        self.log.push(
            self.run.step(),
            LogLevel::Info,
            format!("sent: {}", command.label()),
        );
        self.commands.sent(command.clone());
        Some(Action::Send(command))
    }

    fn on_action(&mut self, action: KeyAction) -> Option<Action> {
        if self.mode == Mode::Monitor && action.training_only() {
            return None;
        }
        match action {
            KeyAction::Help => {
                self.ui.overlay = Overlay::Help;
                None
            }
            KeyAction::Focus => {
                let panels = self.telemetry.gpus.len().max(1);
                self.ui.focus_gpu = (self.ui.focus_gpu + 1) % panels;
                None
            }
            KeyAction::Smoothing => {
                let levels = super::state::SMOOTHING_LEVELS;
                self.ui.smoothing = (self.ui.smoothing + 1) % levels.len();
                let level = levels[self.ui.smoothing];
                let text = if level == 0.0 {
                    "loss smoothing off: the raw loss".to_string()
                } else {
                    format!("loss smoothing {level}: debiased EMA, the raw loss faint beneath")
                };
                self.notice(LogLevel::Info, text);
                None
            }
            KeyAction::Window => {
                self.ui.recent = !self.ui.recent;
                let text = if self.ui.recent {
                    format!(
                        "charts: the last {} steps",
                        fmt::count(self.run.recent_window())
                    )
                } else {
                    "charts: the whole run".to_string()
                };
                self.notice(LogLevel::Info, text);
                None
            }
            KeyAction::Quit => self.on_quit_key(),
            KeyAction::BatchUp
            | KeyAction::BatchDown
            | KeyAction::SetpointUp
            | KeyAction::SetpointDown
            | KeyAction::Checkpoint
            | KeyAction::Pause => {
                if let Some(source) = &self.source {
                    let text = format!("{source}: nothing to steer (q leaves)");
                    self.notice(LogLevel::Info, text);
                    return None;
                }
                if !self.accepts_commands() {
                    let why = match self.status() {
                        RunStatus::Finished(_) => "the run has finished",
                        RunStatus::EngineGone => "the engine is gone",
                        _ => "the run is stopping",
                    };
                    self.notice(LogLevel::Warn, format!("{why}: press q to leave"));
                    return None;
                }
                self.on_command_key(action)
            }
        }
    }

    /// `Q` in an attached dashboard: stopping the run needs `--allow-stop` and a confirmation.
    fn on_attached_stop_key(&mut self) -> Option<Action> {
        if !self.allow_stop {
            self.notice(
                LogLevel::Warn,
                "stopping the run needs `cockpit attach --allow-stop`; q detaches, the run goes on",
            );
            return None;
        }
        match self.status() {
            RunStatus::Waiting | RunStatus::Running | RunStatus::Paused => {
                self.ui.overlay = Overlay::QuitConfirm {
                    selected: QuitChoice::Cancel,
                };
                None
            }
            _ => None,
        }
    }

    fn on_quit_key(&mut self) -> Option<Action> {
        if self.mode == Mode::Monitor {
            return self.quit(TuiExit::Closed);
        }
        if self.attached {
            return self.quit(TuiExit::Detached);
        }
        match self.status() {
            RunStatus::Finished(reason) => self.quit(TuiExit::Finished { reason }),
            RunStatus::EngineGone => self.quit(TuiExit::EngineGone),
            RunStatus::Stopping { save } => self.quit(TuiExit::StopRequested { save }),
            RunStatus::Waiting | RunStatus::Running | RunStatus::Paused => {
                self.ui.overlay = Overlay::QuitConfirm {
                    selected: QuitChoice::SaveAndQuit,
                };
                None
            }
        }
    }

    fn on_command_key(&mut self, action: KeyAction) -> Option<Action> {
        match action {
            KeyAction::BatchUp | KeyAction::BatchDown => {
                self.change_batch(action == KeyAction::BatchUp)
            }
            KeyAction::SetpointUp | KeyAction::SetpointDown => {
                self.change_setpoint(action == KeyAction::SetpointUp)
            }
            KeyAction::Checkpoint => {
                if self.commands.pending(CommandKind::Checkpoint).is_some() {
                    self.notice(LogLevel::Info, "a checkpoint is already on its way");
                    return None;
                }
                self.send(Command::CheckpointNow)
            }
            KeyAction::Pause => {
                if self.commands.pending(CommandKind::PauseResume).is_some() {
                    self.notice(LogLevel::Info, "pause/resume already pending");
                    return None;
                }
                let command = if self.run.paused {
                    Command::Resume
                } else {
                    Command::Pause
                };
                self.send(command)
            }
            _ => None,
        }
    }

    fn change_batch(&mut self, up: bool) -> Option<Action> {
        let Some(current) = self.run.micro_batch else {
            self.notice(LogLevel::Info, "the micro-batch size is not known yet");
            return None;
        };
        if self.commands.pending(CommandKind::BatchSize).is_some() {
            self.notice(LogLevel::Info, "a batch-size change is already pending");
            return None;
        }
        let target = if up {
            current.saturating_mul(2)
        } else {
            (current / 2).max(1)
        };
        if target == current {
            self.notice(LogLevel::Info, "the micro-batch is already 1");
            return None;
        }
        self.send(Command::SetBatchSize {
            micro_batch: target,
        })
    }

    fn change_setpoint(&mut self, up: bool) -> Option<Action> {
        let Some(info) = &self.run.info else {
            self.notice(LogLevel::Info, "the SCU setpoint is not known yet");
            return None;
        };
        if !info.scu_enabled {
            self.notice(LogLevel::Info, "SCU is off in this run");
            return None;
        }
        // successive presses build on the pending value
        let base = match self.commands.pending(CommandKind::Setpoint) {
            Some(Command::SetScuSetpoint { target }) => *target,
            _ => self.run.setpoint.unwrap_or(info.scu_target),
        };
        let delta = if up {
            self.setpoint_step
        } else {
            -self.setpoint_step
        };
        // round away float noise from repeated steps (1e-9 = 1e-7 percentage points)
        let target = ((base + delta) * 1e9).round() / 1e9;
        let target = target.max(MIN_SETPOINT);
        if (target - base).abs() < 1e-12 {
            self.notice(
                LogLevel::Info,
                format!(
                    "the setpoint is at its minimum ({:.2}%)",
                    MIN_SETPOINT * 100.0
                ),
            );
            return None;
        }
        self.send(Command::SetScuSetpoint { target })
    }
}
