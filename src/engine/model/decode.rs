//! Incremental decoding with a KV cache, for generation: the arithmetic of `Model::forward`
//! (same weights, norms, RoPE frequencies and multipliers), a block of new positions at a
//! time, each attending to the cached keys and values of the positions before it.

use super::{causal_mask, rope_tables, Model};
use candle_core::{DType, Result, Tensor};

/// Keys and values of the positions decoded so far, per layer (`[1, kv_heads, pos, head_dim]`).
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
    /// The ids decoded so far (a LongRoPE model recomputes them when the sequence crosses its
    /// original context: [`Model::decode`]).
    ids: Vec<u32>,
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
            ids: Vec::new(),
        }
    }

    /// The longest sequence the model can decode: its position table (learned positions);
    /// with RoPE, any length.
    pub fn max_positions(&self) -> Option<usize> {
        self.wpe.as_ref().map(|_| self.spec.n_positions)
    }

    /// Logits `[ids.len(), vocab]` (f32) of `ids` placed after the cached positions; their
    /// keys and values join the cache. A LongRoPE model whose sequence grows past its original
    /// context switches to the long factors for every position, as transformers' generation
    /// does: the cache (short factors) is dropped and the whole sequence decoded again.
    pub fn decode(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let (start, end) = (cache.pos, cache.pos + ids.len());
        if start > 0 && !self.spec.rope_long(start) && self.spec.rope_long(end) {
            let all = [cache.ids.as_slice(), ids].concat();
            *cache = self.kv_cache();
            let logits = self.decode(&all, cache)?;
            return logits.narrow(0, start, ids.len());
        }
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
        // Each table the layers read (per RoPE key), at positions start..start + n.
        let mut ropes = Vec::new();
        if self.rope.is_some() {
            for key in s.rope_keys() {
                ropes.push((
                    key,
                    rope_tables(&s.rope_freqs(key), start, n, self.dtype, dev)?,
                ));
            }
        }
        // Row j (position start + j) sees keys 0..=start + j (within the window on sliding
        // layers).
        let mask = causal_mask(n, start, None, self.dtype, dev)?;
        let window_mask = match s.layout.has_sliding() {
            true => Some(causal_mask(
                n,
                start,
                Some(s.layout.window),
                self.dtype,
                dev,
            )?),
            false => None,
        };
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim);
        for (l, (b, slot)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            if let super::Mixer::Mamba(m) = &b.mixer {
                x = self
                    .mamba_decode_block(b, m, &self.mamba_consts(m)?, &x, slot, None, false)?
                    .detach();
                continue;
            }
            let a_in = self.block_input(&b.ln1, &x)?;
            let (mut q, mut k, v) = self.qkv_heads(b, &a_in)?;
            let key = s.layer_rope(l, start + n);
            if let Some((_, (cos, sin))) = ropes.iter().find(|(k, _)| *k == key) {
                q = super::rotate_half(&q, cos, sin)?;
                k = super::rotate_half(&k, cos, sin)?;
            }
            let (k, v) = match slot.take() {
                Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                None => (k, v),
            };
            // (Detached: a cache entry must not hold the op graph of every step before it — the
            // weights are variables, so each op records its inputs.)
            *slot = Some((k.detach(), v.detach()));
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
            let mask = match (s.layer_window(l), &window_mask) {
                (Some(_), Some(w)) => w,
                _ => &mask,
            };
            let att = self.attention_probs(q.matmul(&k.t()?)?, mask)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((1, n, h * hd))?;
            let a = self.linear(&b.attn()?.o, &y)?;
            x = (x + self.residual(self.block_output(&b.ln1, b.post_attn.as_ref(), a)?)?)?;
            let m = self.mlp(b, &self.block_input(&b.ln2, &x)?)?;
            // (Detached: one layer's activations alive at a time, as in `decode_batch`.)
            x = (x + self.residual(self.block_output(&b.ln2, b.post_mlp.as_ref(), m)?)?)?.detach();
        }
        cache.pos += n;
        cache.ids.extend_from_slice(ids);
        let x = self.final_norm(&x)?.reshape((n, s.n_embd))?;
        let head = match &self.lm_head {
            Some(w) => self.cast(w)?,
            None => wte,
        };
        Ok(self.head_logits(&x, &head)?.to_dtype(DType::F32)?.detach())
    }
}
