//! Precision policy: which dtype computes, and fp16's dynamic loss scaling.

use crate::config::DType as Want;
use candle_core::DType;
use serde::{Deserialize, Serialize};

/// Pick the compute dtype. `cc` is the CUDA compute capability, None on CPU.
pub fn choose(want: Want, cc: Option<(u32, u32)>) -> Result<(DType, String), String> {
    match (want, cc) {
        (Want::Auto, None) | (Want::F32, None) => Ok((DType::F32, "fp32 on CPU".into())),
        (Want::Bf16 | Want::F16, None) => Err(format!(
            "precision.dtype = \"{}\": reduced precision needs a CUDA device; use \"auto\" or \"f32\" on CPU",
            if want == Want::Bf16 { "bf16" } else { "f16" }
        )),
        (Want::Auto, Some((maj, min))) if maj >= 8 => {
            Ok((DType::BF16, format!("bf16: compute capability {maj}.{min} ≥ 8.0 has bf16 tensor cores (fp32 master weights)")))
        }
        (Want::Auto, Some((maj, min))) if maj >= 7 => Ok((
            DType::F16,
            format!("fp16 with dynamic loss scaling: compute capability {maj}.{min} has fp16 but not bf16 tensor cores"),
        )),
        (Want::Auto, Some((maj, min))) => Ok((DType::F32, format!("fp32: compute capability {maj}.{min} < 7.0 has no tensor cores"))),
        (Want::F32, Some(_)) => Ok((DType::F32, "fp32 (precision.dtype = \"f32\")".into())),
        (Want::Bf16, Some(_)) => Ok((DType::BF16, "bf16 (precision.dtype = \"bf16\")".into())),
        (Want::F16, Some(_)) => Ok((DType::F16, "fp16 with dynamic loss scaling (precision.dtype = \"f16\")".into())),
    }
}

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "f32",
    }
}

/// Dynamic loss scaling for fp16: on overflow skip the step and halve; after `growth_interval`
/// clean steps double.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub enabled: bool,
    pub scale: f64,
    pub growth_interval: u64,
    pub clean_steps: u64,
    pub skipped: u64,
}

impl LossScaler {
    pub fn new(enabled: bool, init: f64, growth_interval: u64) -> Self {
        Self {
            enabled,
            scale: if enabled { init } else { 1.0 },
            growth_interval,
            clean_steps: 0,
            skipped: 0,
        }
    }

    /// Record whether this step's gradients were finite. Returns true when the step may be applied.
    pub fn update(&mut self, finite: bool) -> bool {
        if !self.enabled {
            return finite;
        }
        if finite {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(2f64.powi(24));
                self.clean_steps = 0;
            }
            true
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean_steps = 0;
            self.skipped += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_by_compute_capability() {
        assert_eq!(choose(Want::Auto, None).unwrap().0, DType::F32);
        assert_eq!(choose(Want::Auto, Some((9, 0))).unwrap().0, DType::BF16);
        assert_eq!(choose(Want::Auto, Some((7, 5))).unwrap().0, DType::F16);
        assert_eq!(choose(Want::Auto, Some((6, 1))).unwrap().0, DType::F32);
        assert!(choose(Want::Bf16, None).is_err());
    }

    #[test]
    fn scaler_skips_and_halves_on_inf_then_grows() {
        let mut s = LossScaler::new(true, 1024.0, 3);
        assert!(!s.update(false));
        assert_eq!((s.scale, s.skipped), (512.0, 1));
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true));
        assert_eq!(s.scale, 1024.0);
        let mut off = LossScaler::new(false, 1024.0, 3);
        assert_eq!(off.scale, 1.0);
        assert!(!off.update(false));
    }
}
