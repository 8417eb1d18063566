//! The footer: the latest command outcome or notice on the left, keys on the right.

use crate::tui::app::{Mode, Notice, RunStatus, Viewer};
use crate::tui::fmt;
use crate::tui::keymap::{KeyAction, Keymap};
use crate::tui::state::{CommandState, CommandStatus, LogLevel};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Modifier;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget};

/// The footer line.
pub struct FooterView<'a> {
    /// Training or monitor (which keys to list).
    pub mode: Mode,
    /// Where the run stands.
    pub status: RunStatus,
    /// A message that takes the status slot.
    pub notice: Option<&'a Notice>,
    /// Commands sent and their outcomes.
    pub commands: &'a CommandState,
    /// Key bindings, for the hints.
    pub keymap: &'a Keymap,
    /// The run is paused (the pause key then reads "resume").
    pub paused: bool,
    /// Who is looking: an attached viewer's `q` detaches.
    pub viewer: Viewer,
    /// GPU panels shown (the focus key only with two or more).
    pub gpu_panels: usize,
    /// Whether the run has SCU on (the setpoint keys only then).
    pub scu: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl FooterView<'_> {
    fn status_line(&self) -> Option<Line<'static>> {
        let t = self.theme;
        if let Some(notice) = self.notice {
            let style = match notice.level {
                LogLevel::Info | LogLevel::Good => t.accent(),
                LogLevel::Warn => t.level(Level::Warn),
                LogLevel::Error => t.level(Level::Critical),
            };
            return Some(Line::from(Span::styled(notice.text.clone(), style)));
        }
        match &self.status {
            RunStatus::Finished(reason) => {
                return Some(Line::from(Span::styled(
                    format!(
                        "run {} · press {} to exit",
                        fmt::finish_reason(*reason),
                        self.keymap.key(KeyAction::Quit)
                    ),
                    t.accent(),
                )))
            }
            RunStatus::EngineGone => {
                return Some(Line::from(Span::styled(
                    format!(
                        "the engine is gone · press {} to exit",
                        self.keymap.key(KeyAction::Quit)
                    ),
                    t.level(Level::Critical),
                )))
            }
            RunStatus::Stopping { save } => {
                let what = if *save {
                    "saving a checkpoint and stopping"
                } else {
                    "stopping"
                };
                return Some(Line::from(Span::styled(
                    format!(
                        "{what}… ({} again leaves now)",
                        self.keymap.key(KeyAction::Quit)
                    ),
                    t.level(Level::Warn),
                )));
            }
            _ => {}
        }
        let line = match self.commands.latest()? {
            CommandStatus::Pending { command } => Line::from(Span::styled(
                format!("⧗ {} pending", command.label()),
                t.level(Level::Warn),
            )),
            CommandStatus::Applied {
                command,
                step,
                detail,
            } => {
                let mut text = format!("✓ {} applied at step {step}", command.label());
                if !detail.is_empty() {
                    text.push_str(&format!(" ({detail})"));
                }
                Line::from(Span::styled(text, t.level(Level::Ok)))
            }
            CommandStatus::Rejected {
                command, reason, ..
            } => Line::from(Span::styled(
                format!("✗ {} rejected: {reason}", command.label()),
                t.level(Level::Critical),
            )),
            CommandStatus::NotSent { command } => Line::from(Span::styled(
                format!("✗ {} not sent: the engine is gone", command.label()),
                t.level(Level::Critical),
            )),
        };
        Some(line)
    }

    /// Key hints, most important first: only keys that do something here and now.
    fn hints(&self) -> Vec<(String, &'static str)> {
        let k = |a| self.keymap.key(a).to_string();
        let quit = match (self.mode, self.viewer) {
            (Mode::Training, Viewer::Attached { .. }) => "detach",
            _ => "quit",
        };
        let mut hints = vec![(k(KeyAction::Help), "help"), (k(KeyAction::Quit), quit)];
        if let (Mode::Training, Viewer::Attached { allow_stop: true }) = (self.mode, self.viewer) {
            hints.push(("Q".to_string(), "stop"));
        }
        let steerable = matches!(self.status, RunStatus::Running | RunStatus::Paused);
        if self.mode == Mode::Training && steerable {
            hints.push((
                k(KeyAction::Pause),
                if self.paused { "resume" } else { "pause" },
            ));
            hints.push((
                format!("{}/{}", k(KeyAction::BatchUp), k(KeyAction::BatchDown)),
                "batch",
            ));
            if self.scu {
                hints.push((
                    format!(
                        "{}/{}",
                        k(KeyAction::SetpointUp),
                        k(KeyAction::SetpointDown)
                    ),
                    "S*",
                ));
            }
            hints.push((k(KeyAction::Checkpoint), "ckpt"));
        }
        if self.mode == Mode::Training && self.status != RunStatus::Waiting {
            hints.push((k(KeyAction::Smoothing), "smooth"));
            hints.push((k(KeyAction::Window), "window"));
        }
        if self.gpu_panels > 1 {
            hints.push((k(KeyAction::Focus), "next GPU"));
        }
        hints
    }
}

/// Columns one hint takes: "key label" and two spaces.
fn hint_width(key: &str, label: &str) -> u16 {
    (super::text_width(key) + 1 + label.len() + 2) as u16
}

impl Widget for FooterView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let status = self.status_line();
        // Keys first: they get what they need up to half the line (the help and quit keys
        // always); the status takes the rest, elided with "…" when long.
        let hints = self.hints();
        let cap = (area.width / 2).max(hint_width("?", "help") + hint_width("q", "quit"));
        let mut keys: Vec<Span<'static>> = Vec::new();
        let mut used = 0u16;
        for (i, (key, label)) in hints.into_iter().enumerate() {
            let w = hint_width(&key, label);
            if used + w > cap.min(area.width) && i >= 2 {
                break;
            }
            if used + w > area.width {
                break;
            }
            keys.push(Span::styled(key, t.accent().add_modifier(Modifier::BOLD)));
            keys.push(Span::styled(format!(" {label}  "), t.muted()));
            used += w;
        }
        let [left, right] = Layout::horizontal([Constraint::Fill(1), Constraint::Length(used)])
            .spacing(1)
            .areas(area);
        if let Some(status) = status {
            let spans = super::elide_spans(status.spans, usize::from(left.width));
            Paragraph::new(Line::from(spans)).render(left, buf);
        }
        Paragraph::new(Line::from(keys)).render(right, buf);
    }
}
