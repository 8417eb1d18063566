//! Step charts: loss (train raw and smoothed, val with its error bars, the entropy floor and
//! the best val, event marks), S-ratio with Ŝ and the setpoint, λ on a log scale, learning
//! rate and gradient norm. Drawn by [`Plot`].

use super::plot::{Mark, Plot, Trace, YScale};
use crate::tui::fmt;
use crate::tui::state::{History, MarkKind, RunState, SMOOTHING_LEVELS};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Span;
use ratatui::widgets::Widget;

/// The part of a history a chart shows.
fn visible(h: &History, x_range: Option<(f64, f64)>, recent: bool) -> &[(f64, f64)] {
    match (recent, x_range) {
        (true, Some((x0, _))) => h.since(x0),
        _ => h.full(),
    }
}

fn last_y(h: &History) -> Option<f64> {
    h.last().map(|p| p.1)
}

/// "━ name value " in a series colour, for chart titles.
fn legend(
    name: &str,
    value: Option<f64>,
    style: Style,
    format: fn(f64) -> String,
) -> Vec<Span<'static>> {
    let value = value.map_or("--".to_string(), format);
    let text = if name.is_empty() {
        format!("━ {value} ")
    } else {
        format!("━ {name} {value} ")
    };
    vec![Span::styled(text, style)]
}

fn title(text: &str, theme: &Theme) -> Vec<Span<'static>> {
    vec![Span::styled(format!(" {text} "), theme.title())]
}

/// The glyph style of a chart mark.
fn mark_style(kind: MarkKind, theme: &Theme) -> Style {
    let style = match kind {
        MarkKind::Restore => theme.level(Level::Critical),
        MarkKind::Pause => theme.level(Level::Warn),
        MarkKind::Checkpoint => theme.level(Level::Ok),
        MarkKind::Batch | MarkKind::Setpoint => theme.accent(),
    };
    style.add_modifier(Modifier::BOLD)
}

/// The run's events as chart marks.
fn marks(run: &RunState, theme: &Theme) -> Vec<Mark> {
    run.marks
        .iter()
        .map(|&(step, kind)| Mark {
            x: step as f64,
            glyph: kind.glyph(),
            style: mark_style(kind, theme),
        })
        .collect()
}

/// "last 120 steps" or "full run".
fn window_label(run: &RunState, recent: bool) -> String {
    if recent {
        format!("last {} steps", fmt::count(run.recent_window()))
    } else {
        "full run".to_string()
    }
}

/// Train loss (raw and smoothed), validation loss with its error bars, and reference lines.
pub struct LossChartView<'a> {
    /// The run to draw.
    pub run: &'a RunState,
    /// Smoothing level: an index into [`SMOOTHING_LEVELS`] (0: raw).
    pub smoothing: usize,
    /// Show the recent window instead of the whole run.
    pub recent: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for LossChartView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let c = t.colors();
        let run = self.run;
        let s = &run.series;
        let x_range = run.x_range(self.recent);
        let train = Style::new().fg(c.train_loss);
        let val = Style::new().fg(c.val_loss).add_modifier(Modifier::BOLD);
        let level = self.smoothing.min(SMOOTHING_LEVELS.len() - 1);
        let beta = SMOOTHING_LEVELS[level];
        let smoothed = run.train_loss_at(level);

        let mut title_parts = vec![title("loss", t)];
        let mut traces = Vec::new();
        // reference lines first: everything else is drawn over them
        if let Some(floor) = run.info.as_ref().and_then(|i| i.entropy_floor_bpt) {
            traces.push(Trace::Level {
                y: floor * std::f64::consts::LN_2,
                style: t.muted(),
            });
        }
        let best_val = s
            .val_loss
            .full()
            .iter()
            .map(|p| p.1)
            .fold(f64::INFINITY, f64::min);
        if s.val_loss.full().len() >= 2 && best_val.is_finite() {
            traces.push(Trace::Level {
                y: best_val,
                style: Style::new().fg(c.val_loss),
            });
        }
        if level == 0 {
            title_parts.push(legend("train", last_y(&s.train_loss), train, fmt::value));
        } else {
            let mut part = legend("train", last_y(smoothed), train, fmt::value);
            part.push(Span::styled(
                format!(
                    "(raw {}) ",
                    last_y(&s.train_loss).map_or("--".into(), fmt::value)
                ),
                t.muted(),
            ));
            title_parts.push(part);
            traces.push(Trace::Line {
                points: visible(&s.train_loss, x_range, self.recent),
                style: t.muted(),
                dashed: false,
            });
        }
        traces.push(Trace::Line {
            points: visible(smoothed, x_range, self.recent),
            style: train,
            dashed: false,
        });
        title_parts.push(
            match run.last_eval.as_ref().filter(|e| e.val_loss_se.is_finite()) {
                Some(e) => vec![Span::styled(
                    format!(
                        "● val {} ±{} ",
                        fmt::value(e.val_loss),
                        fmt::value(e.val_loss_se)
                    ),
                    val,
                )],
                None => vec![Span::styled(
                    format!(
                        "● val {} ",
                        last_y(&s.val_loss).map_or("--".into(), fmt::value)
                    ),
                    val,
                )],
            },
        );
        traces.push(Trace::Bars {
            lo: visible(&s.val_lo, x_range, self.recent),
            hi: visible(&s.val_hi, x_range, self.recent),
            style: Style::new().fg(c.val_loss),
        });
        traces.push(Trace::Points {
            points: visible(&s.val_loss, x_range, self.recent),
            style: val,
            glyph: '●',
        });
        // the window first (`w` must show), then the smoothing (`s`)
        if self.recent {
            title_parts.push(vec![Span::styled(
                format!("· {} ", window_label(run, true)),
                t.muted(),
            )]);
        }
        let smoothing = if level == 0 {
            "raw".to_string()
        } else {
            format!("ema {beta}")
        };
        title_parts.push(vec![Span::styled(format!("· {smoothing} "), t.muted())]);
        Plot {
            marks: marks(run, t),
            ..Plot::over_steps(
                title_parts,
                traces,
                x_range,
                "waiting for the first step…",
                t,
            )
        }
        .render(area, buf);
    }
}

fn percent_label(v: f64) -> String {
    format!("{v:.2}%")
}

/// S-ratio (raw, and the smoothed Ŝ the controller acts on) with the setpoint line, and λ
/// on a log scale beside it.
pub struct ScuChartView<'a> {
    /// The run to draw.
    pub run: &'a RunState,
    /// Show the recent window instead of the whole run.
    pub recent: bool,
    /// Colours.
    pub theme: &'a Theme,
}

/// An empty chart with a title and a message.
fn empty_chart(name: &str, text: &str, theme: &Theme, area: Rect, buf: &mut Buffer) {
    Plot::over_steps(vec![title(name, theme)], Vec::new(), None, text, theme).render(area, buf);
}

impl Widget for ScuChartView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let c = t.colors();
        let run = self.run;
        let s = &run.series;
        let enabled = run.info.as_ref().is_some_and(|i| i.scu_enabled);
        if !enabled {
            let text = if run.info.is_some() {
                "SCU is off in this run"
            } else {
                "waiting for the run…"
            };
            empty_chart("SCU", text, t, area, buf);
            return;
        }
        let x_range = run.x_range(self.recent);
        let [s_area, lambda_area] =
            Layout::horizontal([Constraint::Fill(3), Constraint::Fill(2)]).areas(area);

        let s_style = Style::new().fg(c.s_ratio);
        let setpoint_style = Style::new().fg(c.setpoint);
        let mut title_parts = vec![
            title("S", t),
            legend("Ŝ", last_y(&s.s_hat), s_style, percent_label),
            legend(
                "S*",
                run.setpoint.map(|v| v * 100.0),
                setpoint_style,
                percent_label,
            ),
            vec![Span::styled(
                format!(
                    "(raw {}) ",
                    last_y(&s.s_ratio).map_or("--".into(), percent_label)
                ),
                t.muted(),
            )],
        ];
        if let Some(scu) = &run.last_scu {
            if !scu.control {
                title_parts.push(vec![Span::styled("· control off ", t.muted())]);
            } else if run.converged {
                title_parts.push(vec![Span::styled("· converged ", t.level(Level::Ok))]);
            }
        }
        // raw S faint, then Ŝ, then the setpoint on top: where they cross, the cells hold
        // the dots of both
        let traces = vec![
            Trace::Line {
                points: visible(&s.s_ratio, x_range, self.recent),
                style: t.muted(),
                dashed: false,
            },
            Trace::Line {
                points: visible(&s.s_hat, x_range, self.recent),
                style: s_style,
                dashed: false,
            },
            Trace::Line {
                points: visible(&s.setpoint, x_range, self.recent),
                style: setpoint_style,
                dashed: true,
            },
        ];
        Plot {
            y_label: fmt::tick_pct,
            ..Plot::over_steps(title_parts, traces, x_range, "waiting for SCU…", t)
        }
        .render(s_area, buf);

        let lambda_style = Style::new().fg(c.lambda);
        let lambda_title = vec![
            title("λ", t),
            legend(
                "",
                last_y(&s.lambda_log10).map(|e| 10f64.powf(e)),
                lambda_style,
                fmt::value,
            ),
            vec![Span::styled("(log) ", t.muted())],
        ];
        let traces = vec![Trace::Line {
            points: visible(&s.lambda_log10, x_range, self.recent),
            style: lambda_style,
            dashed: false,
        }];
        Plot {
            y_scale: YScale::Log10,
            y_label: |e, _| fmt::power_of_ten_short(e),
            ..Plot::over_steps(lambda_title, traces, x_range, "waiting for λ…", t)
        }
        .render(lambda_area, buf);
    }
}

/// Learning rate and gradient norm side by side.
pub struct OptimChartsView<'a> {
    /// The run to draw.
    pub run: &'a RunState,
    /// Show the recent window instead of the whole run.
    pub recent: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for OptimChartsView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let c = t.colors();
        let s = &self.run.series;
        let x_range = self.run.x_range(self.recent);
        let [lr_area, gn_area] =
            Layout::horizontal([Constraint::Fill(1), Constraint::Fill(1)]).areas(area);
        for (name, history, color, rect) in [
            ("lr", &s.lr, c.lr, lr_area),
            ("grad-norm", &s.grad_norm, c.grad_norm, gn_area),
        ] {
            let style = Style::new().fg(color);
            let traces = vec![Trace::Line {
                points: visible(history, x_range, self.recent),
                style,
                dashed: false,
            }];
            let name_and_value = vec![
                title(name, t),
                legend("", last_y(history), style, fmt::value),
            ];
            Plot::over_steps(name_and_value, traces, x_range, "waiting…", t).render(rect, buf);
        }
    }
}
