//! Step charts: loss (train, EMA, val), S-ratio with its setpoint and λ on a log scale,
//! learning rate and gradient norm.

use super::panel;
use crate::tui::fmt;
use crate::tui::state::{History, RunState};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph, Widget};

/// One line on a chart.
pub struct Series<'a> {
    /// Points, oldest first.
    pub points: &'a [(f64, f64)],
    /// Line colour.
    pub style: Style,
    /// How points are drawn: braille lines by default; `Marker::Dot` draws the points alone
    /// (a scatter), for sparse series such as val loss that must stay visible.
    pub marker: Marker,
}

/// A bordered line chart over a step range, with y bounds fitted to what is visible.
pub struct SeriesChart<'a> {
    /// Panel title.
    pub title: Line<'a>,
    /// Lines, drawn in order (the last on top).
    pub series: Vec<Series<'a>>,
    /// Steps shown; `None` before any data.
    pub x_range: Option<(f64, f64)>,
    /// Formats y-axis labels.
    pub y_label: fn(f64) -> String,
    /// Shown while there is nothing to draw.
    pub empty_text: &'a str,
    /// Colours.
    pub theme: &'a Theme,
}

/// Min and max of the y values of points within `[x0, x1]`.
fn y_bounds(series: &[Series<'_>], x0: f64, x1: f64) -> Option<(f64, f64)> {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for s in series {
        for &(x, y) in s.points {
            if x >= x0 && x <= x1 {
                lo = lo.min(y);
                hi = hi.max(y);
            }
        }
    }
    (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
}

impl Widget for SeriesChart<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let block = panel(self.title, t, false);
        let bounds = self
            .x_range
            .map(|(x0, x1)| (x0, if x1 > x0 { x1 } else { x0 + 1.0 }))
            .and_then(|(x0, x1)| y_bounds(&self.series, x0, x1).map(|y| ((x0, x1), y)));
        let Some(((x0, x1), (lo, hi))) = bounds else {
            let inner = block.inner(area);
            block.render(area, buf);
            let [_, mid, _] = Layout::vertical([
                Constraint::Fill(1),
                Constraint::Length(1),
                Constraint::Fill(1),
            ])
            .areas(inner);
            Paragraph::new(Span::styled(self.empty_text, t.muted()))
                .alignment(Alignment::Center)
                .render(mid, buf);
            return;
        };
        let pad = if hi > lo {
            (hi - lo) * 0.05
        } else {
            (hi.abs() * 0.05).max(1e-9)
        };
        let (y0, y1) = (lo - pad, hi + pad);
        let datasets = self
            .series
            .iter()
            .map(|s| {
                Dataset::default()
                    .marker(s.marker)
                    .graph_type(if s.marker == Marker::Dot {
                        GraphType::Scatter
                    } else {
                        GraphType::Line
                    })
                    .style(s.style)
                    .data(s.points)
            })
            .collect();
        let y_label = self.y_label;
        // a flat series gets one label, in the middle
        let y_labels = if hi > lo {
            [y_label(lo), y_label((lo + hi) / 2.0), y_label(hi)]
        } else {
            [String::new(), y_label(lo), String::new()]
        };
        Chart::new(datasets)
            .block(block)
            .style(t.base())
            .x_axis(
                Axis::default()
                    .bounds([x0, x1])
                    .labels([fmt::step(x0), fmt::step(x1)])
                    .style(t.muted()),
            )
            .y_axis(
                Axis::default()
                    .bounds([y0, y1])
                    .labels(y_labels)
                    .style(t.muted()),
            )
            .render(area, buf);
    }
}

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

/// "━ name value" in a series colour, for chart titles.
fn legend(
    name: &str,
    value: Option<f64>,
    style: Style,
    format: fn(f64) -> String,
) -> Span<'static> {
    let value = value.map_or("--".to_string(), format);
    if name.is_empty() {
        Span::styled(format!("━ {value} "), style)
    } else {
        Span::styled(format!("━ {name} {value} "), style)
    }
}

/// Train loss (raw and EMA) and validation loss.
pub struct LossChartView<'a> {
    /// The run to draw.
    pub run: &'a RunState,
    /// Draw the EMA (raw loss muted beneath) instead of the raw loss.
    pub smoothing: bool,
    /// Show the recent window instead of the whole run.
    pub recent: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for LossChartView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let c = t.colors();
        let s = &self.run.series;
        let x_range = self.run.x_range(self.recent);
        let train = Style::new().fg(c.train_loss);
        let val = Style::new().fg(c.val_loss).add_modifier(Modifier::BOLD);
        // With smoothing on the raw series is drawn muted; its legend matches.
        let raw = if self.smoothing { t.muted() } else { train };
        let mut title = vec![
            Span::styled(" loss ", t.title()),
            legend("train", last_y(&s.train_loss), raw, fmt::value),
        ];
        let mut series = Vec::new();
        if self.smoothing {
            title.push(legend("ema", last_y(&s.train_loss_ema), train, fmt::value));
            series.push(Series {
                points: visible(&s.train_loss, x_range, self.recent),
                style: t.muted(),
                marker: Marker::Braille,
            });
            series.push(Series {
                points: visible(&s.train_loss_ema, x_range, self.recent),
                style: train,
                marker: Marker::Braille,
            });
        } else {
            series.push(Series {
                points: visible(&s.train_loss, x_range, self.recent),
                style: train,
                marker: Marker::Braille,
            });
        }
        title.push(
            match self
                .run
                .last_eval
                .as_ref()
                .filter(|e| e.val_loss_se.is_finite())
            {
                Some(e) => Span::styled(
                    format!(
                        "━ val {} ±{} ",
                        fmt::value(e.val_loss),
                        fmt::value(e.val_loss_se)
                    ),
                    val,
                ),
                None => legend("val", last_y(&s.val_loss), val, fmt::value),
            },
        );
        // The standard-error band: muted dots above and below each eval.
        for band in [&s.val_lo, &s.val_hi] {
            series.push(Series {
                points: visible(band, x_range, self.recent),
                style: t.muted(),
                marker: Marker::Dot,
            });
        }
        series.push(Series {
            points: visible(&s.val_loss, x_range, self.recent),
            style: val,
            marker: Marker::Dot,
        });
        let window = if self.recent {
            format!("last {} steps", fmt::count(self.run.recent_window() as u64))
        } else {
            "full run".to_string()
        };
        title.push(Span::styled(
            format!(
                "· {} · {window} ",
                if self.smoothing { "EMA" } else { "raw" }
            ),
            t.muted(),
        ));
        SeriesChart {
            title: Line::from(title),
            series,
            x_range,
            y_label: fmt::value,
            empty_text: "waiting for the first step…",
            theme: t,
        }
        .render(area, buf);
    }
}

fn percent_label(v: f64) -> String {
    format!("{v:.2}%")
}

/// S-ratio with the setpoint line, and λ on a log scale beside it.
pub struct ScuChartView<'a> {
    /// The run to draw.
    pub run: &'a RunState,
    /// Show the recent window instead of the whole run.
    pub recent: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for ScuChartView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let c = t.colors();
        let s = &self.run.series;
        let enabled = self.run.info.as_ref().is_some_and(|i| i.scu_enabled);
        if !enabled {
            SeriesChart {
                title: Line::from(Span::styled(" SCU ", t.title())),
                series: Vec::new(),
                x_range: None,
                y_label: percent_label,
                empty_text: if self.run.info.is_some() {
                    "SCU is off in this run"
                } else {
                    "waiting for the run…"
                },
                theme: t,
            }
            .render(area, buf);
            return;
        }
        let x_range = self.run.x_range(self.recent);
        let [s_area, lambda_area] =
            Layout::horizontal([Constraint::Fill(3), Constraint::Fill(2)]).areas(area);

        let s_style = Style::new().fg(c.s_ratio);
        let setpoint_style = Style::new().fg(c.setpoint);
        let mut title = vec![
            Span::styled(" S-ratio ", t.title()),
            legend("", last_y(&s.s_ratio), s_style, percent_label),
            legend(
                "S*",
                self.run.setpoint.map(|v| v * 100.0),
                setpoint_style,
                percent_label,
            ),
        ];
        if let Some(scu) = &self.run.last_scu {
            if !scu.control {
                title.push(Span::styled("· control off ", t.muted()));
            } else if self.run.converged {
                title.push(Span::styled("· converged ", t.level(Level::Ok)));
            }
        }
        SeriesChart {
            title: Line::from(title),
            series: vec![
                Series {
                    points: visible(&s.setpoint, x_range, self.recent),
                    style: setpoint_style,
                    marker: Marker::Braille,
                },
                Series {
                    points: visible(&s.s_ratio, x_range, self.recent),
                    style: s_style,
                    marker: Marker::Braille,
                },
            ],
            x_range,
            y_label: percent_label,
            empty_text: "waiting for SCU…",
            theme: t,
        }
        .render(s_area, buf);

        let lambda_style = Style::new().fg(c.lambda);
        SeriesChart {
            title: Line::from(vec![
                Span::styled(" λ ", t.title()),
                legend(
                    "",
                    last_y(&s.lambda_log10).map(|e| 10f64.powf(e)),
                    lambda_style,
                    fmt::value,
                ),
                Span::styled("(log) ", t.muted()),
            ]),
            series: vec![Series {
                points: visible(&s.lambda_log10, x_range, self.recent),
                style: lambda_style,
                marker: Marker::Braille,
            }],
            x_range,
            y_label: fmt::power_of_ten_short,
            empty_text: "waiting for λ…",
            theme: t,
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
        let lr_style = Style::new().fg(c.lr);
        SeriesChart {
            title: Line::from(vec![
                Span::styled(" lr ", t.title()),
                legend("", last_y(&s.lr), lr_style, fmt::value),
            ]),
            series: vec![Series {
                points: visible(&s.lr, x_range, self.recent),
                style: lr_style,
                marker: Marker::Braille,
            }],
            x_range,
            y_label: fmt::value,
            empty_text: "waiting…",
            theme: t,
        }
        .render(lr_area, buf);
        let gn_style = Style::new().fg(c.grad_norm);
        SeriesChart {
            title: Line::from(vec![
                Span::styled(" grad-norm ", t.title()),
                legend("", last_y(&s.grad_norm), gn_style, fmt::value),
            ]),
            series: vec![Series {
                points: visible(&s.grad_norm, x_range, self.recent),
                style: gn_style,
                marker: Marker::Braille,
            }],
            x_range,
            y_label: fmt::value,
            empty_text: "waiting…",
            theme: t,
        }
        .render(gn_area, buf);
    }
}
