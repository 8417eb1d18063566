//! The GPU process table of the monitor view.

use super::panel;
use crate::tui::fmt;
use crate::tui::state::ProcessRow;
use crate::tui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Span;
use ratatui::widgets::{Cell, Paragraph, Row, Table, Widget};

/// Processes on the GPUs, largest GPU memory first.
pub struct ProcessTableView<'a> {
    /// Rows, largest GPU memory first.
    pub rows: &'a [ProcessRow],
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for ProcessTableView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let block = panel(format!(" GPU processes ({}) ", self.rows.len()), t, false);
        if self.rows.is_empty() {
            Paragraph::new(Span::styled("no processes on the GPUs", t.muted()))
                .block(block)
                .render(area, buf);
            return;
        }
        let header = Row::new(["GPU", "PID", "NAME", "USER", "TYPE", "GPU MEM"]).style(
            Style::new()
                .fg(t.colors().accent)
                .add_modifier(Modifier::BOLD),
        );
        let rows = self.rows.iter().map(|r| {
            let p = &r.process;
            Row::new([
                Cell::from(r.gpu.to_string()),
                Cell::from(p.pid.to_string()),
                Cell::from(p.name.clone()),
                Cell::from(p.user.clone().unwrap_or_else(|| "?".into())),
                Cell::from(p.kind.clone()),
                Cell::from(p.gpu_memory_bytes.map_or("n/a".into(), fmt::bytes)),
            ])
        });
        Table::new(
            rows,
            [
                Constraint::Length(3),
                Constraint::Length(8),
                Constraint::Fill(1),
                Constraint::Length(10),
                Constraint::Length(8),
                Constraint::Length(10),
            ],
        )
        .header(header)
        .column_spacing(1)
        .block(block)
        .style(t.base())
        .render(area, buf);
    }
}
