//! The MLP: GELU, SwiGLU or GeGLU (Gemma: a GELU-tanh gate).

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
            None => self.linear_gelu(&b.up, x)?,
        };
        self.linear(&b.down, &hidden)
    }
}
