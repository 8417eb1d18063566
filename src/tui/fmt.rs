//! Number formatting shared by the views.

use crate::engine::events::FinishReason;

/// `45s`, `12m03s`, `1h02m`, `2d03h`; `--` for unknown.
pub fn duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "--".into();
    }
    let s = seconds.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

/// `950`, `12.3k`, `4.56M`, `7.89G`.
pub fn si(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        "--".into()
    } else if a < 1e3 {
        format!("{x:.0}")
    } else if a < 1e6 {
        format!("{:.1}k", x / 1e3)
    } else if a < 1e9 {
        format!("{:.2}M", x / 1e6)
    } else if a < 1e12 {
        format!("{:.2}G", x / 1e9)
    } else {
        format!("{:.2}T", x / 1e12)
    }
}

/// A step count with thousands separators: `12,345`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A step number for an axis: `950`, `12.3k`.
pub fn step(x: f64) -> String {
    if x.abs() < 1e4 {
        format!("{x:.0}")
    } else {
        si(x)
    }
}

/// A measured value with about three significant digits; scientific when very small or
/// large: `2.35`, `0.0123`, `3.0e-4`, `1.2e5`.
pub fn value(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        "--".into()
    } else if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// `10^e` in one significant digit, `2e-3` (for narrow log-scale axes).
pub fn power_of_ten_short(exponent: f64) -> String {
    let v = 10f64.powf(exponent);
    if !v.is_finite() {
        "--".into()
    } else if (1e-2..1e3).contains(&v) {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        format!("{v:.0e}")
    }
}

/// Bytes in binary units: `812 MiB`, `41.2 GiB`.
pub fn bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = b as f64;
    if b < KIB {
        format!("{b:.0} B")
    } else if b < KIB * KIB {
        format!("{:.0} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.0} MiB", b / (KIB * KIB))
    } else {
        format!("{:.1} GiB", b / (KIB * KIB * KIB))
    }
}

/// A pause or other wall-clock span as a clock: `0:42`, `12:03`, `1:02:03`.
pub fn clock(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "--".into();
    }
    let s = seconds.floor() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, (s % 3600) / 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// Decimals that tell ticks `step` apart: `0.5` → 1, `0.25` → 2, `20` → 0.
fn tick_decimals(step: f64) -> usize {
    if !(step.is_finite() && step > 0.0) || step >= 1.0 {
        return 0;
    }
    // the fewest decimals that print the step itself exactly (0.25 needs 2, 0.2 needs 1)
    (0..=12)
        .find(|&d| {
            let scale = 10f64.powi(d as i32);
            ((step * scale).round() - step * scale).abs() < 1e-6 * step * scale
        })
        .unwrap_or(12)
}

/// An axis tick with the decimals its spacing `step` calls for (`0.010`, `2.5`, `400`);
/// scientific for very small or large values (`2e-4`, `1.5e6`).
pub fn tick(v: f64, step: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        return "--".into();
    }
    if a < 1e-12 {
        return "0".into();
    }
    let step_ok = step.is_finite() && step > 0.0;
    if !(1e-3..1e6).contains(&a) || (step_ok && step >= 1e6) {
        // as many mantissa decimals as tell ticks `step` apart (2e-4, 1.5e6, 3.91e-4)
        let digits = if step_ok {
            let (ev, es) = (a.log10().floor(), step.log10().floor());
            let mantissa = tick_decimals(step / 10f64.powf(es)) as f64;
            (ev - es + mantissa).clamp(0.0, 8.0) as usize
        } else {
            1
        };
        let s = format!("{v:.digits$e}");
        // (2.0e-4 → 2e-4)
        return s.replace(".0e", "e");
    }
    // (ticks closer than 1e-4 on values of ordinary size: as many decimals as they need)
    format!("{v:.*}", tick_decimals(step).min(9))
}

/// [`tick`] with a percent sign.
pub fn tick_pct(v: f64, step: f64) -> String {
    format!("{}%", tick(v, step))
}

/// A time axis tick, in seconds before now: `now`, `-30s`, `-2m`, `-1m30s`, `-1h`.
pub fn ago(seconds: f64, _step: f64) -> String {
    let s = (-seconds).round().max(0.0) as u64;
    match s {
        0 => "now".into(),
        1..60 => format!("-{s}s"),
        60..3600 if s.is_multiple_of(60) => format!("-{}m", s / 60),
        60..3600 => format!("-{}m{:02}s", s / 60, s % 60),
        _ if s.is_multiple_of(3600) => format!("-{}h", s / 3600),
        _ => format!("-{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A step tick: `950`, `1500`, `12k`, `12.5k`.
pub fn step_tick(x: f64, _step: f64) -> String {
    if x.abs() < 1e4 {
        format!("{x:.0}")
    } else if x.abs() < 1e6 {
        let k = x / 1e3;
        if (k - k.round()).abs() < 1e-9 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else {
        si(x)
    }
}

/// Used of total in one binary unit, the total's: `8.2/16.0 GiB`, `812/1024 MiB`.
pub fn bytes_of(used: u64, total: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    const GIB: f64 = MIB * 1024.0;
    if total as f64 >= GIB {
        format!("{:.1}/{:.1} GiB", used as f64 / GIB, total as f64 / GIB)
    } else {
        format!("{:.0}/{:.0} MiB", used as f64 / MIB, total as f64 / MIB)
    }
}

/// A fraction as a percentage with two decimals: `1.25%`.
pub fn pct2(fraction: f64) -> String {
    format!("{:.2}%", fraction * 100.0)
}

/// How a run ended, in words.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Completed => "completed",
        FinishReason::Stopped => "stopped",
        FinishReason::Interrupted => "interrupted",
        FinishReason::Failed => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(duration(45.0), "45s");
        assert_eq!(duration(723.0), "12m03s");
        assert_eq!(duration(3720.0), "1h02m");
        assert_eq!(duration(f64::NAN), "--");
        assert_eq!(si(12_345.0), "12.3k");
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(count(12), "12");
        assert_eq!(value(3e-4), "3.0e-4");
        assert_eq!(value(2.345), "2.35");
        assert_eq!(bytes(41 * 1024 * 1024 * 1024), "41.0 GiB");
        assert_eq!(power_of_ten_short(-3.0), "1e-3");
        assert_eq!(power_of_ten_short((7.4e-4f64).log10()), "7e-4");
        assert_eq!(power_of_ten_short((0.03f64).log10()), "0.03");
        assert_eq!(clock(42.7), "0:42");
        assert_eq!(bytes_of(8 << 30, 16 << 30), "8.0/16.0 GiB");
        assert_eq!(clock(3723.0), "1:02:03");
        assert_eq!(tick(0.01, 0.002), "0.010");
        assert_eq!(tick(2.5, 0.5), "2.5");
        assert_eq!(tick(0.25, 0.25), "0.25");
        assert_eq!(tick(400.0, 200.0), "400");
        assert_eq!(tick(2e-4, 1e-4), "2e-4");
        // ticks closer than 1e-4: still each its own label
        assert_eq!(tick(3.90002, 0.00001), "3.90002");
        assert_eq!(tick(3.90003, 0.00001), "3.90003");
        assert_eq!(tick(3.91e-4, 1e-6), "3.91e-4");
        assert_eq!(tick(2e6, 1e6), "2e6");
        assert_eq!(tick(1.5e6, 5e5), "1.5e6");
        assert_eq!(tick_pct(1.5, 0.5), "1.5%");
        assert_eq!(ago(0.0, 30.0), "now");
        assert_eq!(ago(-90.0, 30.0), "-1m30s");
        assert_eq!(ago(-120.0, 60.0), "-2m");
        assert_eq!(step_tick(12_000.0, 1000.0), "12k");
    }
}
