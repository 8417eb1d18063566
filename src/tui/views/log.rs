//! The event log panel: newest entries at the bottom.

use super::panel;
use crate::tui::state::{EventLog, LogLevel};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Widget};

/// The latest log entries that fit.
pub struct LogView<'a> {
    /// The entries.
    pub log: &'a EventLog,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for LogView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let block = panel(" events ", t, false);
        let rows = usize::from(block.inner(area).height);
        let width = usize::from(block.inner(area).width);
        let entries: Vec<_> = self.log.entries().rev().take(rows).collect();
        let lines: Vec<Line<'static>> = if entries.is_empty() {
            vec![Line::from(Span::styled("nothing yet", t.muted()))]
        } else {
            entries
                .into_iter()
                .rev()
                .map(|e| {
                    let (icon, style) = match e.level {
                        LogLevel::Info => ("·", t.base()),
                        LogLevel::Good => ("✓", t.level(Level::Ok)),
                        LogLevel::Warn => ("!", t.level(Level::Warn)),
                        LogLevel::Error => ("✗", t.level(Level::Critical)),
                    };
                    let step = e.step.map_or(String::new(), |s| s.to_string());
                    Line::from(super::elide_spans(
                        vec![
                            Span::styled(format!("{step:>6} "), t.muted()),
                            Span::styled(format!("{icon} "), style),
                            Span::styled(e.text.clone(), style),
                        ],
                        width,
                    ))
                })
                .collect()
        };
        Paragraph::new(lines).block(block).render(area, buf);
    }
}
