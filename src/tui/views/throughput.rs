//! Throughput and where a step's time goes: tokens/s with its recent history, and the step
//! split into data wait, compute (forward and backward), optimizer, communication (data
//! parallel) and the rest — all from the engine's step events.

use super::{elide_spans, panel};
use crate::engine::events::StepStats;
use crate::tui::fmt;
use crate::tui::state::RunState;
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, RenderDirection, Sparkline, Widget};

/// Rows the panel wants, borders included.
pub const THROUGHPUT_HEIGHT: u16 = 5;

/// One part of a step.
pub struct StepPart {
    /// Its name.
    pub name: &'static str,
    /// Milliseconds.
    pub ms: f64,
}

/// A step's time by part, in the order shown; "other" is what the parts leave of the step.
pub fn step_parts(s: &StepStats) -> Vec<StepPart> {
    let ms = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let mut parts = vec![
        StepPart {
            name: "data",
            ms: ms(s.data_wait_ms),
        },
        StepPart {
            name: "compute",
            ms: ms(s.compute_ms),
        },
        StepPart {
            name: "optim",
            ms: ms(s.optim_ms),
        },
    ];
    if s.comm_ms > 0.0 || !s.ranks.is_empty() {
        parts.push(StepPart {
            name: "comm",
            ms: ms(s.comm_ms),
        });
    }
    let known: f64 = parts.iter().map(|p| p.ms).sum();
    let other = ms(s.step_ms) - known;
    if other > 0.05 * ms(s.step_ms) {
        parts.push(StepPart {
            name: "other",
            ms: other,
        });
    }
    parts
}

/// The throughput panel.
pub struct ThroughputView<'a> {
    /// The run.
    pub run: &'a RunState,
    /// Whether the run is paused (the figures are then the last ones, shown muted).
    pub paused: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl ThroughputView<'_> {
    fn part_style(&self, name: &str) -> Style {
        let t = self.theme;
        let c = t.colors();
        match name {
            "data" => t.level(Level::Warn),
            "compute" => Style::new().fg(c.accent),
            "optim" => Style::new().fg(c.lr),
            "comm" => Style::new().fg(c.s_ratio),
            _ => t.muted(),
        }
    }
}

impl Widget for ThroughputView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let title = if self.paused {
            " throughput · paused "
        } else {
            " throughput "
        };
        let block = panel(title, t, false);
        let inner = block.inner(area);
        block.render(area, buf);
        if inner.height == 0 || inner.width < 10 {
            return;
        }
        let Some(step) = &self.run.last_step else {
            Paragraph::new(Span::styled("waiting for the first step…", t.muted()))
                .render(inner, buf);
            return;
        };
        let width = usize::from(inner.width);
        let value_style = if self.paused { t.muted() } else { t.base() };

        // tokens/s and its history
        let rate = format!("{} tok/s ", fmt::si(step.tokens_per_sec));
        let rate_w = (rate.chars().count() as u16).min(inner.width);
        let [rate_area, spark_area] =
            Layout::horizontal([Constraint::Length(rate_w), Constraint::Fill(1)])
                .areas(Rect { height: 1, ..inner });
        Paragraph::new(Span::styled(rate, value_style)).render(rate_area, buf);
        let mut data: Vec<u64> = self
            .run
            .throughput
            .last_n(usize::from(spark_area.width))
            .collect();
        data.reverse();
        // the tallest bar at four fifths of the row: a steady rate reads as steady, not full
        let top = data.iter().copied().max().unwrap_or(0);
        Sparkline::default()
            .direction(RenderDirection::RightToLeft)
            .data(&data)
            .max(top + top / 4)
            .style(Style::new().fg(t.colors().accent))
            .render(spark_area, buf);
        if inner.height < 2 {
            return;
        }

        // the step by part: a legend line, and a bar when there is a row for it
        let parts = step_parts(step);
        let mut legend = vec![Span::styled(
            format!("{:.0} ms/step ", step.step_ms),
            value_style,
        )];
        for p in &parts {
            legend.push(Span::styled("■", self.part_style(p.name)));
            legend.push(Span::styled(
                format!("{} {:.0} ", p.name, p.ms),
                value_style,
            ));
        }
        let legend_row = Rect {
            y: inner.y + 1,
            height: 1,
            ..inner
        };
        Paragraph::new(Line::from(elide_spans(legend, width))).render(legend_row, buf);
        if inner.height < 3 {
            return;
        }
        let total: f64 = parts.iter().map(|p| p.ms).sum();
        if total <= 0.0 {
            return;
        }
        let mut spans = Vec::new();
        let mut used = 0usize;
        let mut acc = 0.0;
        for p in &parts {
            acc += p.ms;
            let end = ((acc / total) * width as f64).round() as usize;
            let n = end.saturating_sub(used);
            if n > 0 {
                spans.push(Span::styled("█".repeat(n), self.part_style(p.name)));
                used += n;
            }
        }
        Paragraph::new(Line::from(spans)).render(
            Rect {
                y: inner.y + 2,
                height: 1,
                ..inner
            },
            buf,
        );
    }
}
