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
    }
}
