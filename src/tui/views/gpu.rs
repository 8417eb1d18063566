//! GPU panels (utilisation and memory gauges with sparklines, temperature, power, clocks),
//! and the host panel shown when there is no GPU telemetry.

use super::panel;
use super::plot::{Plot, Trace, XScale, YScale};
use crate::tui::fmt;
use crate::tui::state::{GpuState, Ring, TelemetryState};
use crate::tui::theme::{Level, Theme};
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::symbols;
use ratatui::text::{Line, Span};
use ratatui::widgets::{LineGauge, Paragraph, RenderDirection, Sparkline, Widget};

/// Rows one panel takes, borders included.
pub const PANEL_HEIGHT: u16 = 5;
/// Panels narrower than this drop the sparklines.
const SPARK_MIN_WIDTH: u16 = 46;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Memory fill level.
fn mem_level(frac: f64) -> Level {
    Level::from_thresholds(frac, 0.90, 0.97)
}

/// One labelled gauge with an optional history sparkline beside it.
struct MeterRow<'a> {
    label: String,
    ratio: f64,
    style: Style,
    history: Option<&'a Ring<u64>>,
    theme: &'a Theme,
}

impl Widget for MeterRow<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let colors = self.theme.colors();
        let (gauge_area, spark_area) = if area.width >= SPARK_MIN_WIDTH && self.history.is_some() {
            let gauge_width = area.width * 11 / 20;
            let [g, _, s] = Layout::horizontal([
                Constraint::Length(gauge_width),
                Constraint::Length(1),
                Constraint::Fill(1),
            ])
            .areas(area);
            (g, Some(s))
        } else {
            (area, None)
        };
        LineGauge::default()
            .ratio(self.ratio.clamp(0.0, 1.0))
            .label(Span::raw(self.label))
            .filled_symbol(symbols::line::THICK_HORIZONTAL)
            .unfilled_symbol(symbols::line::HORIZONTAL)
            .filled_style(self.style)
            .unfilled_style(Style::new().fg(colors.border))
            .render(gauge_area, buf);
        if let (Some(spark_area), Some(history)) = (spark_area, self.history) {
            // newest at the right edge: drawn right to left from the newest value
            let mut data: Vec<u64> = history.last_n(usize::from(spark_area.width)).collect();
            data.reverse();
            Sparkline::default()
                .direction(RenderDirection::RightToLeft)
                .data(&data)
                .max(100)
                .style(self.style)
                .render(spark_area, buf);
        }
    }
}

/// One series of a [`TimeChart`]: a name for the legend, a colour, and (seconds before the
/// latest sample, value) points.
struct TimeSeries {
    name: &'static str,
    style: Style,
    points: Vec<(f64, f64)>,
}

/// Histories on a 0–100 scale against a time axis (seconds before the latest sample), with
/// a legend row on top; fills spare panel rows.
struct TimeChart<'a> {
    series: Vec<TimeSeries>,
    theme: &'a Theme,
}

impl TimeChart<'_> {
    /// `(seconds before the last time, value)` for each time and value; NaNs left out.
    fn points(times: &[u64], values: impl Iterator<Item = f64>) -> Vec<(f64, f64)> {
        let last = times.last().copied().unwrap_or(0);
        times
            .iter()
            .zip(values)
            .filter(|(_, v)| v.is_finite())
            .map(|(&at, v)| {
                (
                    at as f64 / 1000.0 - last as f64 / 1000.0,
                    v.clamp(0.0, 100.0),
                )
            })
            .collect()
    }
}

impl Widget for TimeChart<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        // a legend row, two graph rows, the axis and its labels
        if area.height < 5 || area.width < 16 {
            return;
        }
        let series: Vec<TimeSeries> = self
            .series
            .into_iter()
            .filter(|s| !s.points.is_empty())
            .collect();
        let first = series
            .iter()
            .filter_map(|s| s.points.first().map(|p| p.0))
            .fold(0.0, f64::min);
        let x_range = (!series.is_empty()).then_some((first.min(-1.0), 0.0));
        let mut title = vec![vec![Span::styled("history ", self.theme.muted())]];
        for s in &series {
            title.push(vec![Span::styled(format!("━ {} ", s.name), s.style)]);
        }
        Plot {
            title,
            bordered: false,
            traces: series
                .iter()
                .map(|s| Trace::Line {
                    points: &s.points,
                    style: s.style,
                    dashed: false,
                })
                .collect(),
            x_range,
            x_scale: XScale::Seconds,
            x_label: fmt::ago,
            x_title: "time",
            y_scale: YScale::Linear,
            y_label: |v, _| format!("{v:.0}"),
            y_range: Some((0.0, 100.0)),
            marks: Vec::new(),
            empty_text: "",
            theme: self.theme,
        }
        .render(area, buf);
    }
}

/// Pads labels to one width so the gauges line up.
fn pad_labels<const N: usize>(labels: [String; N]) -> [String; N] {
    let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    labels.map(|l| format!("{l:<width$}"))
}

/// One GPU.
pub struct GpuPanelView<'a> {
    /// The GPU to draw.
    pub gpu: &'a GpuState,
    /// Whether the panel has the focus (thick accent border).
    pub focused: bool,
    /// `(position, count)` shown in the title when not every GPU fits.
    pub position: Option<(usize, usize)>,
    /// Colours.
    pub theme: &'a Theme,
}

impl GpuPanelView<'_> {
    fn info_line(&self) -> Line<'static> {
        let t = self.theme;
        let s = &self.gpu.sample;
        let sep = || Span::styled(" · ", t.muted());
        let mut spans: Vec<Span<'static>> = Vec::new();
        match s.temperature_c {
            Some(temp) => spans.push(Span::styled(
                format!("{temp}°C"),
                t.level(Level::from_thresholds(f64::from(temp), 80.0, 88.0)),
            )),
            None => spans.push(Span::styled("--°C", t.muted())),
        }
        if let Some(power) = s.power_w {
            spans.push(sep());
            match s.power_limit_w.filter(|l| *l > 0.0) {
                Some(limit) => spans.push(Span::styled(
                    format!("{power:.0}/{limit:.0} W"),
                    t.level(Level::from_thresholds(power / limit, 0.95, 1.0)),
                )),
                None => spans.push(Span::raw(format!("{power:.0} W"))),
            }
        }
        if let Some(sm) = s.sm_clock_mhz {
            spans.push(sep());
            spans.push(Span::raw(format!("SM {sm} MHz")));
        }
        if let Some(fan) = s.fan_pct {
            spans.push(sep());
            spans.push(Span::raw(format!("fan {fan}%")));
        }
        if !s.throttle_reasons.is_empty() {
            spans.push(sep());
            spans.push(Span::styled(
                format!("throttle: {}", s.throttle_reasons.join(", ")),
                t.level(Level::Warn),
            ));
        }
        Line::from(spans)
    }
}

impl Widget for GpuPanelView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let s = &self.gpu.sample;
        let title = match self.position {
            Some((pos, count)) => format!(" GPU{} ({}/{count}) · {} ", s.index, pos + 1, s.name),
            None => format!(" GPU{} · {} ", s.index, s.name),
        };
        let title = super::elide(&title, usize::from(area.width.saturating_sub(2)));
        let block = panel(title, t, self.focused);
        let inner = block.inner(area);
        block.render(area, buf);
        if inner.height == 0 {
            return;
        }

        let util_text = s.util_gpu.map_or("n/a".to_string(), |u| format!("{u}%"));
        let mem_frac = s.mem_used_frac();
        let [util_label, mem_label] = pad_labels([
            format!("util {util_text:>4}"),
            format!(
                "mem  {:.1}/{:.1} GiB",
                s.mem_used_bytes as f64 / GIB,
                s.mem_total_bytes as f64 / GIB
            ),
        ]);
        let rows = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Fill(1),
        ])
        .split(inner);
        MeterRow {
            label: util_label,
            ratio: f64::from(s.util_gpu.unwrap_or(0)) / 100.0,
            style: t.accent(),
            history: Some(&self.gpu.util),
            theme: t,
        }
        .render(rows[0], buf);
        MeterRow {
            label: mem_label,
            ratio: mem_frac,
            style: t.level(mem_level(mem_frac)),
            history: Some(&self.gpu.mem),
            theme: t,
        }
        .render(rows[1], buf);
        let info = super::elide_spans(self.info_line().spans, usize::from(rows[2].width));
        Paragraph::new(Line::from(info)).render(rows[2], buf);
        let history: Vec<_> = self.gpu.history.iter().collect();
        let times: Vec<u64> = history.iter().map(|p| p.at_ms).collect();
        let c = t.colors();
        TimeChart {
            series: vec![
                TimeSeries {
                    name: "util %",
                    style: t.accent(),
                    points: TimeChart::points(&times, history.iter().map(|p| p.util)),
                },
                TimeSeries {
                    name: "mem %",
                    style: Style::new().fg(c.lr),
                    points: TimeChart::points(&times, history.iter().map(|p| p.mem)),
                },
                TimeSeries {
                    name: "°C",
                    style: t.level(Level::Warn),
                    points: TimeChart::points(&times, history.iter().map(|p| p.temp)),
                },
                TimeSeries {
                    name: "power %",
                    style: Style::new().fg(c.s_ratio),
                    points: TimeChart::points(&times, history.iter().map(|p| p.power)),
                },
            ],
            theme: t,
        }
        .render(rows[3], buf);
    }
}

/// The host (CPU and RAM), with the reason GPU telemetry is missing.
pub struct HostPanelView<'a> {
    /// Host sample, histories and the GPU notice.
    pub telemetry: &'a TelemetryState,
    /// Colours.
    pub theme: &'a Theme,
}

impl Widget for HostPanelView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let t = self.theme;
        let host = &self.telemetry.host;
        let title = if host.cpu_cores > 0 {
            format!(" host · {} cores ", host.cpu_cores)
        } else {
            " host ".to_string()
        };
        let block = panel(title, t, false);
        let inner = block.inner(area);
        block.render(area, buf);
        if inner.height == 0 {
            return;
        }
        let notice = match (&self.telemetry.gpu_notice, self.telemetry.updates) {
            (_, 0) => Span::styled("waiting for telemetry…", t.muted()),
            // The first clause fits a panel ("NVML not available"); the details are in the log.
            (Some(n), _) => Span::styled(
                format!("no GPU telemetry: {}", n.split(" (").next().unwrap_or(n)),
                t.level(Level::Warn),
            ),
            (None, _) => Span::styled("no GPU telemetry: no GPUs reported", t.level(Level::Warn)),
        };
        let ram_frac = if host.ram_total_bytes == 0 {
            0.0
        } else {
            host.ram_used_bytes as f64 / host.ram_total_bytes as f64
        };
        let [cpu_label, ram_label] = pad_labels([
            format!("cpu {:>4.0}%", host.cpu_pct),
            format!(
                "ram {:.1}/{:.1} GiB",
                host.ram_used_bytes as f64 / GIB,
                host.ram_total_bytes as f64 / GIB
            ),
        ]);
        let rows = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Length(1),
            Constraint::Fill(1),
        ])
        .split(inner);
        let notice = super::elide_spans(vec![notice], usize::from(rows[0].width));
        Paragraph::new(Line::from(notice)).render(rows[0], buf);
        if self.telemetry.updates == 0 {
            return;
        }
        MeterRow {
            label: cpu_label,
            ratio: host.cpu_pct / 100.0,
            style: t.accent(),
            history: Some(&self.telemetry.host_cpu),
            theme: t,
        }
        .render(rows[1], buf);
        MeterRow {
            label: ram_label,
            ratio: ram_frac,
            style: t.level(mem_level(ram_frac)),
            history: Some(&self.telemetry.host_ram),
            theme: t,
        }
        .render(rows[2], buf);
        let times: Vec<u64> = self.telemetry.host_times.iter().collect();
        let series = |ring: &Ring<u64>| TimeChart::points(&times, ring.iter().map(|v| v as f64));
        TimeChart {
            series: vec![
                TimeSeries {
                    name: "cpu %",
                    style: t.accent(),
                    points: series(&self.telemetry.host_cpu),
                },
                TimeSeries {
                    name: "ram %",
                    style: Style::new().fg(t.colors().lr),
                    points: series(&self.telemetry.host_ram),
                },
            ],
            theme: t,
        }
        .render(rows[3], buf);
    }
}

/// Every GPU panel that fits, keeping the focused one in view; the host panel when there
/// are no GPUs.
pub struct GpuColumnView<'a> {
    /// GPUs (or the host) to draw.
    pub telemetry: &'a TelemetryState,
    /// Index of the focused GPU.
    pub focus: usize,
    /// Share spare rows among the panels (they draw taller utilisation histories).
    pub stretch: bool,
    /// Colours.
    pub theme: &'a Theme,
}

impl GpuColumnView<'_> {
    /// Rows needed to show every panel.
    pub fn wanted_height(telemetry: &TelemetryState) -> u16 {
        PANEL_HEIGHT * telemetry.gpus.len().max(1) as u16
    }
}

impl Widget for GpuColumnView<'_> {
    fn render(self, area: Rect, buf: &mut Buffer) {
        let gpus = &self.telemetry.gpus;
        if gpus.is_empty() {
            let height = if self.stretch {
                area.height
            } else {
                PANEL_HEIGHT.min(area.height)
            };
            HostPanelView {
                telemetry: self.telemetry,
                theme: self.theme,
            }
            .render(Rect { height, ..area }, buf);
            return;
        }
        let fits = usize::from((area.height / PANEL_HEIGHT).max(1));
        let focus = self.focus.min(gpus.len() - 1);
        let start = if focus < fits { 0 } else { focus + 1 - fits };
        let all_fit = fits >= gpus.len();
        let panel_height = if self.stretch && all_fit {
            area.height / gpus.len() as u16
        } else {
            PANEL_HEIGHT
        };
        for (slot, (i, gpu)) in gpus.iter().enumerate().skip(start).take(fits).enumerate() {
            let y = area.y + slot as u16 * panel_height;
            let height = panel_height.min(area.bottom().saturating_sub(y));
            GpuPanelView {
                gpu,
                focused: i == focus && gpus.len() > 1,
                position: (!all_fit).then_some((i, gpus.len())),
                theme: self.theme,
            }
            .render(Rect { y, height, ..area }, buf);
        }
    }
}
