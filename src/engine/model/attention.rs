//! Causal self-attention (multi-head or grouped-query) of the candle model; the scores'
//! arithmetic ([`Model::attention_probs`], [`causal_mask`]) is shared with the cached decode.

use super::*;

/// `[n, start + n]` additive mask of queries at positions `start..start + n` over keys
/// `0..start + n`: 0 where the query may look (the key is not after it and, with a window,
/// fewer than `window` positions before it: transformers' `kv > q − window`), −∞ elsewhere.
pub(super) fn causal_mask(
    n: usize,
    start: usize,
    window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let m = start + n;
    let mask: Vec<f32> = (0..n * m)
        .map(|i| {
            let (q, k) = (start + i / m, i % m);
            if k > q || window.is_some_and(|w| q - k >= w) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (n, m), device)?.to_dtype(dtype)
}

impl Model {
    /// The `[seq_len, seq_len]` causal mask (through the sliding layers' window where
    /// `window` is set), built at the first forward that reads it: the fused step and the
    /// region kernels never do — at T = 32768 it held 2.1 GB of the device for nothing, and
    /// at T = 65536 its T² elements overflowed the u32 count of candle's cast (CUDA's
    /// "invalid argument" before the first step).
    fn causal_mask_of(&self, window: Option<usize>) -> Result<&Tensor> {
        let s = &self.spec;
        let (cell, w) = match window {
            Some(_) if s.layout.has_sliding() => (&self.window_mask, Some(s.layout.window)),
            _ => (&self.mask, None),
        };
        if let Some(m) = cell.get() {
            return Ok(m);
        }
        let m = causal_mask(s.seq_len, 0, w, self.dtype, &self.device)?;
        Ok(cell.get_or_init(|| m))
    }

    pub(super) fn attention(&self, l: usize, b: &Block, x: &Tensor, train: bool) -> Result<Tensor> {
        let s = &self.spec;
        let a = b.attn()?;
        let (bsz, t, _) = x.dims3()?;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim());
        let packed = self.packed_for((bsz, t));
        let window = s.layer_window(l);
        let plain = window.is_none() && s.attn_softcap().is_none();
        let region = packed.is_none()
            && plain
            && self.fused(s.kernels.attention && s.kernels.linear, x)
            && self.rope.is_none()
            && kvh == h
            && a.q_norm.is_none()
            && (!train || s.dropout <= 0.0)
            && [&a.q, &a.k, &a.v].iter().all(|l| l.lora.is_none());
        if region {
            // q | k | v as one matmul over concatenated weights, then the attention core as
            // one graph node (kernels::causal_attention_qkv).
            let w = Tensor::cat(
                &[
                    self.weight(&a.q.w)?,
                    self.weight(&a.k.w)?,
                    self.weight(&a.v.w)?,
                ],
                0,
            )?;
            let bias = match (&a.q.b, &a.k.b, &a.v.b) {
                (Some(bq), Some(bk), Some(bv)) => Some(Tensor::cat(
                    &[self.cast(bq)?, self.cast(bk)?, self.cast(bv)?],
                    0,
                )?),
                _ => None,
            };
            let qkv = kernels::linear(x, &w, bias.as_ref())?;
            let y = kernels::causal_attention_qkv(&qkv, h, s.attention_scale())?;
            return self.linear(&a.o, &y);
        }
        let (q, k, v) = self.qkv_heads(b, x)?;
        let (q, k) = match packed.and_then(|p| Some((p, self.rope_table(l, p.len)?))) {
            Some((p, table)) => {
                // Positions restart at each packed sample.
                let (cos, sin) = p.pick_rope(table)?;
                (rotate_half(&q, &cos, &sin)?, rotate_half(&k, &cos, &sin)?)
            }
            None => (self.apply_rope(l, &q)?, self.apply_rope(l, &k)?),
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
        let att = q.matmul(&k.t()?)?;
        let causal = self
            .causal_mask_of(window)?
            .narrow(0, 0, t)?
            .narrow(1, 0, t)?;
        let att = if let Some(p) = packed {
            // Packed samples: causal within each sample, nothing across (and the window).
            let mask = match window {
                Some(_) => p.mask.broadcast_add(&causal)?,
                None => p.mask.clone(),
            };
            self.attention_probs(att, &mask)?
        } else if plain && self.fused(s.kernels.attention, &att) {
            kernels::causal_softmax(&att, s.attention_scale())?
        } else {
            self.attention_probs(att, &causal)?
        };
        let att = self.dropout(&att, train, dropout::site_attention(l), Layout::Attention)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((bsz, t, h * hd))?;
        self.linear(&a.o, &y)
    }

    /// Attention probabilities from the raw scores `q·kᵀ`: × the score scale, Gemma 2's
    /// soft-cap (`cap·tanh(x/cap)`), + `mask` (−∞ where a query may not look), softmax over
    /// the keys. The forward and the cached decode both take their scores here.
    pub(super) fn attention_probs(&self, scores: Tensor, mask: &Tensor) -> Result<Tensor> {
        let mut att = (scores * self.spec.attention_scale())?;
        if let Some(cap) = self.spec.attn_softcap() {
            att = ((att / cap)?.tanh()? * cap)?;
        }
        candle_nn::ops::softmax(&att.broadcast_add(mask)?, D::Minus1)
    }

    /// q, k and v `[B, heads, T, head_dim]` of `x` `[B, T, n_embd]`, with the block's QK-norm
    /// where it has one (before RoPE): over the whole projection (OLMo 2) or each head (Qwen3).
    pub(super) fn qkv_heads(&self, b: &Block, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let s = &self.spec;
        let a = b.attn()?;
        let (bsz, t, _) = x.dims3()?;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim());
        let mut q = self.linear(&a.q, x)?;
        let mut k = self.linear(&a.k, x)?;
        let v = self.linear(&a.v, x)?;
        let per_head = s.layout.qk_norm == QkNorm::Head;
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            if per_head {
                // One row per (position, head): the norm runs over each head's dims.
                q = self.norm(qn, &q.reshape((bsz, t * h, hd))?)?;
                k = self.norm(kn, &k.reshape((bsz, t * kvh, hd))?)?;
            } else {
                q = self.norm(qn, &q)?;
                k = self.norm(kn, &k)?;
            }
        }
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            y.reshape((bsz, t, n, hd))?.transpose(1, 2)?.contiguous()
        };
        Ok((heads(q, h)?, heads(k, kvh)?, heads(v, kvh)?))
    }
}
