//! A chart's tick marks and labels: linear axes with as many decimals as the ticks need and
//! k/M/G suffixes, log axes on round values (decades, 1-2-5, integer multiples).

use plotters::coord::ranged1d::{
    BoldPoints, KeyPointHint, LightPoints, NoDefaultFormatting, Ranged, ValueFormatter,
};
use plotters::coord::types::RangedCoordf64;

use super::{Scale, Y_TICKS};

/// Tick labels for a linear axis: as many decimals as the ticks need, k/M/G for large values,
/// a shared power of ten for small ones.
pub(super) fn linear_ticks(range: (f64, f64), n: usize) -> impl Fn(&f64) -> String {
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
pub(super) struct TickedAxis {
    pub(super) inner: RangedCoordf64,
    pub(super) bold: Vec<f64>,
    pub(super) light: Vec<f64>,
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
pub(super) type YAxis = (Vec<f64>, Vec<f64>, Box<dyn Fn(&f64) -> String>);

pub(super) fn y_axis(range: (f64, f64), scale: Scale) -> YAxis {
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
fn significant(v: f64, digits: usize) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
