//! The charts of one run directory.

use std::path::Path;

use super::chart::{color, render_all, ChartSpec, Fonts, Planned, Scale, Series, Style};
use super::font::font_status;
use super::load::{load_metrics, load_telemetry, RunMetrics};
use super::monitor::{telemetry_charts, GPU_MEMORY, GPU_UTIL, HOST_CPU, HOST_RAM};
use super::{PlotSummary, ReportError, METRICS_FILE, PLOTS_DIR, TELEMETRY_FILE};

/// Series at least this long are drawn pale with a smoothed line over them.
const SMOOTH_MIN_POINTS: usize = 30;
const GREY: plotters::style::RGBColor = plotters::style::RGBColor(90, 90, 90);

pub(crate) fn plot_run(run_dir: &Path) -> Result<PlotSummary, ReportError> {
    let metrics_path = run_dir.join(METRICS_FILE);
    if !metrics_path.exists() {
        return Err(ReportError::MissingMetrics {
            dir: run_dir.to_path_buf(),
        });
    }
    let metrics = load_metrics(&metrics_path)?;
    let mut summary = PlotSummary::default();
    summary.notices.extend(metrics.warnings.iter().cloned());

    let mut planned = run_charts(&metrics);
    let telemetry_path = run_dir.join(TELEMETRY_FILE);
    if telemetry_path.exists() {
        // Telemetry is secondary: a damaged file costs its charts, not the whole report.
        match load_telemetry(&telemetry_path) {
            Ok(t) => {
                summary.notices.extend(t.warnings);
                planned.extend(telemetry_charts(
                    &t.snapshots,
                    "no snapshots in telemetry.jsonl",
                ));
            }
            Err(e) => {
                let reason = e.to_string();
                for name in [GPU_UTIL, GPU_MEMORY, HOST_CPU, HOST_RAM] {
                    planned.push(Err((name, reason.clone())));
                }
            }
        }
    } else {
        planned.extend(telemetry_charts(
            &[],
            "no telemetry.jsonl in the run directory",
        ));
    }

    let status = font_status();
    render_all(
        planned,
        &run_dir.join(PLOTS_DIR),
        Fonts::from_status(status),
        &mut summary,
    )?;
    if let (Some(notice), false) = (status.notice(), summary.written.is_empty()) {
        summary.notices.push(notice.to_string());
    }
    Ok(summary)
}

/// Loss, S-ratio, λ, learning rate and throughput, each a chart or a reason to skip it.
pub(crate) fn run_charts(m: &RunMetrics) -> Vec<Planned> {
    let name = m
        .info
        .as_ref()
        .map(|i| i.run_name.trim())
        .filter(|n| !n.is_empty());
    let title = |what: &str| match name {
        Some(n) => format!("{what} — {n}"),
        None => what.to_string(),
    };
    vec![
        loss(m, title("Loss")),
        s_ratio(m, title("SCU S-ratio")),
        lambda(m, title("SCU λ")),
        lr(m, title("Learning rate")),
        throughput(m, title("Throughput")),
    ]
}

fn loss(m: &RunMetrics, title: String) -> Planned {
    let train = m.train_loss();
    let val = m.val_loss();
    if train.is_empty() && val.is_empty() {
        return Err(("loss", "no step or eval events".into()));
    }
    let mut spec = ChartSpec::new("loss", title, "step", "loss (nats/token)");
    let x_span = train
        .iter()
        .chain(&val)
        .map(|p| p.0)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    spec.series.extend(smoothed("train", color(0), train));
    if !val.is_empty() {
        spec.series
            .push(Series::new("validation", color(1), Style::Markers, val));
    }
    let floor = m
        .info
        .as_ref()
        .and_then(|i| i.entropy_floor_bpt)
        .filter(|b| b.is_finite() && *b > 0.0)
        .map(|bpt| bpt * std::f64::consts::LN_2);
    if let Some(floor) = floor {
        spec.series.push(Series::new(
            format!("entropy floor ({floor:.3})"),
            GREY,
            Style::Dashed,
            vec![(x_span.0, floor), (x_span.1, floor)],
        ));
    }
    Ok(spec)
}

fn s_ratio(m: &RunMetrics, title: String) -> Planned {
    if m.scu.is_empty() {
        return Err(("s_ratio", "no SCU events".into()));
    }
    let pct = |pts: Vec<(f64, f64)>| pts.into_iter().map(|(x, y)| (x, y * 100.0)).collect();
    let mut spec = ChartSpec::new("s_ratio", title, "step", "S (%)");
    if m.scu.iter().any(|s| s.s_hat != s.s_ratio) {
        // Ŝ is the EMA of S that the controller acts on: draw S pale under it.
        spec.series
            .push(Series::new("S", color(0), Style::Faint, pct(m.s_ratio())));
        spec.series.push(Series::new(
            "Ŝ (smoothed, what the controller sees)",
            color(0),
            Style::Line,
            pct(m.s_hat()),
        ));
    } else {
        spec.series
            .push(Series::new("S", color(0), Style::Line, pct(m.s_ratio())));
    }
    let label = if m.scu.iter().any(|s| s.control) {
        "setpoint S*"
    } else {
        "setpoint S* (control off)"
    };
    spec.series.push(Series::new(
        label,
        color(3),
        Style::Dashed,
        hold(pct(m.setpoint())),
    ));
    Ok(spec)
}

fn lambda(m: &RunMetrics, title: String) -> Planned {
    if m.scu.is_empty() {
        return Err(("lambda", "no SCU events".into()));
    }
    let values = m.lambda();
    let log = values.iter().any(|(_, l)| l.is_finite() && *l > 0.0);
    let y_desc = if log { "λ (log scale)" } else { "λ" };
    let mut spec = ChartSpec::new("lambda", title, "step", y_desc);
    if log {
        spec.y_scale = Scale::Log;
    }
    spec.series
        .push(Series::new("λ", color(4), Style::Line, values));
    Ok(spec)
}

fn lr(m: &RunMetrics, title: String) -> Planned {
    if m.steps.is_empty() {
        return Err(("lr", "no step events".into()));
    }
    let mut spec = ChartSpec::new("lr", title, "step", "learning rate");
    spec.series
        .push(Series::new("learning rate", color(0), Style::Line, m.lr()));
    Ok(spec)
}

fn throughput(m: &RunMetrics, title: String) -> Planned {
    if m.steps.is_empty() {
        return Err(("throughput", "no step events".into()));
    }
    let mut spec = ChartSpec::new("throughput", title, "step", "tokens/s");
    spec.y_include = vec![0.0];
    spec.series
        .extend(smoothed("tokens/s", color(0), m.tokens_per_sec()));
    Ok(spec)
}

/// A long noisy series as a pale raw line plus a smoothed one; a short one as is.
fn smoothed(label: &str, c: plotters::style::RGBColor, points: Vec<(f64, f64)>) -> Vec<Series> {
    if points.is_empty() {
        return Vec::new();
    }
    if points.len() < SMOOTH_MIN_POINTS {
        return vec![Series::new(label, c, Style::Line, points)];
    }
    let span = (points.len() / 50).clamp(5, 200);
    let ema = ema(&points, span);
    vec![
        Series::new(format!("{label} (raw)"), c, Style::Faint, points),
        Series::new(format!("{label} (smoothed)"), c, Style::Line, ema),
    ]
}

/// Exponential moving average over `span` points, seeded with the first finite value;
/// non-finite values are skipped rather than poisoning the average.
fn ema(points: &[(f64, f64)], span: usize) -> Vec<(f64, f64)> {
    let alpha = 2.0 / (span as f64 + 1.0);
    let mut avg: Option<f64> = None;
    points
        .iter()
        .filter(|(_, y)| y.is_finite())
        .map(|&(x, y)| {
            let next = match avg {
                None => y,
                Some(a) => a + alpha * (y - a),
            };
            avg = Some(next);
            (x, next)
        })
        .collect()
}

/// A value that holds until the next point: vertical jumps where it changes, and only the
/// points where it changes (plus the last).
fn hold(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    let last = points.last().copied();
    for (x, y) in points {
        match out.last() {
            None => out.push((x, y)),
            Some(&(_, prev)) if prev != y => {
                out.push((x, prev));
                out.push((x, y));
            }
            Some(_) => {}
        }
    }
    if let (Some(end), Some(&tail)) = (last, out.last()) {
        if end.0 != tail.0 {
            out.push(end);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setpoint_holds_until_it_changes() {
        let pts = vec![(1.0, 1.0), (2.0, 1.0), (3.0, 2.0), (4.0, 2.0), (5.0, 2.0)];
        assert_eq!(
            hold(pts),
            vec![(1.0, 1.0), (3.0, 1.0), (3.0, 2.0), (5.0, 2.0)]
        );
        assert_eq!(hold(vec![(1.0, 1.0)]), vec![(1.0, 1.0)]);
        assert_eq!(hold(vec![]), vec![]);
    }

    #[test]
    fn ema_skips_non_finite_values() {
        let pts = vec![(0.0, 1.0), (1.0, f64::NAN), (2.0, 3.0)];
        let e = ema(&pts, 1);
        assert_eq!(e, vec![(0.0, 1.0), (2.0, 3.0)]);
    }
}
