//! Overlays: the quit confirmation and the key help.

use super::{centered, panel};
use crate::tui::app::{App, Mode, QuitChoice, Viewer};
use crate::tui::keymap::KeyAction;
use crate::tui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Clear, Paragraph, Widget};

/// "Stop the run?" with save-and-quit / quit / cancel.
pub struct QuitView<'a> {
    /// The highlighted answer.
    pub selected: QuitChoice,
    /// Colours.
    pub theme: &'a Theme,
    /// The key for "quit without saving" (one no binding uses), if any is free.
    pub discard: Option<char>,
}

impl Widget for QuitView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let popup = centered(area, 48, 9);
        Clear.render(popup, buf);
        let selected_style = Style::new()
            .fg(t.colors().background)
            .bg(t.colors().accent)
            .add_modifier(Modifier::BOLD);
        let mut lines = vec![
            Line::from("The run is still going. Stop it?"),
            Line::from(""),
        ];
        let discard = self.discard.map(String::from);
        for choice in QuitChoice::ALL {
            let (key, text) = match choice {
                QuitChoice::SaveAndQuit => (Some("s"), "save a checkpoint, then quit"),
                QuitChoice::Quit => (discard.as_deref(), "quit WITHOUT saving"),
                QuitChoice::Cancel => (Some("Esc"), "cancel, keep training"),
            };
            let is_selected = choice == self.selected;
            let marker = if is_selected { "▶ " } else { "  " };
            let body = match key {
                Some(k) => format!("[{k}] {text}"),
                None => format!("    {text}"),
            };
            lines.push(Line::from(vec![
                Span::styled(marker, t.accent()),
                if is_selected {
                    Span::styled(body, selected_style)
                } else {
                    Span::raw(body)
                },
            ]));
        }
        lines.push(Line::from(""));
        lines.push(Line::from(Span::styled(
            "↑/↓ choose · Enter: the highlighted one",
            t.muted(),
        )));
        Paragraph::new(lines)
            .block(panel(" quit ", t, true))
            .render(popup, buf);
    }
}

/// Every key binding with what it does.
pub struct HelpView<'a> {
    app: &'a App,
}

impl<'a> HelpView<'a> {
    /// Help for the app's mode and keymap.
    pub fn new(app: &'a App) -> HelpView<'a> {
        HelpView { app }
    }
}

impl Widget for HelpView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.app.theme();
        let training = self.app.mode() == Mode::Training;
        let key_style = t.accent().add_modifier(Modifier::BOLD);
        let entry = |key: String, text: &str| {
            Line::from(vec![
                Span::styled(format!("{key:>9}  "), key_style),
                Span::raw(text.to_string()),
            ])
        };
        let mut lines: Vec<Line<'static>> = KeyAction::ALL
            .into_iter()
            .filter(|a| training || !a.training_only())
            .map(|a| {
                let text = match (a, self.app.viewer()) {
                    (KeyAction::Quit, _) if !training => "quit",
                    (KeyAction::Quit, Viewer::Attached { .. }) => "detach: the run goes on",
                    _ => a.description(),
                };
                entry(self.app.keymap().key(a).to_string(), text)
            })
            .collect();
        if let (true, Viewer::Attached { allow_stop }) = (training, self.app.viewer()) {
            lines.push(entry(
                "Q".into(),
                if allow_stop {
                    "stop the run (asks first)"
                } else {
                    "stop the run: needs attach --allow-stop"
                },
            ));
        }
        if training {
            let attached = matches!(self.app.viewer(), Viewer::Attached { .. });
            lines.push(entry(
                "Ctrl+C".into(),
                if attached {
                    "detach: the run goes on"
                } else {
                    "stop with a checkpoint (twice: leave now)"
                },
            ));
            lines.push(Line::from(""));
            let discard = self
                .app
                .keymap()
                .discard_key()
                .map(|k| format!(" · {k} no save"))
                .unwrap_or_default();
            lines.push(Line::from(Span::styled(
                format!("quit popup: Enter/s save{discard} · Esc cancel"),
                t.muted(),
            )));
            let marks = crate::tui::state::MarkKind::ALL
                .iter()
                .map(|m| format!("{} {}", m.glyph(), m.name()))
                .collect::<Vec<_>>()
                .join(" · ");
            lines.push(Line::from(Span::styled(
                format!("chart marks: {marks}"),
                t.muted(),
            )));
        } else {
            lines.push(entry("Ctrl+C".into(), "quit"));
        }
        let height = lines.len() as u16 + 2;
        let popup = centered(area, 66, height);
        Clear.render(popup, buf);
        Paragraph::new(lines)
            .block(panel(" keys · any key closes ", t, true))
            .render(popup, buf);
    }
}
