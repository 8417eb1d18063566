//! A chart's points before drawing: the axis ranges they set, lines broken at gaps, and long
//! series averaged or thinned (each bucket's extremes kept, so spikes survive).

/// A gap between consecutive x values this many times the median gap breaks the line.
const GAP_FACTOR: f64 = 10.0;

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Tight x range; a single x gets a unit either side.
pub(super) fn x_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    match min_max(values) {
        Some((lo, hi)) if hi > lo => (lo, hi),
        Some((v, _)) => (v - 1.0, v + 1.0),
        None => (0.0, 1.0),
    }
}

/// y range with 5% headroom on the sides the data sets, hugging the values in `include`;
/// a flat series gets a band around its value.
pub(super) fn y_range(values: impl Iterator<Item = f64>, include: &[f64], log: bool) -> (f64, f64) {
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
pub(super) fn split_at_gaps(points: Vec<(f64, f64)>, enabled: bool) -> Vec<Vec<(f64, f64)>> {
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
pub(super) fn average(points: Vec<(f64, f64)>, max: usize) -> (Vec<(f64, f64)>, usize) {
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
pub(super) fn thin(points: Vec<(f64, f64)>, max: usize) -> Vec<(f64, f64)> {
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

#[cfg(test)]
mod tests {
    use super::super::MAX_POINTS;
    use super::*;

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
}
