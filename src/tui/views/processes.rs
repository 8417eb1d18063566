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

/// Columns of the fixed-width columns (GPU, PID, USER, TYPE, SM, GPU MEM, CPU, RSS).
const FIXED_WIDTH: usize = 3 + 8 + 10 + 8 + 5 + 10 + 6 + 10;

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
        let header = Row::new([
            "GPU", "PID", "NAME", "USER", "TYPE", "SM", "GPU MEM", "CPU", "RSS",
        ])
        .style(
            Style::new()
                .fg(t.colors().accent)
                .add_modifier(Modifier::BOLD),
        );
        // the name column takes what the fixed ones leave (borders, gaps); a long name
        // or user is cut with "…", never silently
        let name_width = usize::from(area.width).saturating_sub(2 + FIXED_WIDTH + 8);
        let rows = self.rows.iter().map(|r| {
            let p = &r.process;
            let user = p.user.clone().unwrap_or_else(|| "?".into());
            Row::new([
                Cell::from(r.gpu.to_string()),
                Cell::from(p.pid.to_string()),
                Cell::from(super::elide(&p.name, name_width)),
                Cell::from(super::elide(&user, 10)),
                Cell::from(p.kind.clone()),
                Cell::from(p.sm_pct.map_or("-".into(), |s| format!("{s}%"))),
                Cell::from(p.gpu_memory_bytes.map_or("n/a".into(), fmt::bytes)),
                Cell::from(
                    r.host
                        .as_ref()
                        .and_then(|h| h.cpu_pct)
                        .map_or("-".into(), |c| format!("{c:.0}%")),
                ),
                Cell::from(
                    r.host
                        .as_ref()
                        .and_then(|h| h.rss_bytes)
                        .map_or("-".into(), fmt::bytes),
                ),
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
                Constraint::Length(5),
                Constraint::Length(10),
                Constraint::Length(6),
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
