//! Rotary position embeddings: the frequencies (shared by the candle model, generation and
//! the CUDA step) and the candle model's rotation.

use super::*;

/// RoPE inverse frequencies of `spec` ([`ModelSpec::rope_inv_freq`]).
pub fn rope_inv_freq(spec: &ModelSpec) -> Vec<f64> {
    spec.rope_inv_freq()
}

/// RoPE on `[B, H, T, hd]` with cos/sin `[T, hd]`: rotate the two halves of each head (the
/// Llama/NeoX layout).
/// Tables narrower than the head (Phi-3's partial rotary) rotate its first dims and pass the
/// rest.
pub(super) fn rotate_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (hd, rd) = (x.dim(D::Minus1)?, cos.dim(D::Minus1)?);
    if rd < hd {
        let rotated = rotate_half(&x.narrow(D::Minus1, 0, rd)?, cos, sin)?;
        return Tensor::cat(&[&rotated, &x.narrow(D::Minus1, rd, hd - rd)?], D::Minus1);
    }
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// cos and sin `[t, head_dim]` of positions `start..start + t` (each frequency twice: the
/// two halves of a head rotate together).
pub(super) fn rope_tables(
    inv_freq: &[f64],
    start: usize,
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let hd = 2 * inv_freq.len();
    let mut cos = Vec::with_capacity(t * hd);
    let mut sin = Vec::with_capacity(t * hd);
    for pos in start..start + t {
        for j in 0..hd {
            let a = pos as f64 * inv_freq[j % inv_freq.len()];
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, hd), device)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, (t, hd), device)?.to_dtype(dtype)?,
    ))
}

impl Model {
    pub(super) fn apply_rope(&self, x: &Tensor) -> Result<Tensor> {
        // x: [B, H, T, hd]; rotate the two halves of each head (the Llama/NeoX layout).
        let Some((cos, sin)) = &self.rope else {
            return Ok(x.clone());
        };
        let t = x.dim(2)?;
        rotate_half(x, &cos.narrow(0, 0, t)?, &sin.narrow(0, 0, t)?)
    }
}
