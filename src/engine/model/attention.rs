//! Causal self-attention (multi-head or grouped-query) of the candle model.

use super::*;

impl Model {
    pub(super) fn attention(&self, l: usize, b: &Block, x: &Tensor, train: bool) -> Result<Tensor> {
        let s = &self.spec;
        let (bsz, t, _) = x.dims3()?;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim());
        let packed = self.packed_for((bsz, t));
        let region = packed.is_none()
            && self.fused(s.kernels.attention && s.kernels.linear, x)
            && self.rope.is_none()
            && kvh == h
            && (!train || s.dropout <= 0.0)
            && [&b.q, &b.k, &b.v].iter().all(|l| l.lora.is_none());
        if region {
            // q | k | v as one matmul over concatenated weights, then the attention core as
            // one graph node (kernels::causal_attention_qkv).
            let w = Tensor::cat(
                &[
                    self.weight(&b.q.w)?,
                    self.weight(&b.k.w)?,
                    self.weight(&b.v.w)?,
                ],
                0,
            )?;
            let bias = match (&b.q.b, &b.k.b, &b.v.b) {
                (Some(bq), Some(bk), Some(bv)) => Some(Tensor::cat(
                    &[self.cast(bq)?, self.cast(bk)?, self.cast(bv)?],
                    0,
                )?),
                _ => None,
            };
            let qkv = kernels::linear(x, &w, bias.as_ref())?;
            let y = kernels::causal_attention_qkv(&qkv, h, s.attention_scale())?;
            return self.linear(&b.o, &y);
        }
        let q = self
            .linear(&b.q, x)?
            .reshape((bsz, t, h, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = self
            .linear(&b.k, x)?
            .reshape((bsz, t, kvh, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = self
            .linear(&b.v, x)?
            .reshape((bsz, t, kvh, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (q, k) = match packed.and_then(|p| p.rope.as_ref()) {
            Some((cos, sin)) => (rotate_half(&q, cos, sin)?, rotate_half(&k, cos, sin)?),
            None => (self.apply_rope(&q)?, self.apply_rope(&k)?),
        };
        let (k, v) = if kvh < h {
            let rep = h / kvh;
            let expand = |z: Tensor| -> Result<Tensor> {
                z.unsqueeze(2)?
                    .expand((bsz, kvh, rep, t, hd))?
                    .reshape((bsz, h, t, hd))
            };
            (expand(k)?, expand(v)?)
        } else {
            (k, v)
        };
        let scale = s.attention_scale();
        let att = q.matmul(&k.t()?)?;
        let att = if let Some(p) = packed {
            // Packed samples: causal within each sample, nothing across.
            let att = (att * scale)?.broadcast_add(&p.mask)?;
            candle_nn::ops::softmax(&att, D::Minus1)?
        } else if self.fused(s.kernels.attention, &att) {
            kernels::causal_softmax(&att, scale)?
        } else {
            let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
            let att = (att * scale)?.broadcast_add(&mask)?;
            candle_nn::ops::softmax(&att, D::Minus1)?
        };
        let att = self.dropout(&att, train, dropout::site_attention(l), Layout::Attention)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((bsz, t, h * hd))?;
        self.linear(&b.o, &y)
    }
}
