//! One line chart, described once and drawn the same way to PNG and SVG.
//!
//! Layout, top to bottom: a bold title, a legend that wraps over as many rows as it needs
//! (it never covers data), then the plot with its axes. Points that are NaN or infinite (or
//! not positive on a log axis) are left out and counted; long series are thinned to a few
//! thousand points keeping each bucket's extremes, so spikes survive. This file prepares and
//! draws the chart; the ranges, gaps and thinning of its points are points.rs's, its tick marks
//! and labels ticks.rs's.

mod points;
mod ticks;

use std::path::{Path, PathBuf};

use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::font::{FontStatus, FAMILY};
use super::{io_error, PlotSummary, ReportError};
use points::{average, split_at_gaps, thin, x_range, y_range};
use ticks::{linear_ticks, y_axis, TickedAxis};

/// Size of every chart in pixels.
pub(crate) const WIDTH: u32 = 1200;
pub(crate) const HEIGHT: u32 = 600;

const X_TICKS: usize = 10;
/// Labelled y ticks (ticks.rs places them).
const Y_TICKS: usize = 8;
/// Series longer than this are thinned before drawing.
const MAX_POINTS: usize = 4000;
/// Below this many pixels per point a zigzagging line is drawn one pixel wide.
const DENSE_PX_PER_POINT: usize = 4;

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
    fn averaging_sets_the_prepared_run_length() {
        let mut spec = spec_with((0..1000).map(|i| (i as f64, 1.0)).collect(), Scale::Linear);
        spec.mean_points = Some(100);
        let p = prepare(&spec).unwrap();
        assert_eq!(p.averaged, 10);
        assert_eq!(p.series[0].1[0].len(), 100);
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
