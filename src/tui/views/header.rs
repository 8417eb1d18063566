//! The training header: run identity, status badge, throughput, ETA and progress.

use super::flow;
use crate::engine::events::{Command, FinishReason};
use crate::tui::app::{RunStatus, Viewer};
use crate::tui::fmt;
use crate::tui::state::{CommandKind, CommandState, RunState};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::symbols;
use ratatui::text::{Line, Span};
use ratatui::widgets::{LineGauge, Paragraph, Widget};

/// Lines of metrics at most.
const MAX_METRIC_LINES: usize = 2;

/// The header of the training view.
pub struct HeaderView<'a> {
    /// The run to describe.
    pub run: &'a RunState,
    /// Pending commands, shown next to the values they change.
    pub commands: &'a CommandState,
    /// Where the run stands (the badge).
    pub status: RunStatus,
    /// How long the run has been paused, while it is.
    pub paused_for: Option<f64>,
    /// Who is looking: an attached viewer says so.
    pub viewer: Viewer,
    /// Where the events come from when not live (a replay).
    pub source: Option<&'a str>,
    /// Colours.
    pub theme: &'a Theme,
}

impl HeaderView<'_> {
    /// Rows the header needs at this width.
    pub fn height(&self, width: u16) -> u16 {
        let lines = self.metric_lines(width).len().max(1) as u16;
        lines + 2
    }

    fn badge(&self) -> Span<'static> {
        let c = self.theme.colors();
        let (text, color) = match &self.status {
            RunStatus::Waiting => (" WAITING ".to_string(), c.muted),
            RunStatus::Running => (" ● RUNNING ".to_string(), c.gauge_ok),
            RunStatus::Paused => (" ‖ PAUSED ".to_string(), c.gauge_warn),
            RunStatus::Stopping { save: true } => (" STOPPING · saving ".to_string(), c.gauge_warn),
            RunStatus::Stopping { save: false } => (" STOPPING ".to_string(), c.gauge_warn),
            RunStatus::Finished(FinishReason::Completed) => {
                (" ✓ FINISHED ".to_string(), c.gauge_ok)
            }
            RunStatus::Finished(FinishReason::Failed) => {
                (" ✗ FAILED ".to_string(), c.gauge_critical)
            }
            RunStatus::Finished(reason) => (
                format!(" FINISHED · {} ", fmt::finish_reason(*reason)),
                c.gauge_warn,
            ),
            RunStatus::EngineGone => (" ENGINE GONE ".to_string(), c.gauge_critical),
        };
        Span::styled(
            text,
            Style::new()
                .fg(c.background)
                .bg(color)
                .add_modifier(Modifier::BOLD),
        )
    }

    fn title_line(&self, width: u16) -> Line<'static> {
        let t = self.theme;
        let mut viewer: Vec<Span<'static>> = Vec::new();
        if let Some(source) = self.source {
            viewer.push(Span::styled(format!(" {source} "), t.level(Level::Warn)));
        } else if let Viewer::Attached { allow_stop } = self.viewer {
            let text = if allow_stop {
                " ⇄ attached · may stop the run "
            } else {
                " ⇄ attached · q detaches "
            };
            viewer.push(Span::styled(
                text,
                Style::new()
                    .fg(t.colors().background)
                    .bg(t.colors().accent)
                    .add_modifier(Modifier::BOLD),
            ));
        }
        let viewer_width: usize = viewer.iter().map(Span::width).sum();
        let room = usize::from(width).saturating_sub(viewer_width + 1);
        let full = self.title_with(false);
        let mut line = if full.width() <= room {
            full
        } else {
            let short = self.title_with(true);
            Line::from(super::elide_spans(short.spans, room))
        };
        if !viewer.is_empty() {
            line.spans.push(Span::raw(" "));
            line.spans.extend(viewer);
        }
        line
    }

    /// The title; `short` drops the device's parenthesised detail.
    fn title_with(&self, short: bool) -> Line<'static> {
        let t = self.theme;
        let mut spans = vec![Span::styled("cockpit", t.title())];
        match &self.run.info {
            Some(info) => {
                spans.push(Span::styled(" ▸ ", t.muted()));
                spans.push(Span::styled(
                    info.run_name.clone(),
                    Style::new().add_modifier(Modifier::BOLD),
                ));
                spans.push(Span::styled(" · ", t.muted()));
                let device = match info.device.split_once(" (") {
                    Some((head, _)) if short => head,
                    _ => info.device.as_str(),
                };
                spans.push(Span::raw(device.to_string()));
                spans.push(Span::styled(" · ", t.muted()));
                spans.push(Span::raw(info.dtype.clone()));
            }
            None => spans.push(Span::styled(" ▸ waiting for the engine…", t.muted())),
        }
        Line::from(spans)
    }

    fn metric_lines(&self, width: u16) -> Vec<Line<'static>> {
        let t = self.theme;
        let Some(info) = &self.run.info else {
            return vec![Line::from(Span::styled(
                "loading data and model",
                t.muted(),
            ))];
        };
        let label = |s: &str| Span::styled(format!("{s} "), t.muted());
        let pending = Style::new().fg(t.colors().gauge_warn);
        let mut segments: Vec<Vec<Span<'static>>> = Vec::new();

        let step = self.run.step().unwrap_or(info.start_step);
        segments.push(vec![
            label("step"),
            Span::raw(format!(
                "{}/{}",
                fmt::count(step),
                fmt::count(info.max_steps)
            )),
        ]);
        // While paused the rate and the ETA are the last ones measured, shown frozen (muted)
        // after how long the pause has lasted.
        let value = |text: String| match self.paused_for {
            Some(_) => Span::styled(text, t.muted()),
            None => Span::raw(text),
        };
        if let Some(paused) = self.paused_for {
            segments.push(vec![Span::styled(
                format!("paused {}", fmt::clock(paused)),
                t.level(Level::Warn).add_modifier(Modifier::BOLD),
            )]);
        }
        if let Some(s) = &self.run.last_step {
            segments.push(vec![label("epoch"), Span::raw(format!("{:.2}", s.epoch))]);
            segments.push(vec![
                value(fmt::si(s.tokens_per_sec)),
                Span::styled(" tok/s", t.muted()),
            ]);
        }
        if let Some(mfu) = self.run.mfu() {
            segments.push(vec![label("MFU"), value(format!("{:.1}%", mfu * 100.0))]);
        }
        if let Some(eta) = self.run.eta_s() {
            segments.push(vec![label("ETA"), value(fmt::duration(eta))]);
        }
        if let Some(elapsed) = self.run.elapsed_s() {
            segments.push(vec![label("elapsed"), Span::raw(fmt::duration(elapsed))]);
        }

        let micro_batch = self.run.micro_batch.unwrap_or(info.micro_batch);
        let accum = self.run.last_step.as_ref().map_or(info.accum, |s| s.accum);
        let mut batch = vec![
            label("micro-batch"),
            Span::raw(format!("{micro_batch}×{accum}")),
        ];
        if let Some(Command::SetBatchSize { micro_batch }) =
            self.commands.pending(CommandKind::BatchSize)
        {
            batch.push(Span::styled(format!(" → {micro_batch} pending"), pending));
        }
        segments.push(batch);

        if info.scu_enabled {
            let setpoint = self.run.setpoint.unwrap_or(info.scu_target);
            let mut scu = vec![label("S*"), Span::raw(fmt::pct2(setpoint))];
            if let Some(Command::SetScuSetpoint { target }) =
                self.commands.pending(CommandKind::Setpoint)
            {
                scu.push(Span::styled(
                    format!(" → {} pending", fmt::pct2(*target)),
                    pending,
                ));
            }
            segments.push(scu);
        }
        // Data parallelism: every rank's compute time this step; a straggler stands out.
        if let Some(s) = self.run.last_step.as_ref().filter(|s| s.ranks.len() > 1) {
            let mut times: Vec<f64> = s.ranks.iter().map(|r| r.compute_ms).collect();
            times.sort_by(f64::total_cmp);
            // The lower median: with two ranks, the faster one is the reference.
            let median = times[(times.len() - 1) / 2];
            let mut seg = vec![label(&format!("{} ranks", s.ranks.len()))];
            for (i, r) in s.ranks.iter().enumerate() {
                if i > 0 {
                    seg.push(Span::styled(" ", t.muted()));
                }
                let slow = median > 0.0 && r.compute_ms > 1.15 * median;
                let util = r
                    .gpu_util_pct
                    .map(|u| format!(" {u:.0}%"))
                    .unwrap_or_default();
                let text = format!("r{} {:.0}ms{util}", r.rank, r.compute_ms);
                seg.push(if slow {
                    Span::styled(text, t.level(Level::Warn))
                } else {
                    Span::raw(text)
                });
            }
            seg.push(Span::styled(" comm ", t.muted()));
            seg.push(Span::raw(format!("{:.0}ms", s.comm_ms)));
            segments.push(seg);
        }
        if self.run.dropped_steps > 0 {
            segments.push(vec![Span::styled(
                format!("{} step events dropped", fmt::count(self.run.dropped_steps)),
                t.level(Level::Warn),
            )]);
        }
        flow(
            segments,
            Span::styled(" · ", t.muted()),
            width,
            MAX_METRIC_LINES,
        )
    }
}

impl Widget for HeaderView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        if area.height == 0 {
            return;
        }
        let t = self.theme;
        let metrics = self.metric_lines(area.width);
        let [title_row, metrics_rows, progress_row] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(metrics.len().max(1) as u16),
            Constraint::Length(1),
        ])
        .areas(area);

        let badge = self.badge();
        let badge_width = (badge.width() as u16).min(title_row.width);
        let [title_area, badge_area] =
            Layout::horizontal([Constraint::Fill(1), Constraint::Length(badge_width)])
                .areas(title_row);
        Paragraph::new(self.title_line(title_area.width)).render(title_area, buf);
        Paragraph::new(Line::from(badge)).render(badge_area, buf);

        Paragraph::new(metrics).render(metrics_rows, buf);

        let ratio = match &self.status {
            RunStatus::Finished(FinishReason::Completed) => 1.0,
            _ => self.run.progress().unwrap_or(0.0),
        };
        LineGauge::default()
            .ratio(ratio)
            .filled_symbol(symbols::line::THICK_HORIZONTAL)
            .unfilled_symbol(symbols::line::HORIZONTAL)
            .label(Span::styled(format!("{:>5.1}% ", ratio * 100.0), t.muted()))
            .filled_style(Style::new().fg(t.colors().accent))
            .unfilled_style(Style::new().fg(t.colors().border))
            .style(Style::new().bg(t.colors().background).fg(t.colors().text))
            .render(progress_row, buf);
    }
}
