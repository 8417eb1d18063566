//! `cockpit compare` on a terminal: the table (one row per arm, the same cells as
//! compare.md) over an overlaid chart of val bits/token, S or λ, one line per arm in its own
//! colour; the selected arm's row is marked and its line drawn on top, the others dimmed.

use super::plot::{Plot, Trace, YScale};
use super::{elide, fit, panel, text_width, TooSmallView};
use crate::tui::fmt;
use crate::tui::state::{CompareArm, CompareChart, CompareState};
use crate::tui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Widget};

/// Smallest terminal the comparison view draws in (columns, rows).
pub const COMPARE_MIN_SIZE: (u16, u16) = (60, 16);

/// The table's headers on a terminal (shorter than compare.md's, in the same order as
/// [`crate::report::compare::TABLE_HEADERS`]).
const HEADERS: [&str; 7] = [
    "run",
    "seeds",
    "final val bpt",
    "best val bpt",
    "λ at end",
    "S at end %",
    "tokens/s",
];
/// Columns left out, in this order, while the table is too wide (never the run and final).
const DROP_ORDER: [usize; 5] = [6, 3, 1, 4, 5];
/// The run column gets at least this many columns before others are dropped.
const MIN_LABEL: usize = 16;
/// Key hints in the footer.
const KEYS: &str = "↑↓ select · tab/1-3 chart · q quit";

/// The colour of arm `i`: the theme's series colours in turn.
pub fn arm_color(theme: &Theme, i: usize) -> Color {
    let c = theme.colors();
    let colors = [
        c.val_loss,
        c.s_ratio,
        c.lambda,
        c.train_loss,
        c.grad_norm,
        c.setpoint,
        c.lr,
        c.severity_critical,
    ];
    colors[i % colors.len()]
}

/// The whole comparison screen.
pub struct CompareView<'a> {
    /// What to show.
    pub state: &'a CompareState,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for CompareView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        Block::new().style(t.base()).render(area, buf);
        let (min_w, min_h) = COMPARE_MIN_SIZE;
        if area.width < min_w || area.height < min_h {
            TooSmallView {
                need: (min_w, min_h),
                have: (area.width, area.height),
                theme: t,
            }
            .render(area, buf);
            return;
        }
        let s = self.state;
        // the table takes what its rows need, up to two fifths of the screen
        let body = area.height - 2;
        let table_h = (s.arms.len() as u16 + 3).clamp(4, (body * 2 / 5).max(4));
        let [header, table, chart, footer] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(table_h),
            Constraint::Fill(1),
            Constraint::Length(1),
        ])
        .areas(area);
        self.header(header, buf);
        TableView { state: s, theme: t }.render(table, buf);
        ChartView { state: s, theme: t }.render(chart, buf);
        self.footer(footer, buf);
    }
}

impl CompareView<'_> {
    fn header(&self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let s = self.state;
        let runs: usize = s.arms.iter().map(|a| a.runs.len()).sum();
        let right = s
            .out_dir
            .as_ref()
            .map(|d| format!(" files in {d}"))
            .unwrap_or_default();
        let right_w = text_width(&right).min(usize::from(area.width) / 2);
        let left_w = usize::from(area.width) - right_w;
        let left = fit(
            vec![
                vec![
                    Span::styled("cockpit ▸ compare", t.title()),
                    Span::styled(
                        format!(" · {} arm(s) · {runs} run(s)", s.arms.len()),
                        t.base(),
                    ),
                ],
                vec![Span::styled(format!(" · {}", s.source), t.muted())],
            ],
            left_w,
            8,
        );
        let [l, r] = Layout::horizontal([Constraint::Fill(1), Constraint::Length(right_w as u16)])
            .areas(area);
        Paragraph::new(left).render(l, buf);
        Paragraph::new(Span::styled(elide(&right, right_w), t.muted()))
            .right_aligned()
            .render(r, buf);
    }

    fn footer(&self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let keys_w = text_width(KEYS).min(usize::from(area.width));
        let [l, r] = Layout::horizontal([Constraint::Fill(1), Constraint::Length(keys_w as u16)])
            .areas(area);
        if let Some(arm) = self.state.arms.get(self.state.selected()) {
            let text = format!("runs: {}", arm.runs.join(", "));
            let w = usize::from(l.width.saturating_sub(1));
            Paragraph::new(Span::styled(elide(&text, w), t.muted())).render(l, buf);
        }
        Paragraph::new(Span::styled(elide(KEYS, keys_w), t.muted()))
            .right_aligned()
            .render(r, buf);
    }
}

/// The table: a marker on the selected row, each arm's colour swatch, the cells.
struct TableView<'a> {
    state: &'a CompareState,
    theme: &'a Theme,
}

impl TableView<'_> {
    /// The columns shown and their widths for `width` columns of room (the run column
    /// takes what is left).
    fn columns(&self, width: usize) -> (Vec<usize>, Vec<usize>) {
        let mut widths: Vec<usize> = HEADERS.iter().map(|h| text_width(h)).collect();
        for arm in &self.state.arms {
            for (w, c) in widths.iter_mut().zip(&arm.cells) {
                *w = (*w).max(text_width(c));
            }
        }
        // "▶ ━ " before the run column, one space between columns
        let mut shown: Vec<usize> = (0..HEADERS.len()).collect();
        let need = |shown: &[usize], label: usize| {
            4 + label + shown[1..].iter().map(|&i| widths[i] + 2).sum::<usize>()
        };
        for drop in DROP_ORDER {
            if need(&shown, MIN_LABEL.min(widths[0])) <= width {
                break;
            }
            shown.retain(|&i| i != drop);
        }
        let others = need(&shown, 0);
        widths[0] = width.saturating_sub(others).min(widths[0].max(MIN_LABEL));
        (shown, widths)
    }

    fn row(
        &self,
        cells: [&str; 7],
        shown: &[usize],
        widths: &[usize],
        lead: Vec<Span<'static>>,
        style: Style,
    ) -> Line<'static> {
        let mut spans = lead;
        for &i in shown {
            let text = elide(cells[i], widths[i]);
            let pad = " ".repeat(widths[i].saturating_sub(text_width(&text)));
            let cell = if i == 0 {
                format!("{text}{pad}")
            } else {
                // numbers right-aligned
                format!("  {pad}{text}")
            };
            spans.push(Span::styled(cell, style));
        }
        Line::from(spans)
    }
}

impl Widget for TableView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let s = self.state;
        let visible = usize::from(area.height.saturating_sub(3)).max(1);
        let first = (s.selected() + 1).saturating_sub(visible);
        let mut title = vec![Span::styled(" runs ", t.title())];
        if s.arms.len() > visible {
            title.push(Span::styled(
                format!(
                    "· {}–{} of {} ",
                    first + 1,
                    (first + visible).min(s.arms.len()),
                    s.arms.len()
                ),
                t.muted(),
            ));
        }
        let block = panel(Line::from(title), t, false);
        let inner = block.inner(area);
        block.render(area, buf);
        let (shown, widths) = self.columns(usize::from(inner.width));
        let mut lines =
            vec![self.row(HEADERS, &shown, &widths, vec![Span::raw("    ")], t.muted())];
        for (i, arm) in s.arms.iter().enumerate().skip(first).take(visible) {
            let selected = i == s.selected();
            let swatch = Style::new().fg(arm_color(t, i));
            let (marker, style) = if selected {
                ("▶ ", t.accent().add_modifier(Modifier::BOLD))
            } else {
                ("  ", t.base())
            };
            let cells: [&str; 7] = std::array::from_fn(|k| arm.cells[k].as_str());
            lines.push(self.row(
                cells,
                &shown,
                &widths,
                vec![
                    Span::styled(marker, t.accent()),
                    Span::styled("━ ", swatch.add_modifier(Modifier::BOLD)),
                ],
                style,
            ));
        }
        if s.arms.is_empty() {
            lines.push(Line::from(Span::styled("no runs", t.muted())));
        }
        Paragraph::new(lines).render(inner, buf);
    }
}

/// The overlaid chart with its tabs.
struct ChartView<'a> {
    state: &'a CompareState,
    theme: &'a Theme,
}

/// The points an arm draws in `chart`.
fn points(arm: &CompareArm, chart: CompareChart) -> &[(f64, f64)] {
    match chart {
        CompareChart::ValBpt => &arm.curves.val_bpt,
        CompareChart::SRatio => &arm.curves.s_pct,
        CompareChart::Lambda => &arm.lambda_log10,
    }
}

/// The last value an arm shows in `chart`, as the legend prints it.
fn last_value(arm: &CompareArm, chart: CompareChart) -> String {
    let Some(&(_, y)) = points(arm, chart).last() else {
        return "--".into();
    };
    match chart {
        CompareChart::ValBpt => format!("{y:.4}"),
        CompareChart::SRatio => fmt::pct2(y / 100.0),
        CompareChart::Lambda => fmt::value(10f64.powf(y)),
    }
}

impl Widget for ChartView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let s = self.state;
        let chart = s.chart();
        // the tabs: " [1 val bits/token] 2 S 3 λ "
        let mut tabs = vec![Span::raw(" ")];
        for (i, c) in CompareChart::ALL.iter().enumerate() {
            tabs.push(if *c == chart {
                Span::styled(format!("[{} {}] ", i + 1, c.name()), t.title())
            } else {
                Span::styled(format!("{} {} ", i + 1, c.name()), t.muted())
            });
        }
        let mut title: Vec<Vec<Span<'static>>> = vec![tabs];
        let selected = s.selected();
        if let Some(arm) = s.arms.get(selected) {
            title.push(vec![Span::styled(
                format!("━ {} {} ", arm.label(), last_value(arm, chart)),
                Style::new()
                    .fg(arm_color(t, selected))
                    .add_modifier(Modifier::BOLD),
            )]);
        }
        if chart == CompareChart::Lambda {
            title.push(vec![Span::styled("(log scale) ", t.muted())]);
        }
        // every other arm dimmed first, the selected one last: on top where lines share cells
        let order = (0..s.arms.len())
            .filter(|&i| i != selected)
            .chain((selected < s.arms.len()).then_some(selected));
        let mut traces = Vec::new();
        let mut x_range: Option<(f64, f64)> = None;
        for i in order {
            let arm = &s.arms[i];
            let pts = points(arm, chart);
            for &(x, _) in pts {
                x_range = Some(x_range.map_or((x, x), |(a, b)| (a.min(x), b.max(x))));
            }
            let base = Style::new().fg(arm_color(t, i));
            let style = if i == selected {
                base.add_modifier(Modifier::BOLD)
            } else {
                base.add_modifier(Modifier::DIM)
            };
            if i == selected && chart == CompareChart::SRatio {
                traces.push(Trace::Line {
                    points: &arm.curves.target_pct,
                    style: Style::new().fg(t.colors().setpoint),
                    dashed: true,
                });
            }
            traces.push(Trace::Line {
                points: pts,
                style,
                dashed: false,
            });
            if chart == CompareChart::ValBpt {
                traces.push(Trace::Points {
                    points: pts,
                    style,
                    glyph: if i == selected { '●' } else { '•' },
                });
            }
        }
        let empty = match chart {
            CompareChart::ValBpt => "no evaluations in these runs",
            CompareChart::SRatio => "no SCU events in these runs",
            CompareChart::Lambda => "no positive λ in these runs",
        };
        let plot = Plot::over_steps(title, traces, x_range, empty, t);
        match chart {
            CompareChart::ValBpt => plot.render(area, buf),
            CompareChart::SRatio => Plot {
                y_label: fmt::tick_pct,
                ..plot
            }
            .render(area, buf),
            CompareChart::Lambda => Plot {
                y_scale: YScale::Log10,
                y_label: |e, _| fmt::power_of_ten_short(e),
                ..plot
            }
            .render(area, buf),
        }
    }
}

impl CompareState {
    /// Draws the comparison view over the whole frame.
    pub fn render(&self, frame: &mut ratatui::Frame, theme: &Theme) {
        let area = frame.area();
        CompareView { state: self, theme }.render(area, frame.buffer_mut());
    }
}
