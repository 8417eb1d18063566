//! The MLP: GELU or SwiGLU; a hybrid's shared SwiGLU MLP (gate | up in one projection) and its
//! routed experts.

use super::*;

impl Model {
    pub(super) fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let hidden = match &b.gate {
            Some(g) => (candle_nn::ops::silu(&self.linear(g, x)?)? * self.linear(&b.up, x)?)?,
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
