//! LayerNorm / RMSNorm layers.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct NormLayer {
    pub(super) w: Var,
    pub(super) b: Option<Var>,
}

impl Model {
    pub(super) fn norm(&self, n: &NormLayer, x: &Tensor) -> Result<Tensor> {
        let w = self.cast(&n.w)?;
        let eps = self.spec.norm_eps as f32;
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
