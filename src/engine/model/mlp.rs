//! The MLP: GELU or SwiGLU.

use super::*;

impl Model {
    pub(super) fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let hidden = match &b.gate {
            Some(g) => (candle_nn::ops::silu(&self.linear(g, x)?)? * self.linear(&b.up, x)?)?,
            None => self.linear_gelu(&b.up, x)?,
        };
        self.linear(&b.down, &hidden)
    }
}
