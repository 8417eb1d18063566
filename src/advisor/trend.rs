//! Memory growth per step: the leak check shared by the advisor's `memory_climb` rule and
//! `cockpit bench --soak`.

/// Steps at the start of a run whose memory is not judged: allocator pools, kernel caches and
/// the optimizer state fill up there.
pub const WARMUP_STEPS: u64 = 20;

/// The growth of a memory series in bytes per step: the Theil–Sen slope (the median of the
/// pairwise slopes), so that a one-off spike (an evaluation, a checkpoint) or a single
/// release does not pass for a trend. `None` with fewer than two distinct steps.
pub fn bytes_per_step(points: &[(u64, u64)]) -> Option<f64> {
    // At most 64 points, evenly spaced: 2,016 pairs whatever the series' length.
    const MAX: usize = 64;
    let stride = points.len().div_ceil(MAX).max(1);
    let pts: Vec<(f64, f64)> = points
        .iter()
        .step_by(stride)
        .map(|&(s, b)| (s as f64, b as f64))
        .collect();
    let mut slopes = Vec::with_capacity(pts.len() * pts.len() / 2);
    for (i, a) in pts.iter().enumerate() {
        for b in &pts[i + 1..] {
            if b.0 != a.0 {
                slopes.push((b.1 - a.1) / (b.0 - a.0));
            }
        }
    }
    if slopes.is_empty() {
        return None;
    }
    slopes.sort_by(f64::total_cmp);
    let n = slopes.len();
    Some(if n % 2 == 1 {
        slopes[n / 2]
    } else {
        0.5 * (slopes[n / 2 - 1] + slopes[n / 2])
    })
}

/// A memory series judged for a leak.
#[derive(Clone, Debug, PartialEq)]
pub struct Climb {
    /// Growth per step (bytes).
    pub per_step: f64,
    /// First and last value judged (bytes), and the steps they were taken at.
    pub from: (u64, u64),
    pub to: (u64, u64),
    /// Fitted growth over the judged steps (bytes).
    pub growth: f64,
    /// `growth` over what counts as a leak: ≥ 1 is one.
    pub ratio: f64,
}

/// Judge the points after the warm-up: growth over the span is a leak when it exceeds both
/// `min_bytes` and `min_frac` of the first value judged. `None` with fewer than `min_points`
/// points after the warm-up.
pub fn judge(
    points: &[(u64, u64)],
    start_step: u64,
    min_points: usize,
    min_bytes: f64,
    min_frac: f64,
) -> Option<Climb> {
    let after: Vec<(u64, u64)> = points
        .iter()
        .copied()
        .filter(|&(s, _)| s > start_step + WARMUP_STEPS)
        .collect();
    if after.len() < min_points.max(2) {
        return None;
    }
    let per_step = bytes_per_step(&after)?;
    let (first, last) = (after[0], after[after.len() - 1]);
    let growth = per_step * (last.0 - first.0) as f64;
    let limit = min_bytes.max(min_frac * first.1 as f64).max(1.0);
    Some(Climb {
        per_step,
        from: first,
        to: last,
        growth,
        ratio: growth / limit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_straight_line_and_a_flat_series_with_spikes() {
        let line: Vec<(u64, u64)> = (0..300).map(|s| (s, 200_000_000 + s * 6_500_000)).collect();
        let slope = bytes_per_step(&line).unwrap();
        assert!((slope - 6.5e6).abs() < 1.0, "{slope}");
        // Flat with an evaluation spike every 50 steps and one release: no slope.
        let flat: Vec<(u64, u64)> = (0..300)
            .map(|s| {
                let spike = if s % 50 == 0 { 80_000_000 } else { 0 };
                let drop = if s == 150 { 0 } else { 1_000 };
                (s, 200_000_000 + spike + drop)
            })
            .collect();
        assert_eq!(bytes_per_step(&flat), Some(0.0));
        let c = judge(&flat, 0, 50, 64e6, 0.05).unwrap();
        assert!(c.ratio < 0.5);
        let c = judge(&line, 0, 50, 64e6, 0.05).unwrap();
        assert!(c.ratio > 1.0 && c.from.0 == WARMUP_STEPS + 1);
        assert_eq!(judge(&line[..40], 0, 50, 64e6, 0.05), None);
        assert_eq!(bytes_per_step(&[(3, 10)]), None);
    }
}
