//! The MLP: GELU, SwiGLU or GeGLU (Gemma: a GELU-tanh gate); a hybrid's shared SwiGLU MLP
//! (gate | up in one projection) and its routed experts.

use super::*;

impl Model {
    pub(super) fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let hidden = match &b.gate {
            Some(g) => {
                let g = self.linear(g, x)?;
                let g = match self.spec.activation {
                    // candle's gelu is the tanh approximation (`gelu_pytorch_tanh`).
                    Activation::GeGlu => g.gelu()?,
                    _ => candle_nn::ops::silu(&g)?,
                };
                (g * self.linear(&b.up, x)?)?
            }
            None if self.spec.hybrid.is_some() => {
                let gu = self.linear(&b.up, x)?;
                let h = self.spec.hidden;
                (candle_nn::ops::silu(&gu.narrow(D::Minus1, 0, h)?)?
                    * gu.narrow(D::Minus1, h, h)?)?
            }
            None => self.linear_gelu(&b.up, x)?,
        };
        let y = self.linear(&b.down, &hidden)?;
        match &b.moe {
            Some(m) => self.moe(m, x)? + y,
            None => Ok(y),
        }
    }
}
