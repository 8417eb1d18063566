//! Incremental decoding with a KV cache, for generation: the arithmetic of `Model::forward`
//! (same weights, norms, RoPE frequencies and multipliers), a block of new positions at a
//! time, each attending to the cached keys and values of the positions before it.

use super::{rope_inv_freq, rope_tables, Model};
use candle_core::{DType, Result, Tensor, D};

/// Keys and values of the positions decoded so far, per layer (`[1, kv_heads, pos, head_dim]`).
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
    inv_freq: Vec<f64>,
}

impl KvCache {
    /// Positions decoded so far.
    pub fn len(&self) -> usize {
        self.pos
    }
    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

impl Model {
    /// An empty cache for this model.
    pub fn kv_cache(&self) -> KvCache {
        KvCache {
            layers: vec![None; self.blocks.len()],
            pos: 0,
            inv_freq: rope_inv_freq(&self.spec),
        }
    }

    /// The longest sequence the model can decode: its position table (learned positions);
    /// with RoPE, any length.
    pub fn max_positions(&self) -> Option<usize> {
        self.wpe.as_ref().map(|_| self.spec.n_positions)
    }

    /// Logits `[ids.len(), vocab]` (f32) of `ids` placed after the cached positions; their
    /// keys and values join the cache.
    pub fn decode(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let s = &self.spec;
        let (n, start) = (ids.len(), cache.pos);
        if let Some(max) = self.max_positions() {
            if start + n > max {
                candle_core::bail!(
                    "position {} is past the model's {max} learned positions",
                    start + n - 1
                );
            }
        }
        let dev = &self.device;
        let wte = self.cast(&self.wte)?;
        let idx = Tensor::from_vec(ids.to_vec(), n, dev)?;
        let mut x = wte.embedding(&idx)?.reshape((1, n, s.n_embd))?;
        if s.embedding_multiplier != 1.0 {
            x = (x * s.embedding_multiplier)?;
        }
        if let Some(wpe) = &self.wpe {
            x = x.broadcast_add(&self.cast(wpe)?.narrow(0, start, n)?)?;
        }
        let rope = match self.rope {
            Some(_) => Some(rope_tables(&cache.inv_freq, start, n, self.dtype, dev)?),
            None => None,
        };
        // Row j (position start + j) sees keys 0..=start + j.
        let mask: Vec<f32> = (0..n * (start + n))
            .map(|i| {
                if i % (start + n) > start + i / (start + n) {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, start + n), dev)?.to_dtype(self.dtype)?;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim);
        for (b, slot) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            if let super::Mixer::Mamba(m) = &b.mixer {
                x = self.mamba_decode_block(b, m, &x, slot)?;
                continue;
            }
            let a_in = self.block_input(&b.ln1, &x)?;
            let (mut q, mut k, v) = self.qkv_heads(b, &a_in)?;
            if let Some((cos, sin)) = &rope {
                q = super::rotate_half(&q, cos, sin)?;
                k = super::rotate_half(&k, cos, sin)?;
            }
            let (k, v) = match slot.take() {
                Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                None => (k, v),
            };
            *slot = Some((k.clone(), v.clone()));
            let t = start + n;
            let (k, v) = if kvh < h {
                let rep = h / kvh;
                let expand = |z: Tensor| -> Result<Tensor> {
                    z.unsqueeze(2)?
                        .expand((1, kvh, rep, t, hd))?
                        .reshape((1, h, t, hd))
                };
                (expand(k)?, expand(v)?)
            } else {
                (k, v)
            };
            let att = (q.matmul(&k.t()?)? * s.attention_scale())?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((1, n, h * hd))?;
            let a = self.block_output(&b.ln1, self.linear(&b.attn()?.o, &y)?)?;
            x = (x + self.residual(a)?)?;
            let m = self.block_output(&b.ln2, self.mlp(b, &self.block_input(&b.ln2, &x)?)?)?;
            x = (x + self.residual(m)?)?;
        }
        cache.pos += n;
        let x = self.final_norm(&x)?.reshape((n, s.n_embd))?;
        let head = match &self.lm_head {
            Some(w) => self.cast(w)?,
            None => wte,
        };
        x.matmul(&head.t()?)?.to_dtype(DType::F32)
    }
}
