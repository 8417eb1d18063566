//! A line plot drawn cell by cell, so that what it shows is true at any size:
//!
//! * braille lines are composited dot by dot, so a series crossing another (S over its
//!   setpoint) leaves both visible;
//! * sparse points (evaluations) are whole-cell markers with an error bar;
//! * both axes carry nice ticks (1, 2, 2.5, 5 × 10ⁿ; decades on a log axis) placed at their
//!   values, every label whole or left out, never printed over another, and an axis title;
//! * events are marked on the x axis at their step.

use super::{fit, panel, text_width};
use crate::tui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Alignment, Rect};
use ratatui::style::Style;
use ratatui::text::Span;
use ratatui::widgets::{Paragraph, Widget};

/// Something drawn in the plot area.
pub enum Trace<'a> {
    /// A braille line through the points (oldest first); `dashed` leaves gaps.
    Line {
        points: &'a [(f64, f64)],
        style: Style,
        dashed: bool,
    },
    /// A horizontal reference line at `y`, dashed; drawn only where it is in view (it never
    /// widens the y range).
    Level { y: f64, style: Style },
    /// A glyph at each point (sparse series such as evaluations).
    Points {
        points: &'a [(f64, f64)],
        style: Style,
        glyph: char,
    },
    /// A vertical bar from `lo` to `hi` at each x (error bars); `lo` and `hi` pair by index.
    Bars {
        lo: &'a [(f64, f64)],
        hi: &'a [(f64, f64)],
        style: Style,
    },
}

/// An event marked on the x axis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mark {
    /// Where (a step).
    pub x: f64,
    /// The glyph drawn on the axis.
    pub glyph: char,
    /// Its colour.
    pub style: Style,
}

/// How the y axis maps values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YScale {
    /// Ticks at 1, 2, 2.5, 5 × 10ⁿ.
    Linear,
    /// The values are log10 of the quantity: ticks at decades, or at 1, 2, 5 × 10ⁿ within
    /// less than a decade.
    Log10,
}

/// How the x axis is ticked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XScale {
    /// Training steps: whole numbers.
    Steps,
    /// Seconds (before now): ticks at 5 s, 10 s, 15 s, 30 s, 1 min, … spacings.
    Seconds,
}

/// A bordered plot. See the [module docs](self).
pub struct Plot<'a> {
    /// Title segments in order of importance, fitted to the panel width: each whole, or
    /// a "…" for those that do not fit (see [`fit`]).
    pub title: Vec<Vec<Span<'a>>>,
    /// In a bordered panel with the title on its top border; else the title takes the first
    /// row.
    pub bordered: bool,
    /// Drawn in order: later lines take the colour of the cells they share.
    pub traces: Vec<Trace<'a>>,
    /// The x range shown; `None` before any data.
    pub x_range: Option<(f64, f64)>,
    /// How the x axis is ticked.
    pub x_scale: XScale,
    /// Formats an x tick (value, tick spacing).
    pub x_label: fn(f64, f64) -> String,
    /// The x axis title, e.g. "step".
    pub x_title: &'a str,
    /// How y values map.
    pub y_scale: YScale,
    /// Formats a y tick (value, tick spacing).
    pub y_label: fn(f64, f64) -> String,
    /// A fixed y range (e.g. 0–100 %) instead of one fitted to the data.
    pub y_range: Option<(f64, f64)>,
    /// Events on the x axis.
    pub marks: Vec<Mark>,
    /// Shown while there is nothing to draw.
    pub empty_text: &'a str,
    /// Colours.
    pub theme: &'a Theme,
}

impl<'a> Plot<'a> {
    /// A bordered plot over training steps with a linear y axis, no fixed range and no
    /// marks: set the fields that differ.
    pub fn over_steps(
        title: Vec<Vec<Span<'a>>>,
        traces: Vec<Trace<'a>>,
        x_range: Option<(f64, f64)>,
        empty_text: &'a str,
        theme: &'a Theme,
    ) -> Plot<'a> {
        Plot {
            title,
            bordered: true,
            traces,
            x_range,
            x_scale: XScale::Steps,
            x_label: crate::tui::fmt::step_tick,
            x_title: "step",
            y_scale: YScale::Linear,
            y_label: crate::tui::fmt::tick,
            y_range: None,
            marks: Vec::new(),
            empty_text,
            theme,
        }
    }
}

/// A nice spacing for about `max_ticks` ticks over `span`: 1, 2, 2.5 or 5 × 10ⁿ.
pub fn nice_step(span: f64, max_ticks: usize) -> f64 {
    let intervals = max_ticks.max(2) as f64 - 1.0;
    let raw = (span / intervals).abs();
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude)
}

/// A nice spacing in seconds for about `max_ticks` ticks over `span`.
fn time_step(span: f64, max_ticks: usize) -> f64 {
    let raw = span / (max_ticks.max(2) as f64 - 1.0);
    const STEPS: [f64; 14] = [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0,
    ];
    STEPS
        .into_iter()
        .find(|s| *s >= raw)
        .unwrap_or_else(|| (raw / 3600.0).ceil() * 3600.0)
}

/// The multiples of `step` within `[lo, hi]`.
pub fn ticks_within(lo: f64, hi: f64, step: f64) -> Vec<f64> {
    if !(step > 0.0 && lo.is_finite() && hi.is_finite()) || hi < lo {
        return Vec::new();
    }
    let eps = step * 1e-9;
    let first = (lo / step - 1e-9).ceil();
    let mut out = Vec::new();
    let mut k = first;
    while k * step <= hi + eps && out.len() < 1000 {
        // snap -0.0 and float noise to the grid
        let v = k * step;
        out.push(if v.abs() < eps { 0.0 } else { v });
        k += 1.0;
    }
    out
}

/// The next nice spacing below `step` (5 → 2.5 → 2 → 1 → 0.5 …).
fn finer(step: f64) -> f64 {
    let magnitude = 10f64.powf(step.log10().floor());
    let m = (step / magnitude * 10.0).round() / 10.0;
    if m > 2.5 {
        2.5 * magnitude
    } else if m > 2.0 {
        2.0 * magnitude
    } else if m > 1.0 {
        magnitude
    } else {
        0.5 * magnitude
    }
}

/// Ticks within `[lo, hi]`: at least two when a finer nice spacing (down to `min_step`) finds
/// them, at most `max_ticks` (every other one left out while there are more). Returns the
/// ticks and their spacing.
pub fn pick_ticks(lo: f64, hi: f64, max_ticks: usize, step: f64, min_step: f64) -> (Vec<f64>, f64) {
    let mut step = step.max(min_step);
    let mut ticks = ticks_within(lo, hi, step);
    for _ in 0..8 {
        if ticks.len() >= 2 || step <= min_step {
            break;
        }
        step = finer(step).max(min_step);
        ticks = ticks_within(lo, hi, step);
    }
    while ticks.len() > max_ticks.max(1) {
        step *= 2.0;
        ticks = ticks.into_iter().step_by(2).collect();
    }
    (ticks, step)
}

/// Linear ticks for data in `[lo, hi]`: the axis range and the ticks in it, with their
/// spacing. The range is the data padded by 5% (a flat series by 5% of its value); when no
/// nice tick falls inside it, it widens to the ticks around the data.
pub fn linear_ticks(lo: f64, hi: f64, max_ticks: usize) -> ((f64, f64), Vec<f64>, f64) {
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.05 };
        (lo - pad, hi + pad)
    };
    let pad = (hi - lo) * 0.05;
    let (y0, y1) = (lo - pad, hi + pad);
    let (ticks, step) = pick_ticks(y0, y1, max_ticks, nice_step(hi - lo, max_ticks), 0.0);
    if !ticks.is_empty() {
        return ((y0, y1), ticks, step);
    }
    let a = (lo / step).floor() * step;
    let b = (hi / step).ceil() * step;
    let b = if b > a { b } else { a + step };
    ((a, b), ticks_within(a, b, step), step)
}

/// Ticks for log10 values in `[lo, hi]`: decades when the data spans one or more, else
/// 1, 2, 5 × 10ⁿ around the data. Returns the axis range (in log10) and the ticks (log10).
pub fn log_ticks(lo: f64, hi: f64, max_ticks: usize) -> ((f64, f64), Vec<f64>) {
    let max_ticks = max_ticks.max(2);
    if hi - lo >= 1.0 {
        let start = lo.floor();
        let decades = (hi.ceil() - start).max(1.0);
        let stride = (decades / (max_ticks as f64 - 1.0)).ceil().max(1.0);
        let end = start + (decades / stride).ceil() * stride;
        let ticks = ticks_within(start, end, stride);
        return ((start, end), ticks);
    }
    // candidates 1, 2, 5 × 10ⁿ around the data
    let mut candidates = Vec::new();
    for d in (lo.floor() as i32 - 1)..=(hi.ceil() as i32 + 1) {
        for m in [1.0f64, 2.0, 5.0] {
            candidates.push(f64::from(d) + m.log10());
        }
    }
    let eps = 1e-9;
    let below = candidates
        .iter()
        .copied()
        .filter(|c| *c <= lo + eps)
        .fold(f64::NEG_INFINITY, f64::max);
    let above = candidates
        .iter()
        .copied()
        .filter(|c| *c >= hi - eps && *c > below + eps)
        .fold(f64::INFINITY, f64::min);
    let mut ticks: Vec<f64> = candidates
        .into_iter()
        .filter(|c| *c >= below - eps && *c <= above + eps)
        .collect();
    if ticks.len() > max_ticks {
        ticks = vec![below, above];
    }
    ((below, above), ticks)
}

/// Sets one cell's symbol and style, when it lies in `area`.
fn put(buf: &mut Buffer, area: Rect, x: u16, y: u16, symbol: &str, style: Style) {
    if x >= area.left() && x < area.right() && y >= area.top() && y < area.bottom() {
        buf[(x, y)].set_symbol(symbol).set_style(style);
    }
}

/// Writes `text` at `(x, y)` within `area` (clipped to it).
fn put_str(buf: &mut Buffer, area: Rect, x: u16, y: u16, text: &str, style: Style) {
    let mut col = x;
    for c in text.chars() {
        let mut tmp = [0u8; 4];
        let s = c.encode_utf8(&mut tmp);
        put(buf, area, col, y, s, style);
        col = col.saturating_add(text_width(s).max(1) as u16);
    }
}

/// Braille dot bits by (column 0–1, row 0–3) within a cell.
const DOTS: [[u8; 4]; 2] = [[0x01, 0x02, 0x04, 0x40], [0x08, 0x10, 0x20, 0x80]];

/// The plot's mapping from values to cells and braille dots.
struct Frame {
    graph: Rect,
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn dots_w(&self) -> i64 {
        i64::from(self.graph.width) * 2
    }
    fn dots_h(&self) -> i64 {
        i64::from(self.graph.height) * 4
    }
    /// Dot coordinates (column from the left, row from the top).
    fn dot(&self, x: f64, y: f64) -> (i64, i64) {
        let fx = (x - self.x.0) / (self.x.1 - self.x.0);
        let fy = (y - self.y.0) / (self.y.1 - self.y.0);
        let px = (fx.clamp(0.0, 1.0) * (self.dots_w() - 1) as f64).round() as i64;
        let py = ((1.0 - fy.clamp(0.0, 1.0)) * (self.dots_h() - 1) as f64).round() as i64;
        (px, py)
    }
    /// The cell column of `x`.
    fn col(&self, x: f64) -> u16 {
        let (px, _) = self.dot(x, self.y.0);
        self.graph.x + (px / 2) as u16
    }
    /// The cell row of `y`.
    fn row(&self, y: f64) -> u16 {
        let (_, py) = self.dot(self.x.0, y);
        self.graph.y + (py / 4) as u16
    }
    fn in_x(&self, x: f64) -> bool {
        x >= self.x.0 - 1e-9 && x <= self.x.1 + 1e-9
    }
    fn in_y(&self, y: f64) -> bool {
        y >= self.y.0 - 1e-12 && y <= self.y.1 + 1e-12
    }
}

/// One series' dots, cell by cell.
struct Dots {
    width: usize,
    bits: Vec<u8>,
}

impl Dots {
    fn new(frame: &Frame) -> Dots {
        let width = usize::from(frame.graph.width);
        Dots {
            width,
            bits: vec![0; width * usize::from(frame.graph.height)],
        }
    }

    fn set(&mut self, px: i64, py: i64) {
        if px < 0 || py < 0 {
            return;
        }
        let (cx, cy) = ((px / 2) as usize, (py / 4) as usize);
        if cx >= self.width || cy * self.width + cx >= self.bits.len() {
            return;
        }
        self.bits[cy * self.width + cx] |= DOTS[(px % 2) as usize][(py % 4) as usize];
    }

    /// A line between two dots (Bresenham); `dashed` draws two dots of every four.
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), dashed: bool) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            if !dashed || x.rem_euclid(4) < 2 {
                self.set(x, y);
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }
}

impl Plot<'_> {
    /// Min and max of every y value drawn within the x range (levels excluded).
    fn y_extent(&self, x0: f64, x1: f64) -> Option<(f64, f64)> {
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        let mut take = |points: &[(f64, f64)]| {
            for &(x, y) in points {
                if x >= x0 && x <= x1 && y.is_finite() {
                    lo = lo.min(y);
                    hi = hi.max(y);
                }
            }
        };
        for trace in &self.traces {
            match trace {
                Trace::Line { points, .. } | Trace::Points { points, .. } => take(points),
                Trace::Bars { lo, hi, .. } => {
                    take(lo);
                    take(hi);
                }
                Trace::Level { .. } => {}
            }
        }
        (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
    }

    fn render_empty(&self, inner: Rect, buf: &mut Buffer) {
        if inner.height == 0 {
            return;
        }
        let mid = Rect {
            y: inner.y + (inner.height - 1) / 2,
            height: 1,
            ..inner
        };
        Paragraph::new(Span::styled(
            super::elide(self.empty_text, usize::from(inner.width)),
            self.theme.muted(),
        ))
        .alignment(Alignment::Center)
        .render(mid, buf);
    }
}

impl Widget for Plot<'_> {
    fn render(mut self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let border = if self.bordered { 2 } else { 0 };
        let title_width = usize::from(area.width.saturating_sub(border));
        // each title segment whole, or a lone "…" where the rest would go
        let title = fit(std::mem::take(&mut self.title), title_width, usize::MAX);
        let plot = self;
        let inner = if plot.bordered {
            let block = panel(title, t, false);
            let inner = block.inner(area);
            block.render(area, buf);
            inner
        } else {
            if area.height == 0 {
                return;
            }
            Paragraph::new(title).render(Rect { height: 1, ..area }, buf);
            Rect {
                y: area.y + 1,
                height: area.height - 1,
                ..area
            }
        };
        let data = plot.x_range.and_then(|(x0, x1)| {
            let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
            let y = plot.y_range.or_else(|| plot.y_extent(x0, x1))?;
            Some(((x0, x1), y))
        });
        // room for one label column, the axis, two dot columns; two rows under the graph
        let Some(((x0, x1), (lo, hi))) = data.filter(|_| inner.width >= 8 && inner.height >= 3)
        else {
            plot.render_empty(inner, buf);
            return;
        };
        let graph_rows = inner.height - 2;
        // a label every other row, at most six; two on two or three rows
        let rows = usize::from(graph_rows);
        let max_y_ticks = rows.div_ceil(2).max(2).min(rows).clamp(1, 6);
        let (y_range, y_ticks, y_step) = match plot.y_scale {
            YScale::Linear => match plot.y_range {
                Some(range) => {
                    let step = nice_step(range.1 - range.0, max_y_ticks);
                    let (ticks, step) = pick_ticks(range.0, range.1, max_y_ticks, step, 0.0);
                    (range, ticks, step)
                }
                None => linear_ticks(lo, hi, max_y_ticks),
            },
            YScale::Log10 => {
                let (range, ticks) = log_ticks(lo, hi, max_y_ticks);
                (range, ticks, 1.0)
            }
        };
        let y_labels: Vec<(f64, String)> = y_ticks
            .iter()
            .map(|&v| (v, (plot.y_label)(v, y_step)))
            .collect();
        let label_w = y_labels
            .iter()
            .map(|(_, l)| text_width(l))
            .max()
            .unwrap_or(0)
            .min(usize::from(inner.width) / 3) as u16;
        let axis_x = inner.x + label_w;
        let graph = Rect {
            x: axis_x + 1,
            y: inner.y,
            width: inner.width - label_w - 1,
            height: graph_rows,
        };
        let frame = Frame {
            graph,
            x: (x0, x1),
            y: y_range,
        };
        let muted = t.muted();

        // axes
        let axis_row = graph.bottom();
        for y in graph.top()..graph.bottom() {
            put(buf, inner, axis_x, y, "│", muted);
        }
        put(buf, inner, axis_x, axis_row, "└", muted);
        for x in graph.left()..graph.right() {
            put(buf, inner, x, axis_row, "─", muted);
        }

        // y ticks: whole labels at their rows, none on a row already labelled
        let mut last_row = None;
        for (v, label) in &y_labels {
            if !frame.in_y(*v) || text_width(label) > usize::from(label_w) {
                continue;
            }
            let row = frame.row(*v);
            if last_row == Some(row) {
                continue;
            }
            last_row = Some(row);
            let x = axis_x - text_width(label) as u16;
            put_str(buf, inner, x, row, label, muted);
            put(buf, inner, axis_x, row, "┤", muted);
        }

        // x ticks: whole labels centred under their column, never touching another
        let label_row = axis_row + 1;
        let widest = text_width(&(plot.x_label)(x1, 1.0)).max(text_width(&(plot.x_label)(x0, 1.0)));
        let max_x_ticks = (usize::from(graph.width) / (widest + 3)).clamp(2, 10);
        let (x_ticks, x_step) = match plot.x_scale {
            XScale::Steps => pick_ticks(
                x0,
                x1,
                max_x_ticks,
                nice_step(x1 - x0, max_x_ticks).max(1.0).round(),
                1.0,
            ),
            XScale::Seconds => {
                pick_ticks(x0, x1, max_x_ticks, time_step(x1 - x0, max_x_ticks), 1.0)
            }
        };
        let x_ticks = if x_ticks.is_empty() {
            vec![x0, x1]
        } else {
            x_ticks
        };
        // the title goes in the corner left of the axis when it fits, else at the right end
        let title_w = text_width(plot.x_title) as u16;
        let corner = title_w > 0 && title_w <= label_w;
        let right_limit = if corner || title_w == 0 {
            graph.right()
        } else {
            graph.right().saturating_sub(title_w + 1)
        };
        let mut free_from = graph.left().saturating_sub(1);
        for v in x_ticks {
            let label = (plot.x_label)(v, x_step);
            let w = text_width(&label) as u16;
            let col = frame.col(v);
            // centred under its column, pulled in at the ends (a label never leaves the
            // panel or runs into the axis title: in the corner, a column's gap after it)
            let lowest = if corner {
                graph.left()
            } else {
                graph.left().saturating_sub(1)
            };
            let start = col
                .saturating_sub(w / 2)
                .min(right_limit.saturating_sub(w))
                .max(lowest);
            if start < free_from || start + w > right_limit || col < start || col >= start + w {
                continue;
            }
            put_str(buf, inner, start, label_row, &label, muted);
            put(buf, inner, col, axis_row, "┬", muted);
            free_from = start + w + 1;
        }
        if corner {
            put_str(buf, inner, axis_x - title_w, label_row, plot.x_title, muted);
        } else if title_w > 0 && free_from + title_w <= graph.right() {
            put_str(
                buf,
                inner,
                graph.right() - title_w,
                label_row,
                plot.x_title,
                muted,
            );
        }

        // lines and levels, composited dot by dot; a later trace colours the cells it shares
        let cells = usize::from(graph.width) * usize::from(graph.height);
        let mut bits = vec![0u8; cells];
        let mut styles: Vec<Option<Style>> = vec![None; cells];
        for trace in &plot.traces {
            let mut dots = Dots::new(&frame);
            let style = match trace {
                Trace::Line {
                    points,
                    style,
                    dashed,
                } => {
                    let mut prev = None;
                    for &(x, y) in points.iter() {
                        if !(frame.in_x(x) && y.is_finite()) {
                            continue;
                        }
                        let p = frame.dot(x, y);
                        match prev {
                            Some(q) => dots.line(q, p, *dashed),
                            None => dots.set(p.0, p.1),
                        }
                        prev = Some(p);
                    }
                    *style
                }
                Trace::Level { y, style } => {
                    if !frame.in_y(*y) {
                        continue;
                    }
                    let (_, py) = frame.dot(x0, *y);
                    dots.line((0, py), (frame.dots_w() - 1, py), true);
                    *style
                }
                Trace::Points { .. } | Trace::Bars { .. } => continue,
            };
            for (i, b) in dots.bits.iter().enumerate() {
                if *b != 0 {
                    bits[i] |= b;
                    styles[i] = Some(style);
                }
            }
        }
        for (i, b) in bits.iter().enumerate() {
            if *b == 0 {
                continue;
            }
            let x = graph.x + (i % usize::from(graph.width)) as u16;
            let y = graph.y + (i / usize::from(graph.width)) as u16;
            let symbol = char::from_u32(0x2800 + u32::from(*b)).unwrap_or('⣿');
            let mut tmp = [0u8; 4];
            put(
                buf,
                graph,
                x,
                y,
                symbol.encode_utf8(&mut tmp),
                styles[i].unwrap_or(muted),
            );
        }

        // error bars, then point markers on top
        for trace in &plot.traces {
            if let Trace::Bars { lo, hi, style } = trace {
                for (&(x, l), &(_, h)) in lo.iter().zip(hi.iter()) {
                    if !frame.in_x(x) {
                        continue;
                    }
                    let col = frame.col(x);
                    let (top, bottom) = (frame.row(h), frame.row(l));
                    for y in top..=bottom {
                        put(buf, graph, col, y, "│", *style);
                    }
                }
            }
        }
        for trace in &plot.traces {
            if let Trace::Points {
                points,
                style,
                glyph,
            } = trace
            {
                let mut tmp = [0u8; 4];
                let symbol: &str = glyph.encode_utf8(&mut tmp);
                for &(x, y) in points.iter() {
                    if frame.in_x(x) && y.is_finite() {
                        put(buf, graph, frame.col(x), frame.row(y), symbol, *style);
                    }
                }
            }
        }

        // events on the x axis
        for mark in &plot.marks {
            if frame.in_x(mark.x) {
                let mut tmp = [0u8; 4];
                put(
                    buf,
                    inner,
                    frame.col(mark.x),
                    axis_row,
                    mark.glyph.encode_utf8(&mut tmp),
                    mark.style,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps_and_ticks() {
        assert_eq!(nice_step(10.0, 6), 2.0);
        assert_eq!(nice_step(0.01, 5), 0.0025);
        assert_eq!(ticks_within(0.5, 10.1, 2.0), vec![2.0, 4.0, 6.0, 8.0, 10.0]);
        // a 0.0100 maximum gets a 0.0100 tick, not a 0.0103 axis top
        let ((lo, hi), ticks, step) = linear_ticks(0.0, 0.01, 3);
        assert!(lo < 0.0 && hi > 0.01);
        assert_eq!(step, 0.005);
        assert_eq!(ticks, vec![0.0, 0.005, 0.01]);
        // a flat series still gets two ticks
        let (_, ticks, _) = linear_ticks(2.0, 2.0, 4);
        assert!(ticks.len() >= 2, "{ticks:?}");
        // two rows' worth of ticks over a loss from 10 down to 2: 5 and 10, not 0 to 20
        let ((lo, hi), ticks, _) = linear_ticks(2.0, 10.1, 2);
        assert!(lo > 1.0 && hi < 11.0, "{lo} {hi}");
        assert_eq!(ticks, vec![5.0, 10.0]);
        // steps 1..1200 in room for three labels: 500 and 1000
        let (ticks, _) = pick_ticks(1.0, 1200.0, 3, 1000.0, 1.0);
        assert_eq!(ticks, vec![500.0, 1000.0]);
    }

    #[test]
    fn log_ticks_use_decades_or_one_two_five() {
        let ((lo, hi), ticks) = log_ticks(-4.0, -1.52, 6);
        assert_eq!((lo, hi), (-4.0, -1.0));
        assert_eq!(ticks, vec![-4.0, -3.0, -2.0, -1.0]);
        let ((lo, hi), ticks) = log_ticks(2.2e-3f64.log10(), 2.9e-3f64.log10(), 4);
        assert!((10f64.powf(lo) - 2e-3).abs() < 1e-12);
        assert!((10f64.powf(hi) - 5e-3).abs() < 1e-12);
        assert_eq!(ticks.len(), 2);
    }

    /// A y range narrower than 1e-4 (a flat validation curve): every y tick its own label,
    /// and the x title in the corner a column apart from the first x label.
    #[test]
    fn narrow_ranges_label_every_tick_and_the_corner_title_stands_apart() {
        let theme = Theme::default();
        let points = [(1000.0, 3.90001), (1500.0, 3.90003), (2000.0, 3.90004)];
        let trace = Trace::Line {
            points: &points,
            style: Style::default(),
            dashed: false,
        };
        let plot = Plot::over_steps(vec![], vec![trace], Some((1000.0, 2000.0)), "", &theme);
        let area = Rect::new(0, 0, 40, 12);
        let mut buf = Buffer::empty(area);
        plot.render(area, &mut buf);
        let rows: Vec<String> = (0..area.height)
            .map(|y| (0..area.width).map(|x| buf[(x, y)].symbol()).collect())
            .collect();
        let text = rows.join("\n");
        let labels: Vec<&str> = rows
            .iter()
            .filter_map(|r| r.strip_prefix('│')?.split(['┤', '│']).next().map(str::trim))
            .filter(|l| !l.is_empty())
            .collect();
        assert!(labels.len() >= 3, "{labels:?}\n{text}");
        let mut unique = labels.clone();
        unique.dedup();
        assert_eq!(unique.len(), labels.len(), "{text}");
        let x_row = rows
            .iter()
            .find(|r| r.contains("step"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(x_row.contains("step "), "{text}");
    }

    #[test]
    fn crossing_lines_share_their_cells() {
        let mut d = Dots {
            width: 2,
            bits: vec![0; 2],
        };
        d.line((0, 0), (3, 3), false);
        assert_eq!(d.bits[0], 0x01 | 0x10);
        assert_eq!(d.bits[1], 0x04 | 0x80);
    }
}
