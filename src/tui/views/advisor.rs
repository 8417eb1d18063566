//! The advisor panel: recommendations by severity, with evidence and what to do.

use super::panel;
use crate::advisor::{Recommendation, Severity};
use crate::tui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget, Wrap};

/// The advice standing after the latest telemetry tick.
pub struct AdvisorView<'a> {
    /// Most severe first.
    pub advice: &'a [Recommendation],
    /// Whether any telemetry has arrived yet.
    pub has_telemetry: bool,
    /// Colours.
    pub theme: &'a Theme,
}

fn badge(severity: Severity) -> &'static str {
    match severity {
        Severity::Info => "INFO",
        Severity::Warn => "WARN",
        Severity::Critical => "CRIT",
    }
}

impl AdvisorView<'_> {
    fn lines(&self) -> Vec<Line<'static>> {
        let t = self.theme;
        if !self.has_telemetry {
            return vec![Line::from(Span::styled(
                "waiting for telemetry…",
                t.muted(),
            ))];
        }
        if self.advice.is_empty() {
            return vec![Line::from(Span::styled("no recommendations", t.muted()))];
        }
        let mut lines = Vec::new();
        for rec in self.advice {
            let sev = t.severity(rec.severity);
            let mut head = vec![
                Span::styled(badge(rec.severity), sev.add_modifier(Modifier::BOLD)),
                Span::raw(" "),
                Span::styled(rec.message.clone(), sev),
            ];
            if let Some(gpu) = rec.gpu {
                head.push(Span::styled(format!(" (GPU{gpu})"), t.muted()));
            }
            lines.push(Line::from(head));
            if !rec.evidence.is_empty() {
                let evidence = rec
                    .evidence
                    .iter()
                    .map(|(name, value)| format!("{name} {value}"))
                    .collect::<Vec<_>>()
                    .join(" · ");
                lines.push(Line::from(Span::styled(format!("  {evidence}"), t.muted())));
            }
            if !rec.action.is_empty() || rec.key.is_some() {
                let mut action = vec![Span::raw(format!("  → {}", rec.action))];
                if let Some(key) = &rec.key {
                    action.push(Span::styled(
                        format!(" [{key}]"),
                        Style::new()
                            .fg(t.colors().accent)
                            .add_modifier(Modifier::BOLD),
                    ));
                }
                lines.push(Line::from(action));
            }
        }
        lines
    }
}

impl Widget for AdvisorView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let title = if self.advice.is_empty() {
            " advisor ".to_string()
        } else {
            format!(" advisor ({}) ", self.advice.len())
        };
        let block = panel(title, self.theme, false);
        Paragraph::new(self.lines())
            .wrap(Wrap { trim: false })
            .block(block)
            .render(area, buf);
    }
}
