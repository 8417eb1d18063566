//! Rotary position embeddings: the frequencies (shared by the candle model, generation and
//! the CUDA step) and the candle model's rotation.

use super::*;
use crate::engine::spec::RopeFreqs;

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
/// two halves of a head rotate together), × the table's factor (LongRoPE's attention factor).
pub(super) fn rope_tables(
    freqs: &RopeFreqs,
    start: usize,
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (inv_freq, scale) = (&freqs.inv_freq, freqs.scale);
    let hd = 2 * inv_freq.len();
    let mut cos = Vec::with_capacity(t * hd);
    let mut sin = Vec::with_capacity(t * hd);
    for pos in start..start + t {
        for j in 0..hd {
            let a = pos as f64 * inv_freq[j % inv_freq.len()];
            cos.push((a.cos() * scale) as f32);
            sin.push((a.sin() * scale) as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, hd), device)?.to_dtype(dtype)?,
        Tensor::from_vec(sin, (t, hd), device)?.to_dtype(dtype)?,
    ))
}

impl Model {
    /// The cos/sin table `[seq_len, rotary_dim]` layer `l` reads in a forward over `len`
    /// positions ([`ModelSpec::layer_rope`]; None: learned positions).
    pub(super) fn rope_table(&self, l: usize, len: usize) -> Option<&(Tensor, Tensor)> {
        let key = self.spec.layer_rope(l, len);
        if key == RopeKey::default() {
            return self.rope.as_ref();
        }
        self.rope_more
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, t)| t)
    }

    /// RoPE on layer `l`'s q or k `[B, H, T, hd]`: rotate the two halves of each head (the
    /// Llama/NeoX layout).
    pub(super) fn apply_rope(&self, l: usize, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        let Some((cos, sin)) = self.rope_table(l, t) else {
            return Ok(x.clone());
        };
        rotate_half(x, &cos.narrow(0, 0, t)?, &sin.narrow(0, 0, t)?)
    }
}
