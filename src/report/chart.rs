//! One line chart, described once and drawn the same way to PNG and SVG.
//!
//! One file on purpose (just over 1,000 lines): the layout, the axes, the thinning and the two
//! back ends share the chart's one description; split, each part would reach into the others.
//!
//! Layout, top to bottom: a bold title, a legend that wraps over as many rows as it needs
//! (it never covers data), then the plot with its axes. Points that are NaN or infinite (or
//! not positive on a log axis) are left out and counted; long series are thinned to a few
//! thousand points keeping each bucket's extremes, so spikes survive.

use std::path::{Path, PathBuf};

use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::ranged1d::{
    BoldPoints, KeyPointHint, LightPoints, NoDefaultFormatting, ValueFormatter,
};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::font::{FontStatus, FAMILY};
use super::{io_error, PlotSummary, ReportError};

/// Size of every chart in pixels.
pub(crate) const WIDTH: u32 = 1200;
pub(crate) const HEIGHT: u32 = 600;

const X_TICKS: usize = 10;
const Y_TICKS: usize = 8;
/// Series longer than this are thinned before drawing.
const MAX_POINTS: usize = 4000;
/// Below this many pixels per point a zigzagging line is drawn one pixel wide.
const DENSE_PX_PER_POINT: usize = 4;
/// A gap between consecutive x values this many times the median gap breaks the line.
const GAP_FACTOR: f64 = 10.0;

const TITLE_SIZE: f64 = 24.0;
const LEGEND_SIZE: f64 = 15.0;
const LABEL_SIZE: f64 = 15.0;
const DESC_SIZE: f64 = 16.0;
const TITLE_H: u32 = 44;
const LEGEND_ROW_H: u32 = 24;
const SWATCH_W: i32 = 30;
const MARGIN: i32 = 24;

/// Tableau-10: distinct, print-friendly colours for one line per series or GPU.
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Colour of the `i`-th line of a chart.
pub(crate) fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Style {
    /// A solid line.
    Line,
    /// A thin, pale line: raw data under its smoothed version.
    Faint,
    /// A dashed line: setpoints and reference levels.
    Dashed,
    /// A line with a dot on every point: sparse data such as evaluations.
    Markers,
}

#[derive(Clone, Debug)]
pub(crate) struct Series {
    pub label: String,
    pub color: RGBColor,
    pub style: Style,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub(crate) fn new(
        label: impl Into<String>,
        color: RGBColor,
        style: Style,
        points: Vec<(f64, f64)>,
    ) -> Self {
        Series {
            label: label.into(),
            color,
            style,
            points,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scale {
    Linear,
    /// Base-10 logarithmic; values ≤ 0 cannot be shown and are left out.
    Log,
}

/// Everything needed to draw one chart.
#[derive(Clone, Debug)]
pub(crate) struct ChartSpec {
    /// File stem of the outputs, e.g. `"loss"` for `loss.png` and `loss.svg`.
    pub name: &'static str,
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub y_scale: Scale,
    /// Values the y range must reach (e.g. 0 and 100 for a percentage).
    pub y_include: Vec<f64>,
    /// Break lines across unusually long gaps in x (pauses in a time series).
    pub break_gaps: bool,
    /// Average runs of consecutive points so each line has at most this many (for dense,
    /// noisy samples such as telemetry); otherwise long series keep their extremes.
    pub mean_points: Option<usize>,
    /// Drawn in order: put pale raw data before its smoothed line.
    pub series: Vec<Series>,
}

impl ChartSpec {
    pub(crate) fn new(
        name: &'static str,
        title: impl Into<String>,
        x_desc: impl Into<String>,
        y_desc: impl Into<String>,
    ) -> Self {
        ChartSpec {
            name,
            title: title.into(),
            x_desc: x_desc.into(),
            y_desc: y_desc.into(),
            y_scale: Scale::Linear,
            y_include: Vec::new(),
            break_gaps: false,
            mean_points: None,
            series: Vec::new(),
        }
    }
}

/// How text is handled on one output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TextMode {
    /// A font is registered: text is measured and drawn.
    Font,
    /// No font, vector output: text elements are written, their widths guessed.
    Estimated,
    /// No font, raster output: no text at all.
    Hidden,
}

/// The font family to draw with and whether it is registered.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fonts {
    pub family: &'static str,
    pub loaded: bool,
}

impl Fonts {
    pub(crate) fn from_status(status: &FontStatus) -> Self {
        Fonts {
            family: FAMILY,
            loaded: status.is_loaded(),
        }
    }

    fn png_mode(self) -> TextMode {
        if self.loaded {
            TextMode::Font
        } else {
            TextMode::Hidden
        }
    }

    fn svg_mode(self) -> TextMode {
        if self.loaded {
            TextMode::Font
        } else {
            TextMode::Estimated
        }
    }
}

/// A chart to draw, or the reason there is nothing to draw.
pub(crate) type Planned = Result<ChartSpec, (&'static str, String)>;

/// Draw every planned chart into `dir` (created if missing), recording the outcome in
/// `summary`.
pub(crate) fn render_all(
    planned: Vec<Planned>,
    dir: &Path,
    fonts: Fonts,
    summary: &mut PlotSummary,
) -> Result<(), ReportError> {
    let mut created = false;
    for plan in planned {
        let spec = match plan {
            Ok(spec) => spec,
            Err((name, reason)) => {
                summary.skip(name, reason);
                continue;
            }
        };
        let prepared = match prepare(&spec) {
            Ok(p) => p,
            Err(reason) => {
                summary.skip(spec.name, reason);
                continue;
            }
        };
        if !created {
            std::fs::create_dir_all(dir).map_err(io_error(dir))?;
            created = true;
        }
        summary.written.extend(render(&prepared, dir, fonts)?);
        if prepared.omitted > 0 {
            let what = match spec.y_scale {
                Scale::Linear => "NaN or infinite",
                Scale::Log => "NaN, infinite or not positive on the log axis",
            };
            summary.notices.push(format!(
                "{}: left out {} point(s) that were {what}",
                spec.name, prepared.omitted
            ));
        }
    }
    Ok(())
}

/// Write `<dir>/<name>.png` and `<dir>/<name>.svg`.
fn render(p: &Prepared<'_>, dir: &Path, fonts: Fonts) -> Result<Vec<PathBuf>, ReportError> {
    let png = dir.join(format!("{}.png", p.spec.name));
    let svg = dir.join(format!("{}.svg", p.spec.name));
    {
        let root = BitMapBackend::new(&png, (WIDTH, HEIGHT)).into_drawing_area();
        draw(&root, p, fonts.family, fonts.png_mode(), true)
            .and_then(|()| root.present())
            .map_err(|e| draw_error(&png, e))?;
    }
    {
        let root = SVGBackend::new(&svg, (WIDTH, HEIGHT)).into_drawing_area();
        draw(&root, p, fonts.family, fonts.svg_mode(), false)
            .and_then(|()| root.present())
            .map_err(|e| draw_error(&svg, e))?;
    }
    Ok(vec![png, svg])
}

fn draw_error<E: std::error::Error + Send + Sync>(
    path: &Path,
    e: DrawingAreaErrorKind<E>,
) -> ReportError {
    ReportError::Draw {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// A series' points as separately drawn runs (split at gaps).
type Segments = Vec<Vec<(f64, f64)>>;

/// A chart ready to draw: finite points only (in log10 space for a log axis), split at gaps,
/// thinned, with its ranges.
#[derive(Debug)]
pub(crate) struct Prepared<'a> {
    spec: &'a ChartSpec,
    series: Vec<(&'a Series, Segments)>,
    x: (f64, f64),
    y: (f64, f64),
    omitted: usize,
    /// Most samples averaged into one drawn point (1: none).
    averaged: usize,
}

pub(crate) fn prepare(spec: &ChartSpec) -> Result<Prepared<'_>, String> {
    let log = spec.y_scale == Scale::Log;
    let to_axis = |y: f64| {
        if !log {
            y
        } else if y > 0.0 {
            y.log10()
        } else {
            f64::NAN
        }
    };
    let mut omitted = 0;
    let mut averaged = 1;
    let mut series = Vec::new();
    for s in &spec.series {
        let mut pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(x, y)| (x, to_axis(y)))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        omitted += s.points.len() - pts.len();
        if pts.is_empty() {
            continue;
        }
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mean_budget = spec.mean_points.map(|n| n.max(1));
        let total = pts.len();
        let segments: Segments = split_at_gaps(pts, spec.break_gaps)
            .into_iter()
            .map(|seg| match mean_budget {
                Some(n) => {
                    // Share the budget between segments by length.
                    let budget = (n * seg.len()).div_ceil(total).max(1);
                    let (seg, k) = average(seg, budget);
                    averaged = averaged.max(k);
                    seg
                }
                None => thin(seg, MAX_POINTS),
            })
            .collect();
        series.push((s, segments));
    }
    if series.is_empty() {
        return Err(if omitted == 0 {
            "no data".to_string()
        } else if log {
            format!("all {omitted} value(s) are NaN, infinite or not positive")
        } else {
            format!("all {omitted} value(s) are NaN or infinite")
        });
    }
    let all = || series.iter().flat_map(|(_, segs)| segs.iter().flatten());
    let x = x_range(all().map(|p| p.0));
    let include: Vec<f64> = spec
        .y_include
        .iter()
        .map(|&v| to_axis(v))
        .filter(|v| v.is_finite())
        .collect();
    let y = y_range(all().map(|p| p.1), &include, log);
    Ok(Prepared {
        spec,
        series,
        x,
        y,
        omitted,
        averaged,
    })
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Tight x range; a single x gets a unit either side.
fn x_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    match min_max(values) {
        Some((lo, hi)) if hi > lo => (lo, hi),
        Some((v, _)) => (v - 1.0, v + 1.0),
        None => (0.0, 1.0),
    }
}

/// y range with 5% headroom on the sides the data sets, hugging the values in `include`;
/// a flat series gets a band around its value.
fn y_range(values: impl Iterator<Item = f64>, include: &[f64], log: bool) -> (f64, f64) {
    let Some((dlo, dhi)) = min_max(values) else {
        return (0.0, 1.0);
    };
    let (ilo, ihi) = min_max(include.iter().copied()).unwrap_or((dlo, dhi));
    let (lo, hi) = (dlo.min(ilo), dhi.max(ihi));
    let span = hi - lo;
    // All values are finite here, so a flat range is the only degenerate case.
    if span <= f64::EPSILON * lo.abs().max(hi.abs()).max(f64::MIN_POSITIVE) {
        let half = if log {
            0.5
        } else if lo != 0.0 {
            lo.abs() * 0.1
        } else {
            1.0
        };
        return (lo - half, hi + half);
    }
    let lo = if ilo < dlo || (ilo == dlo && !include.is_empty()) {
        lo - span * 0.01
    } else {
        lo - span * 0.05
    };
    let hi = if ihi > dhi || (ihi == dhi && !include.is_empty()) {
        hi + span * 0.01
    } else {
        hi + span * 0.05
    };
    (lo, hi)
}

/// Split a sorted series where the gap to the next x is much larger than the median gap.
fn split_at_gaps(points: Vec<(f64, f64)>, enabled: bool) -> Vec<Vec<(f64, f64)>> {
    if !enabled || points.len() < 3 {
        return vec![points];
    }
    let mut gaps: Vec<f64> = points.windows(2).map(|w| w[1].0 - w[0].0).collect();
    gaps.sort_by(f64::total_cmp);
    let median = gaps[gaps.len() / 2];
    if median <= 0.0 {
        return vec![points];
    }
    let limit = median * GAP_FACTOR;
    let mut segments = Vec::new();
    let mut current: Vec<(f64, f64)> = Vec::new();
    for p in points {
        if let Some(last) = current.last() {
            if p.0 - last.0 > limit {
                segments.push(std::mem::take(&mut current));
            }
        }
        current.push(p);
    }
    segments.push(current);
    segments
}

/// Average runs of consecutive points down to at most `max` points; also returns the run
/// length used (1 when nothing was averaged).
fn average(points: Vec<(f64, f64)>, max: usize) -> (Vec<(f64, f64)>, usize) {
    if points.len() <= max || max == 0 {
        return (points, 1);
    }
    let run = points.len().div_ceil(max);
    // Equal runs (lengths differ by at most one), so the last point is no noisier.
    let n = points.len().div_ceil(run);
    let out = (0..n)
        .map(|i| &points[i * points.len() / n..(i + 1) * points.len() / n])
        .map(|c| {
            let n = c.len() as f64;
            let (sx, sy) = c
                .iter()
                .fold((0.0, 0.0), |(sx, sy), p| (sx + p.0, sy + p.1));
            (sx / n, sy / n)
        })
        .collect();
    (out, run)
}

/// Keep at most about `max` points: each bucket keeps its lowest and highest point, in order.
fn thin(points: Vec<(f64, f64)>, max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points;
    }
    let bucket = points.len().div_ceil(max / 2);
    let mut out = Vec::with_capacity(max + 2);
    for chunk in points.chunks(bucket) {
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in chunk.iter().enumerate() {
            if p.1 < chunk[lo].1 {
                lo = i;
            }
            if p.1 > chunk[hi].1 {
                hi = i;
            }
        }
        out.push(chunk[lo.min(hi)]);
        if lo != hi {
            out.push(chunk[lo.max(hi)]);
        }
    }
    out
}

/// Tick labels for a linear axis: as many decimals as the ticks need, k/M/G for large values,
/// a shared power of ten for small ones.
fn linear_ticks(range: (f64, f64), n: usize) -> impl Fn(&f64) -> String {
    let ticks = RangedCoordf64::from(range.0..range.1).key_points(BoldPoints(n));
    let mag = ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
    let (scale, suffix) = if mag >= 1e9 {
        (1e9, "G".to_string())
    } else if mag >= 1e6 {
        (1e6, "M".to_string())
    } else if mag >= 1e4 {
        (1e3, "k".to_string())
    } else if mag > 0.0 && mag < 1e-2 {
        let e = mag.log10().floor() as i32;
        (10f64.powi(e), format!("e{e}"))
    } else {
        (1.0, String::new())
    };
    let decimals = decimals_needed(ticks.iter().map(|t| t / scale));
    move |v: &f64| {
        let s = v / scale;
        if s == 0.0 {
            "0".to_string()
        } else {
            format!("{s:.decimals$}{suffix}")
        }
    }
}

/// Fewest decimals (up to 6) that print every value exactly.
fn decimals_needed(values: impl Iterator<Item = f64> + Clone) -> usize {
    (0..=6)
        .find(|&d| {
            let f = 10f64.powi(d as i32);
            values
                .clone()
                .all(|v| ((v * f) - (v * f).round()).abs() < 1e-6)
        })
        .unwrap_or(6)
}

/// A linear f64 axis whose grid lines sit where we say (plotters' own `WithKeyPoints` does
/// not carry over the f64 label formatting the mesh needs).
#[derive(Clone)]
struct TickedAxis {
    inner: RangedCoordf64,
    bold: Vec<f64>,
    light: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.bold.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

impl ValueFormatter<f64> for TickedAxis {
    fn format(value: &f64) -> String {
        format!("{value}")
    }
}

/// Ticks of the y axis: bold (labelled) and light grid positions, and the label formatter.
type YAxis = (Vec<f64>, Vec<f64>, Box<dyn Fn(&f64) -> String>);

fn y_axis(range: (f64, f64), scale: Scale) -> YAxis {
    let coord = RangedCoordf64::from(range.0..range.1);
    let plain_bold = coord.key_points(BoldPoints(Y_TICKS));
    let plain_light = coord.key_points(LightPoints::new(Y_TICKS, Y_TICKS * 5));
    match scale {
        Scale::Linear => (
            plain_bold,
            plain_light,
            Box::new(linear_ticks(range, Y_TICKS)),
        ),
        Scale::Log => match log_ticks(range) {
            Some((bold, light)) => (
                bold,
                light,
                Box::new(|v: &f64| significant(10f64.powf(*v), 2)),
            ),
            // Less than a few nice values in range: evenly spaced exponents, more digits.
            None => (
                plain_bold,
                plain_light,
                Box::new(|v: &f64| significant(10f64.powf(*v), 3)),
            ),
        },
    }
}

/// Log-axis ticks at round values, as exponents: decades when the range spans three or more,
/// else 1-2-5 in each decade, else every integer multiple; light lines at the integer
/// multiples. `None` when even those give fewer than three ticks.
fn log_ticks((lo, hi): (f64, f64)) -> Option<(Vec<f64>, Vec<f64>)> {
    let (k0, k1) = (lo.floor() as i32, hi.ceil() as i32);
    if k1 - k0 > 400 {
        return None;
    }
    let slack = (hi - lo) * 1e-9;
    let at = |mantissas: &[f64]| -> Vec<f64> {
        (k0..=k1)
            .flat_map(|k| mantissas.iter().map(move |m| m.log10() + f64::from(k)))
            .filter(|v| *v >= lo - slack && *v <= hi + slack)
            .collect()
    };
    let all = at(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    let decades = at(&[1.0]);
    if decades.len() >= 3 {
        let stride = decades.len().div_ceil(Y_TICKS);
        let bold: Vec<f64> = decades.iter().copied().step_by(stride).collect();
        let light = if stride == 1 { all } else { decades };
        return Some((bold, light));
    }
    let one_two_five = at(&[1.0, 2.0, 5.0]);
    if one_two_five.len() >= 3 {
        return Some((one_two_five, all));
    }
    (all.len() >= 3).then(|| (all, Vec::new()))
}

/// `v` with `digits` significant digits, scientific outside [0.01, 10000), no trailing zeros.
pub(crate) fn significant(v: f64, digits: usize) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = digits.max(1);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    let a = v.abs();
    if !(1e-2..1e4).contains(&a) {
        let s = format!("{v:.prec$e}", prec = digits - 1);
        return match s.split_once('e') {
            Some((mantissa, exp)) => format!("{}e{exp}", trim(mantissa)),
            None => s,
        };
    }
    let decimals = (digits as i32 - 1 - a.log10().floor() as i32).max(0) as usize;
    trim(&format!("{v:.decimals$}"))
}

fn text_width<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
    style: &TextStyle<'_>,
    size: f64,
    mode: TextMode,
) -> i32 {
    let guess = (text.chars().count() as f64 * size * 0.55).ceil() as i32;
    match mode {
        TextMode::Font => area
            .estimate_text_size(text, style)
            .map(|(w, _)| w as i32)
            .unwrap_or(guess),
        TextMode::Estimated => guess,
        TextMode::Hidden => 0,
    }
}

/// Rows of legend entries `(series index, x offset)` and each row's width.
fn legend_rows(widths: &[i32], max_width: i32) -> Vec<(Vec<(usize, i32)>, i32)> {
    let gap = 26;
    let mut rows: Vec<(Vec<(usize, i32)>, i32)> = Vec::new();
    for (i, &w) in widths.iter().enumerate() {
        match rows.last_mut() {
            Some((row, width)) if *width + gap + w <= max_width => {
                row.push((i, *width + gap));
                *width += gap + w;
            }
            _ => rows.push((vec![(i, 0)], w)),
        }
    }
    rows
}

fn draw_swatch<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    s: &Series,
    (x, y): (i32, i32),
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let c = s.color;
    match s.style {
        Style::Line => root.draw(&PathElement::new(
            vec![(x, y), (x + SWATCH_W, y)],
            c.stroke_width(3),
        )),
        Style::Faint => root.draw(&PathElement::new(
            vec![(x, y), (x + SWATCH_W, y)],
            pale(c).stroke_width(2),
        )),
        Style::Dashed => {
            root.draw(&PathElement::new(
                vec![(x, y), (x + 11, y)],
                c.stroke_width(2),
            ))?;
            root.draw(&PathElement::new(
                vec![(x + 19, y), (x + SWATCH_W, y)],
                c.stroke_width(2),
            ))
        }
        Style::Markers => {
            root.draw(&PathElement::new(
                vec![(x, y), (x + SWATCH_W, y)],
                c.stroke_width(2),
            ))?;
            root.draw(&Circle::new((x + SWATCH_W / 2, y), 4, c.filled()))
        }
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    p: &Prepared<'_>,
    family: &str,
    mode: TextMode,
    raster: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let ink = if mode == TextMode::Hidden {
        TRANSPARENT
    } else {
        BLACK.to_rgba()
    };
    let font = |size: f64, style: FontStyle| FontDesc::new(FontFamily::Name(family), size, style);

    let header_h = if mode == TextMode::Hidden {
        MARGIN as u32
    } else {
        let title = TextStyle::from(font(TITLE_SIZE, FontStyle::Bold))
            .color(&ink)
            .pos(Pos::new(HPos::Center, VPos::Top));
        let heading = if p.averaged > 1 {
            format!(
                "{} (mean of {} samples per point)",
                p.spec.title, p.averaged
            )
        } else {
            p.spec.title.clone()
        };
        root.draw_text(&heading, &title, (WIDTH as i32 / 2, 12))?;

        let legend = TextStyle::from(font(LEGEND_SIZE, FontStyle::Normal))
            .color(&ink)
            .pos(Pos::new(HPos::Left, VPos::Center));
        let widths: Vec<i32> = p
            .series
            .iter()
            .map(|(s, _)| SWATCH_W + 8 + text_width(root, &s.label, &legend, LEGEND_SIZE, mode))
            .collect();
        let rows = legend_rows(&widths, WIDTH as i32 - 2 * MARGIN);
        for (r, (row, row_width)) in rows.iter().enumerate() {
            let left = (WIDTH as i32 - row_width) / 2;
            let y = (TITLE_H + LEGEND_ROW_H / 2 + r as u32 * LEGEND_ROW_H) as i32;
            for &(i, offset) in row {
                let s = p.series[i].0;
                draw_swatch(root, s, (left + offset, y))?;
                root.draw_text(&s.label, &legend, (left + offset + SWATCH_W + 8, y))?;
            }
        }
        TITLE_H + rows.len() as u32 * LEGEND_ROW_H + 6
    };

    let (_, plot_area) = root.split_vertically(header_h);
    let (y_bold, y_light, y_fmt) = y_axis(p.y, p.spec.y_scale);
    let y_coord = TickedAxis {
        inner: RangedCoordf64::from(p.y.0..p.y.1),
        bold: y_bold,
        light: y_light,
    };
    let mut chart = ChartBuilder::on(&plot_area)
        .margin_left(MARGIN as u32 / 2)
        .margin_right(MARGIN as u32 + 8)
        .margin_bottom(10)
        .margin_top(4)
        .x_label_area_size(56)
        .y_label_area_size(96)
        .build_cartesian_2d(p.x.0..p.x.1, y_coord)?;

    let x_fmt = linear_ticks(p.x, X_TICKS);
    let labels = TextStyle::from(font(LABEL_SIZE, FontStyle::Normal)).color(&ink);
    let desc = TextStyle::from(font(DESC_SIZE, FontStyle::Normal)).color(&ink);
    chart
        .configure_mesh()
        .x_labels(X_TICKS)
        .y_labels(Y_TICKS)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .x_desc(p.spec.x_desc.as_str())
        .y_desc(p.spec.y_desc.as_str())
        .label_style(labels)
        .axis_desc_style(desc)
        .bold_line_style(RGBColor(215, 215, 215))
        .light_line_style(RGBColor(242, 242, 242))
        .max_light_lines(4)
        .axis_style(RGBColor(90, 90, 90))
        .draw()?;

    let plot_width = chart.plotting_area().dim_in_pixel().0 as usize;
    for (s, segments) in &p.series {
        let c = s.color;
        for seg in segments {
            // One point per pixel step: points on one pixel give a thick line's joins no
            // direction, and plotters then draws spikes to the corner.
            let mut pts: Vec<(f64, f64)> = Vec::with_capacity(seg.len());
            let mut px: Vec<(i32, i32)> = Vec::with_capacity(seg.len());
            for &pt in seg {
                let at = chart.backend_coord(&pt);
                if px.last() != Some(&at) {
                    pts.push(pt);
                    px.push(at);
                }
            }
            let width = line_width(&px, plot_width);
            match s.style {
                Style::Line => stroke(&mut chart, &pts, c.stroke_width(width), raster)?,
                Style::Faint => stroke(&mut chart, &pts, pale(c).stroke_width(1), raster)?,
                Style::Dashed => {
                    chart.draw_series(DashedLineSeries::new(
                        pts.iter().copied(),
                        10,
                        6,
                        c.stroke_width(2),
                    ))?;
                }
                Style::Markers => {
                    stroke(&mut chart, &pts, c.stroke_width(width), raster)?;
                    chart.draw_series(pts.iter().map(|&pt| Circle::new(pt, 4, c.filled())))?;
                }
            }
            // A lone point draws no line: mark it.
            if pts.len() == 1 && s.style != Style::Markers {
                chart.draw_series(pts.iter().map(|&pt| Circle::new(pt, 4, c.filled())))?;
            }
        }
    }
    Ok(())
}

/// 2 px, or 1 px for a dense series that zigzags by more than a pixel or two (a thick one
/// would be a solid band).
fn line_width(px: &[(i32, i32)], plot_width: usize) -> u32 {
    if px.len() * DENSE_PX_PER_POINT <= plot_width {
        return 2;
    }
    let turns = px
        .windows(3)
        .filter(|w| {
            let (a, b) = (w[1].1 - w[0].1, w[2].1 - w[1].1);
            a.signum() * b.signum() < 0 && a.abs().min(b.abs()) > 2
        })
        .count();
    if turns * 5 > px.len() {
        1
    } else {
        2
    }
}

/// `c` blended with white, opaque: overlapping strokes of a dense pale line stay pale.
fn pale(c: RGBColor) -> RGBColor {
    let blend = |v: u8| 255 - ((255.0 - f64::from(v)) * 0.35).round() as u8;
    RGBColor(blend(c.0), blend(c.1), blend(c.2))
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, TickedAxis>>;

/// Draw a polyline. On a raster a thick polyline is drawn segment by segment: plotters fills a
/// thick path as one polygon whose joins spike where the path doubles back sharply.
fn stroke<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    pts: &[(f64, f64)],
    style: ShapeStyle,
    raster: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    if raster && style.stroke_width > 1 && pts.len() > 2 {
        chart.draw_series(
            pts.windows(2)
                .map(|w| PathElement::new(vec![w[0], w[1]], style)),
        )?;
    } else {
        chart.draw_series(LineSeries::new(pts.iter().copied(), style))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with(points: Vec<(f64, f64)>, scale: Scale) -> ChartSpec {
        let mut spec = ChartSpec::new("t", "Title", "x", "y");
        spec.y_scale = scale;
        spec.series
            .push(Series::new("s", color(0), Style::Line, points));
        spec
    }

    #[test]
    fn non_finite_points_are_left_out_and_counted() {
        let spec = spec_with(
            vec![
                (0.0, 1.0),
                (1.0, f64::NAN),
                (2.0, f64::INFINITY),
                (3.0, 2.0),
            ],
            Scale::Linear,
        );
        let p = prepare(&spec).unwrap();
        assert_eq!(p.omitted, 2);
        assert_eq!(p.series[0].1, vec![vec![(0.0, 1.0), (3.0, 2.0)]]);
        assert!(p.y.0 < 1.0 && p.y.1 > 2.0);
    }

    #[test]
    fn nothing_finite_means_no_chart() {
        let spec = spec_with(vec![(0.0, f64::NAN)], Scale::Linear);
        assert!(prepare(&spec).unwrap_err().contains("NaN"));
        let spec = spec_with(vec![(0.0, 0.0), (1.0, -1.0)], Scale::Log);
        assert!(prepare(&spec).unwrap_err().contains("not positive"));
        let spec = spec_with(vec![], Scale::Linear);
        assert_eq!(prepare(&spec).unwrap_err(), "no data");
    }

    #[test]
    fn single_point_gets_a_real_range() {
        let spec = spec_with(vec![(5.0, 0.0)], Scale::Linear);
        let p = prepare(&spec).unwrap();
        assert!(p.x.0 < 5.0 && p.x.1 > 5.0);
        assert!(p.y.0 < 0.0 && p.y.1 > 0.0);
        let spec = spec_with(vec![(5.0, 1e-3)], Scale::Log);
        let p = prepare(&spec).unwrap();
        assert!(p.y.0 < -3.0 && p.y.1 > -3.0);
    }

    #[test]
    fn included_values_pin_the_range() {
        let mut spec = spec_with(vec![(0.0, 20.0), (1.0, 40.0)], Scale::Linear);
        spec.y_include = vec![0.0, 100.0];
        let p = prepare(&spec).unwrap();
        assert!(p.y.0 <= 0.0 && p.y.0 > -2.0, "{:?}", p.y);
        assert!(p.y.1 >= 100.0 && p.y.1 < 102.0, "{:?}", p.y);
    }

    #[test]
    fn gaps_split_lines() {
        let pts = vec![
            (0.0, 1.0),
            (1.0, 1.0),
            (2.0, 1.0),
            (100.0, 1.0),
            (101.0, 1.0),
        ];
        assert_eq!(split_at_gaps(pts.clone(), true).len(), 2);
        assert_eq!(split_at_gaps(pts, false).len(), 1);
    }

    #[test]
    fn averaging_bounds_the_point_count() {
        let pts: Vec<(f64, f64)> = (0..1000).map(|i| (i as f64, (i % 2) as f64)).collect();
        let (avg, run) = average(pts.clone(), 100);
        assert_eq!((avg.len(), run), (100, 10));
        assert!(avg.iter().all(|p| (p.1 - 0.5).abs() < 1e-12));
        assert_eq!(average(pts, 5000).1, 1);

        let mut spec = spec_with((0..1000).map(|i| (i as f64, 1.0)).collect(), Scale::Linear);
        spec.mean_points = Some(100);
        let p = prepare(&spec).unwrap();
        assert_eq!(p.averaged, 10);
        assert_eq!(p.series[0].1[0].len(), 100);
    }

    #[test]
    fn thinning_keeps_extremes() {
        let mut pts: Vec<(f64, f64)> = (0..100_000).map(|i| (i as f64, 1.0)).collect();
        pts[54_321].1 = 50.0;
        pts[7].1 = -50.0;
        let thinned = thin(pts, MAX_POINTS);
        assert!(thinned.len() <= MAX_POINTS + 2);
        assert!(thinned.contains(&(54_321.0, 50.0)));
        assert!(thinned.contains(&(7.0, -50.0)));
        assert!(thinned.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn tick_labels_are_short_and_exact() {
        let f = linear_ticks((0.0, 1.0), 10);
        assert_eq!(f(&0.30000000000000004), "0.3");
        assert_eq!(f(&0.0), "0");
        let f = linear_ticks((0.0, 120_000.0), 10);
        assert_eq!(f(&40_000.0), "40k");
        let f = linear_ticks((0.0, 6e-4), 10);
        assert_eq!(f(&3e-4), "3e-4");
        let f = linear_ticks((2.0, 3.0), 10);
        assert_eq!(f(&2.5), "2.5");
        assert_eq!(significant(10f64.powf(-3.0), 2), "1e-3");
        assert_eq!(significant(0.0316, 2), "0.032");
        assert_eq!(significant(31.6, 2), "32");
        assert_eq!(significant(12_345.0, 2), "1.2e4");
        assert_eq!(significant(3.1e-5, 3), "3.1e-5");
        assert_eq!(significant(2.0, 3), "2");
    }

    #[test]
    fn log_ticks_sit_on_round_values() {
        let label = |v: &f64| significant(10f64.powf(*v), 2);
        // Five decades: one tick per decade.
        let (bold, light) = log_ticks((-5.2, -0.5)).unwrap();
        let labels: Vec<String> = bold.iter().map(label).collect();
        assert_eq!(labels, ["1e-5", "1e-4", "1e-3", "0.01", "0.1"]);
        assert!(light.len() > bold.len());
        // One decade: 1-2-5.
        let (bold, _) = log_ticks((-3.05, -1.9)).unwrap();
        let labels: Vec<String> = bold.iter().map(label).collect();
        assert_eq!(labels, ["1e-3", "2e-3", "5e-3", "0.01"]);
        // A narrow range: integer multiples.
        let (bold, light) = log_ticks((0.25, 0.72)).unwrap();
        let labels: Vec<String> = bold.iter().map(label).collect();
        assert_eq!(labels, ["2", "3", "4", "5"]);
        assert!(light.is_empty());
        // Narrower still: no round values, the caller falls back.
        assert!(log_ticks((0.31, 0.33)).is_none());
    }

    #[test]
    fn legend_wraps_into_rows() {
        let rows = legend_rows(&[400, 400, 400], 1000);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, vec![(0, 0), (1, 426)]);
        assert_eq!(rows[1].0, vec![(2, 0)]);
    }

    /// Without a registered font: the PNG has no text but is still drawn, the SVG keeps its
    /// text. The family below is never registered, so this holds whatever fonts exist.
    #[test]
    fn charts_render_without_a_font() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = spec_with(vec![(0.0, 3.0), (10.0, 2.0), (20.0, 1.5)], Scale::Log);
        spec.title = "No font here".into();
        let fonts = Fonts {
            family: "cockpit-unregistered-family",
            loaded: false,
        };
        let mut summary = PlotSummary::default();
        render_all(vec![Ok(spec)], dir.path(), fonts, &mut summary).unwrap();
        assert_eq!(summary.written.len(), 2);
        let png = std::fs::read(dir.path().join("t.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(dir.path().join("t.svg")).unwrap();
        assert!(svg.contains("No font here"));
        assert!(svg.contains("<text"));
    }
}
