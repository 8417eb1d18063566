//! Telemetry charts (GPU and host over time), for monitor sessions and for runs.

use std::collections::BTreeMap;
use std::path::Path;

use super::chart::{color, render_all, ChartSpec, Fonts, Planned, Series, Style};
use super::font::font_status;
use super::{PlotSummary, ReportError};
use crate::telemetry::Snapshot;

const GIB: f64 = (1u64 << 30) as f64;
/// Telemetry lines longer than this are averaged down (about two pixels per point).
const MEAN_POINTS: usize = 600;

/// Chart names, in drawing order.
pub(crate) const GPU_UTIL: &str = "gpu_util";
pub(crate) const GPU_MEMORY: &str = "gpu_memory";
pub(crate) const HOST_CPU: &str = "host_cpu";
pub(crate) const HOST_RAM: &str = "host_ram";

pub(crate) fn plot_monitor(
    snapshots: &[Snapshot],
    out_dir: &Path,
) -> Result<PlotSummary, ReportError> {
    let mut summary = PlotSummary::default();
    let planned = telemetry_charts(snapshots, "no snapshots");
    let status = font_status();
    render_all(planned, out_dir, Fonts::from_status(status), &mut summary)?;
    if let (Some(notice), false) = (status.notice(), summary.written.is_empty()) {
        summary.notices.push(notice.to_string());
    }
    Ok(summary)
}

/// GPU utilization, GPU memory, host CPU and host RAM over time; `empty_reason` says why
/// every chart is skipped when there are no snapshots.
pub(crate) fn telemetry_charts(snapshots: &[Snapshot], empty_reason: &str) -> Vec<Planned> {
    if snapshots.is_empty() {
        return [GPU_UTIL, GPU_MEMORY, HOST_CPU, HOST_RAM]
            .into_iter()
            .map(|name| Err((name, empty_reason.to_string())))
            .collect();
    }
    let axis = TimeAxis::new(snapshots);
    vec![
        gpu_util(snapshots, &axis),
        gpu_memory(snapshots, &axis),
        host_cpu(snapshots, &axis),
        host_ram(snapshots, &axis),
    ]
}

/// Seconds since the first snapshot, in a unit that suits the session's length.
struct TimeAxis {
    t0_ms: u64,
    unit_s: f64,
    desc: String,
}

impl TimeAxis {
    fn new(snapshots: &[Snapshot]) -> Self {
        let t0_ms = snapshots.iter().map(|s| s.timestamp_ms).min().unwrap_or(0);
        let t1_ms = snapshots.iter().map(|s| s.timestamp_ms).max().unwrap_or(0);
        let span_s = t1_ms.saturating_sub(t0_ms) as f64 / 1000.0;
        let (unit_s, unit) = if span_s <= 300.0 {
            (1.0, "s")
        } else if span_s <= 3.0 * 3600.0 {
            (60.0, "min")
        } else {
            (3600.0, "h")
        };
        TimeAxis {
            t0_ms,
            unit_s,
            desc: format!("time since first sample ({unit})"),
        }
    }

    fn x(&self, snapshot: &Snapshot) -> f64 {
        snapshot.timestamp_ms.saturating_sub(self.t0_ms) as f64 / 1000.0 / self.unit_s
    }

    fn chart(&self, name: &'static str, title: &str, y_desc: &str) -> ChartSpec {
        let mut spec = ChartSpec::new(name, title, self.desc.clone(), y_desc);
        spec.break_gaps = true;
        spec.mean_points = Some(MEAN_POINTS);
        spec
    }
}

/// One GPU's points, keyed by index; the name and memory size come from its latest sample.
#[derive(Default)]
struct GpuTrack {
    name: String,
    total_bytes: u64,
    points: Vec<(f64, f64)>,
}

fn per_gpu(
    snapshots: &[Snapshot],
    axis: &TimeAxis,
    value: impl Fn(&crate::telemetry::GpuSample) -> Option<f64>,
) -> BTreeMap<u32, GpuTrack> {
    let mut tracks: BTreeMap<u32, GpuTrack> = BTreeMap::new();
    for snap in snapshots {
        let x = axis.x(snap);
        for gpu in &snap.gpus {
            let track = tracks.entry(gpu.index).or_default();
            track.name = gpu.name.clone();
            track.total_bytes = track.total_bytes.max(gpu.mem_total_bytes);
            if let Some(v) = value(gpu) {
                track.points.push((x, v));
            }
        }
    }
    tracks.retain(|_, t| !t.points.is_empty());
    tracks
}

fn gpu_label(index: u32, name: &str) -> String {
    let short = name.strip_prefix("NVIDIA ").unwrap_or(name).trim();
    if short.is_empty() {
        format!("GPU{index}")
    } else {
        format!("GPU{index} {short}")
    }
}

/// Why there is no GPU chart: the sampler's notice when it left one.
fn no_gpu_reason(snapshots: &[Snapshot], what: &str) -> String {
    match snapshots.iter().rev().find_map(|s| s.gpu_notice.as_deref()) {
        Some(notice) => format!("no GPU {what} samples ({notice})"),
        None => format!("no GPU {what} samples"),
    }
}

fn gpu_util(snapshots: &[Snapshot], axis: &TimeAxis) -> Planned {
    let tracks = per_gpu(snapshots, axis, |g| g.util_gpu.map(f64::from));
    if tracks.is_empty() {
        return Err((GPU_UTIL, no_gpu_reason(snapshots, "utilization")));
    }
    let mut spec = axis.chart(GPU_UTIL, "GPU utilization", "utilization (%)");
    spec.y_include = vec![0.0, 100.0];
    for (i, (index, track)) in tracks.into_iter().enumerate() {
        spec.series.push(Series::new(
            gpu_label(index, &track.name),
            color(i),
            Style::Line,
            track.points,
        ));
    }
    Ok(spec)
}

fn gpu_memory(snapshots: &[Snapshot], axis: &TimeAxis) -> Planned {
    let tracks = per_gpu(snapshots, axis, |g| {
        (g.mem_total_bytes > 0).then(|| g.mem_used_bytes as f64 / GIB)
    });
    if tracks.is_empty() {
        return Err((GPU_MEMORY, no_gpu_reason(snapshots, "memory")));
    }
    let mut spec = axis.chart(GPU_MEMORY, "GPU memory used", "memory used (GiB)");
    let max_total = tracks.values().map(|t| t.total_bytes).max().unwrap_or(0) as f64 / GIB;
    spec.y_include = vec![0.0, max_total];
    for (i, (index, track)) in tracks.into_iter().enumerate() {
        let label = format!(
            "{} (of {:.0} GiB)",
            gpu_label(index, &track.name),
            track.total_bytes as f64 / GIB
        );
        spec.series
            .push(Series::new(label, color(i), Style::Line, track.points));
    }
    Ok(spec)
}

fn host_cpu(snapshots: &[Snapshot], axis: &TimeAxis) -> Planned {
    if snapshots
        .iter()
        .all(|s| s.host.cpu_cores == 0 && s.host.cpu_pct == 0.0)
    {
        return Err((HOST_CPU, "no host CPU samples".to_string()));
    }
    let cores = snapshots
        .iter()
        .map(|s| s.host.cpu_cores)
        .max()
        .unwrap_or(0);
    let mut spec = axis.chart(HOST_CPU, "Host CPU", "CPU busy (% of all cores)");
    spec.y_include = vec![0.0, 100.0];
    let points = snapshots
        .iter()
        .map(|s| (axis.x(s), s.host.cpu_pct))
        .collect();
    spec.series.push(Series::new(
        format!("CPU ({cores} cores)"),
        color(0),
        Style::Line,
        points,
    ));
    Ok(spec)
}

fn host_ram(snapshots: &[Snapshot], axis: &TimeAxis) -> Planned {
    let with_ram: Vec<&Snapshot> = snapshots
        .iter()
        .filter(|s| s.host.ram_total_bytes > 0)
        .collect();
    if with_ram.is_empty() {
        return Err((HOST_RAM, "no host memory samples".to_string()));
    }
    let total = with_ram
        .iter()
        .map(|s| s.host.ram_total_bytes)
        .max()
        .unwrap_or(0) as f64
        / GIB;
    let mut spec = axis.chart(HOST_RAM, "Host memory", "memory (GiB)");
    spec.y_include = vec![0.0, total];
    let used = with_ram
        .iter()
        .map(|s| (axis.x(s), s.host.ram_used_bytes as f64 / GIB))
        .collect();
    spec.series.push(Series::new(
        format!("used (of {total:.0} GiB)"),
        color(0),
        Style::Line,
        used,
    ));
    if with_ram.iter().any(|s| s.host.self_rss_bytes > 0) {
        let rss = with_ram
            .iter()
            .map(|s| (axis.x(s), s.host.self_rss_bytes as f64 / GIB))
            .collect();
        spec.series
            .push(Series::new("cockpit RSS", color(1), Style::Line, rss));
    }
    Ok(spec)
}
