//! LayerNorm / RMSNorm layers.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct NormLayer {
    pub(super) w: Var,
    pub(super) b: Option<Var>,
}

impl Model {
    pub(super) fn norm(&self, n: &NormLayer, x: &Tensor) -> Result<Tensor> {
        let eps = self.spec.norm_eps as f32;
        if self.spec.layout.norm_plus_one {
            // Gemma: x normalized and scaled by 1 + w in f32, then cast (as transformers
            // computes it: 1 + w would lose w's low bits in bf16).
            let w = (n.w.as_tensor().to_dtype(DType::F32)? + 1.0)?;
            let y = candle_nn::ops::rms_norm_slow(&x.to_dtype(DType::F32)?, &w, eps)?;
            return y.to_dtype(x.dtype());
        }
        let w = self.cast(&n.w)?;
        let fused = self.fused(self.spec.kernels.norm, x);
        match (&self.spec.norm, &n.b) {
            (Norm::LayerNorm, Some(b)) if fused => {
                kernels::layer_norm(x, &w, &self.cast(b)?, self.spec.norm_eps)
            }
            (Norm::LayerNorm, None) if fused => {
                kernels::layer_norm(x, &w, &w.zeros_like()?, self.spec.norm_eps)
            }
            (Norm::RmsNorm, _) if fused => kernels::rms_norm(x, &w, self.spec.norm_eps),
            (Norm::LayerNorm, Some(b)) => {
                candle_nn::ops::layer_norm_slow(x, &w, &self.cast(b)?, eps)
            }
            (Norm::LayerNorm, None) => {
                let zeros = w.zeros_like()?;
                candle_nn::ops::layer_norm_slow(x, &w, &zeros, eps)
            }
            (Norm::RmsNorm, _) => candle_nn::ops::rms_norm_slow(x, &w, eps),
        }
    }
}
