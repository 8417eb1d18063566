//! Batched incremental decoding: the arithmetic of `Model::forward` for a block of new
//! columns of every row of a batch at once, keys and values written in place into the
//! [`BatchCache`] allocated for the whole generation, attention over the filled columns.

use super::cache::{BatchCache, LayerState};
use super::*;

/// Whether `COCKPIT_DECODE=ops` asks a generation step for the candle ops instead of the
/// decode kernels (attention's, a Mamba layer's), to compare them; read once.
pub(super) fn decode_ops() -> bool {
    static OPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OPS.get_or_init(|| std::env::var("COCKPIT_DECODE").as_deref() == Ok("ops"))
}

/// A decode call's RoPE: candle's fused rotation (one kernel; cos and sin `[B, n,
/// rotary_dim / 2]`, each row its own positions) where the rotation spans the head, else the
/// rotate-half composition of the forward over the first rotary dims (cos and sin `[B, 1, n,
/// rotary_dim]`). The same arithmetic; the fused op has no backward, which decoding never
/// takes.
enum StepRope {
    Fused(Tensor, Tensor),
    Composed(Tensor, Tensor),
}

/// Where a decode call's new columns are: after `start` on the host, or (one column) at the
/// column a device tensor `at` `[2]` (u32: the column, the columns after it) names, read when
/// the step runs — as a step captured in a CUDA graph reads it ([`super::decode_graph`]).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) enum Cols<'a> {
    Host(usize),
    Device(&'a Tensor),
}

/// Column `at[0]` of each row of `t` `[B, capacity, w]` → `[B, 1, w]`, the column read on the
/// device.
fn column(t: &Tensor, at: &Tensor) -> Result<Tensor> {
    let (b, _, w) = t.dims3()?;
    let idx = at
        .narrow(0, 0, 1)?
        .reshape((1, 1, 1))?
        .broadcast_as((b, 1, w))?
        .contiguous()?;
    t.contiguous()?.gather(&idx, 1)
}

impl StepRope {
    /// The new columns' rows of a cache's tables `[B, capacity, rotary_dim]` (each frequency
    /// twice: the two halves of a head rotate together).
    fn new(cos: &Tensor, sin: &Tensor, cols: Cols, n: usize, head_dim: usize) -> Result<Self> {
        let rd = cos.dim(2)?;
        let (cos, sin) = match cols {
            Cols::Host(start) => (cos.narrow(1, start, n)?, sin.narrow(1, start, n)?),
            Cols::Device(at) => (column(cos, at)?, column(sin, at)?),
        };
        if rd == head_dim {
            let half = |t: &Tensor| t.narrow(2, 0, rd / 2)?.contiguous();
            return Ok(Self::Fused(half(&cos)?, half(&sin)?));
        }
        Ok(Self::Composed(cos.unsqueeze(1)?, sin.unsqueeze(1)?))
    }

    /// `x` `[B, heads, n, head_dim]` rotated.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Fused(cos, sin) => candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin),
            Self::Composed(cos, sin) => rotate_half(x, cos, sin),
        }
    }
}

/// What a decode step gives: the logits of each row's last column and its final hidden
/// state.
pub struct StepOut {
    /// `[B, vocab]` (f32); None when not asked for.
    pub logits: Option<Tensor>,
    /// `[B, n_embd]` (f32): the final (normed) hidden state of each row's last column.
    pub hidden: Tensor,
}

impl Model {
    /// Decode `ids` `[B, n]` (u32) placed at the next `n` columns of `cache`: their keys and
    /// values join the cache. A left-padded prompt is one call with `n` = its width; each
    /// step after it `n` = 1. The call whose columns cross a LongRoPE model's original
    /// context decodes every column again, with the long factors
    /// ([`Self::switch_to_long_rope`]).
    pub fn decode_batch(
        &self,
        ids: &Tensor,
        cache: &mut BatchCache,
        logits: bool,
    ) -> Result<StepOut> {
        let (bsz, n) = ids.dims2()?;
        let start = cache.filled;
        if bsz != cache.batch() || n == 0 || start + n > cache.capacity {
            candle_core::bail!(
                "decode_batch: {bsz}×{n} new columns after {start} do not fit a cache of {}×{}",
                cache.batch(),
                cache.capacity
            );
        }
        if let Some(all) = &cache.ids {
            all.slice_set(&ids.to_dtype(DType::U32)?.contiguous()?, 1, start)?;
        }
        if let Some(out) = self.switch_to_long_rope(cache, start + n, logits)? {
            return Ok(out);
        }
        if n == 1 {
            if let Some(out) = self.decode_step_graphed(ids, cache, logits)? {
                return Ok(out);
            }
        }
        self.decode_cols(ids, cache, logits, Cols::Host(start))
    }

    /// [`Self::decode_batch`]'s arithmetic for `ids` at `cols`. With the ordinary steps'
    /// [`Cols::Host`], the cache's columns after `start`. With [`Cols::Device`] (one
    /// column) every launch takes the same arguments at every step: the tables' and
    /// positions' column gathered, keys and values scattered to it, attention's length read on
    /// the device, a Mamba layer's state written over in place; the caller counts the column
    /// as filled, and the logits are always computed.
    pub(super) fn decode_cols(
        &self,
        ids: &Tensor,
        cache: &mut BatchCache,
        logits: bool,
        cols: Cols,
    ) -> Result<StepOut> {
        let s = &self.spec;
        let (bsz, n) = ids.dims2()?;
        let start = cache.filled;
        let device = matches!(cols, Cols::Device(_));
        if device && n != 1 {
            candle_core::bail!("decode_batch: {n} new columns read on the device, not one");
        }
        let logits = logits || device;
        let wte = self.cast(&self.wte)?;
        let mut x = wte
            .embedding(&ids.flatten_all()?)?
            .reshape((bsz, n, s.n_embd))?;
        if s.embedding_multiplier != 1.0 {
            x = (x * s.embedding_multiplier)?;
        }
        if let Some(wpe) = &self.wpe {
            let p = match cols {
                Cols::Host(start) => cache.positions.narrow(1, start, n)?.contiguous()?,
                Cols::Device(at) => column(&cache.positions.unsqueeze(2)?, at)?,
            };
            let table = self.cast(wpe)?.index_select(&p.flatten_all()?, 0)?;
            x = (x + table.reshape((bsz, n, s.n_embd))?)?;
        }
        // Each row's own positions of the tables (the sliding layers' own θ where they have
        // one), once for every layer.
        let tables = |r: &Option<(Tensor, Tensor)>| -> Result<Option<StepRope>> {
            match r {
                Some((cos, sin)) => StepRope::new(cos, sin, cols, n, s.head_dim()).map(Some),
                None => Ok(None),
            }
        };
        let (rope, rope_local) = (tables(&cache.rope)?, tables(&cache.rope_local)?);
        let len = start + n;
        let (h, kvh, hd) = (s.n_head, s.n_kv_head, s.head_dim());
        let rep = h / kvh;
        let scale = s.attention_scale();
        let softcap = s.attn_softcap().unwrap_or(0.0) as f32;
        // A prompt's prefill (every column from the first) in flash attention's forward on
        // CUDA where the cache asks for it: each query's lowest key per row, for the layers
        // without and with a window.
        let flash = if n > 1
            && start == 0
            && cache.flash_prefill
            && !decode_ops()
            && s.kernels.attention
            && x.dtype() == DType::BF16
            && crate::engine::kernels::flash_rows_takes(&self.device, hd, softcap)
        {
            let window = s.layout.has_sliding().then_some(s.layout.window);
            let global = self.prefill_starts(cache, n, None)?;
            let local = window
                .map(|w| self.prefill_starts(cache, n, Some(w)))
                .transpose()?;
            Some((global, local))
        } else {
            None
        };
        // Sliding layers: a prefill's mask limits each query to its window; a decode step's
        // single query reads only the window's last columns of the cache (no mask to build).
        // (Flash attention takes the window as each query's lowest key.)
        let window_mask = if n > 1 && s.layout.has_sliding() && flash.is_none() {
            Some(self.step_mask(cache, n, Some(s.layout.window))?)
        } else {
            None
        };
        // A decode step's attention in one kernel on CUDA (the ops elsewhere, and for a
        // prefill).
        let decode_kernel = n == 1 && self.decode_kernel_takes(&x);
        if device && !decode_kernel {
            candle_core::bail!("decode_batch: columns on the device without the decode kernel");
        }
        // The ops' mask, where they run (for several rows its columns `0..len` are a copy,
        // whose layout changes with every step: a step captured in a CUDA graph could not
        // take it).
        let mask = match decode_kernel || flash.is_some() {
            true => None,
            false => Some(self.step_mask(cache, n, None)?),
        };
        // (Device columns: the index of the new column in the keys' shape, once.)
        let mut kv_at: Option<Tensor> = None;
        // A Mamba layer's real columns of a left-padded prefill (its padding must change no
        // row's state); every column of a step after it is real.
        let valid = if n > 1 && s.hybrid.is_some() {
            Some(
                cache
                    .pad_mask
                    .narrow(1, start, n)?
                    .eq(0.0)?
                    .to_dtype(self.dtype)?,
            )
        } else {
            None
        };
        for (l, (b, state)) in self.blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            if let Mixer::Mamba(m) = &b.mixer {
                let LayerState::Mamba { state, consts } = state else {
                    candle_core::bail!(
                        "decode_batch: layer {l} is a Mamba layer with keys and values cached"
                    );
                };
                let c = match consts {
                    Some(c) => c,
                    None => consts.insert(self.mamba_consts(m)?),
                };
                x = self
                    .mamba_decode_block(b, m, c, &x, state, valid.as_ref(), device)?
                    .detach();
                continue;
            }
            let a_in = self.block_input(&b.ln1, &x)?;
            let (mut q, mut k, v) = self.qkv_heads(b, &a_in)?;
            let local = s.layer_rope(l, len).local;
            let table = if local { &rope_local } else { &rope };
            if let Some(r) = table {
                q = r.apply(&q)?;
                k = r.apply(&k)?;
            }
            let (kc, vc) = match state {
                LayerState::Kv { k: kc, v: vc } => {
                    let (k, v) = (k.contiguous()?, v.contiguous()?);
                    match cols {
                        Cols::Host(start) => {
                            kc.slice_set(&k, 2, start)?;
                            vc.slice_set(&v, 2, start)?;
                        }
                        Cols::Device(at) => {
                            let idx = match &kv_at {
                                Some(i) => i.clone(),
                                None => kv_at
                                    .insert(
                                        at.narrow(0, 0, 1)?
                                            .reshape((1, 1, 1, 1))?
                                            .broadcast_as(k.shape())?
                                            .contiguous()?,
                                    )
                                    .clone(),
                            };
                            kc.scatter_set(&idx, &k, 2)?;
                            vc.scatter_set(&idx, &v, 2)?;
                        }
                    }
                    (&*kc, &*vc)
                }
                LayerState::Mamba { .. } => {
                    candle_core::bail!("decode_batch: attention layer {l} with a Mamba state")
                }
            };
            // (the first column this layer reads: a sliding layer's window in a decode step)
            let lo = match s.layer_window(l) {
                Some(w) if n == 1 => len.saturating_sub(w),
                _ => 0,
            };
            let y = if let Some((global, local)) = &flash {
                let starts = match (s.layer_window(l), local) {
                    (Some(_), Some(w)) => w,
                    _ => global,
                };
                let qkv = Tensor::cat(&[&q, &k, &v], 1)?.transpose(1, 2)?;
                crate::engine::kernels::flash_rows(&qkv, starts, h, kvh, scale as f32, softcap)?
                    .reshape((bsz, n, h * hd))?
            } else if let Cols::Device(at) = cols {
                let q = q.reshape((bsz, h, hd))?.contiguous()?;
                let at = crate::engine::kernels::DecodeAt {
                    at,
                    window: s.layer_window(l),
                    scale: scale as f32,
                    softcap,
                };
                crate::engine::kernels::decode_attention_at(&q, kc, vc, &cache.pad_mask, at)?
                    .reshape((bsz, n, h * hd))?
            } else if n == 1 && decode_kernel {
                // One kernel over the cache (keys in chunks across blocks, then merged).
                let span = crate::engine::kernels::DecodeSpan {
                    lo,
                    len,
                    scale: scale as f32,
                    softcap,
                };
                let q = q.reshape((bsz, h, hd))?.contiguous()?;
                crate::engine::kernels::decode_attention(&q, kc, vc, &cache.pad_mask, span)?
                    .reshape((bsz, n, h * hd))?
            } else {
                let seen = len - lo;
                let (keys, values) = (kc.narrow(2, lo, seen)?, vc.narrow(2, lo, seen)?);
                // Grouped-query attention without copying the cache: the `rep` query heads of
                // a kv head become rows of one matmul against it.
                let q = (q * scale)?.reshape((bsz, kvh, rep * n, hd))?;
                let mut att = q.matmul(&keys.t()?)?.reshape((bsz, kvh, rep, n, seen))?;
                if let Some(cap) = s.attn_softcap() {
                    att = ((att / cap)?.tanh()? * cap)?;
                }
                let mask = match (&window_mask, s.layer_window(l)) {
                    (Some(w), Some(_)) => w.clone(),
                    _ => match &mask {
                        Some(m) => m.narrow(4, lo, seen)?,
                        None => candle_core::bail!("decode_batch: no mask for the ops"),
                    },
                };
                let att = att.broadcast_add(&mask)?;
                let att = candle_nn::ops::softmax_last_dim(&att)?;
                let y = att.reshape((bsz, kvh, rep * n, seen))?.matmul(&values)?;
                y.reshape((bsz, h, n, hd))?
                    .transpose(1, 2)?
                    .reshape((bsz, n, h * hd))?
            };
            let a = self.linear(&b.attn()?.o, &y)?;
            x = (x + self.residual(self.block_output(&b.ln1, b.post_attn.as_ref(), a)?)?)?;
            let m = self.mlp(b, &self.block_input(&b.ln2, &x)?)?;
            // (Detached at every layer's end: with trainable weights candle's autograd would
            // otherwise keep every layer's activations alive through x until the step ends,
            // a prefill's [B, T, ·] of them all at once.)
            x = (x + self.residual(self.block_output(&b.ln2, b.post_mlp.as_ref(), m)?)?)?.detach();
        }
        if !device {
            cache.filled = len;
        }
        let last = x.narrow(1, n - 1, 1)?.reshape((bsz, s.n_embd))?;
        let hidden = self.final_norm(&last)?;
        let logits = if logits {
            let head = match &self.lm_head {
                Some(w) => self.cast(w)?,
                None => wte,
            };
            // (Gemma 2's final soft-cap with them.)
            Some(self.head_logits(&hidden, &head)?.to_dtype(DType::F32)?)
        } else {
            None
        };
        // Detached: the weights are variables, so every op records its inputs; a token drawn
        // from these logits and fed back would otherwise keep every earlier step's activations
        // alive (GPU memory grew with the steps until batch 64 ran out).
        Ok(StepOut {
            logits: logits.map(|l| l.detach()),
            hidden: hidden.to_dtype(DType::F32)?.detach(),
        })
    }

    /// Whether a decode step of `x`'s dtype and device runs attention in the decode kernel
    /// (`kernels.attention` on CUDA, the heads it takes), unless `COCKPIT_DECODE=ops` asks for
    /// the candle ops, to compare.
    pub(super) fn decode_kernel_takes(&self, x: &Tensor) -> bool {
        let s = &self.spec;
        !decode_ops()
            && s.kernels.attention
            && crate::engine::kernels::usable(x)
            && crate::engine::kernels::decode_attention_takes(s.n_head, s.n_kv_head, s.head_dim())
    }

    /// LongRoPE in a batch, as transformers' generation computes it: its rotary embedding
    /// picks the factors by `max(position_ids) + 1` over the whole batch, and Phi-3's
    /// `prepare_inputs_for_generation` drops the cache when `input_ids.shape[1]` (the padded
    /// width) reaches the original context + 1. Both are the cache's columns `len` here: the
    /// batch is padded to its longest prompt, whose positions run `0..len`. (A batch whose rows
    /// are all padded, which `generate_rows` never makes, switches by its columns too.) So
    /// every row switches at once, a shorter one at a length where alone it would keep the
    /// short factors. The keys cached before the crossing hold the short factors: every
    /// filled column is decoded again with the long ones, in one call, whose last column is
    /// the step's. None where the table stays (nothing to switch, or the first call).
    fn switch_to_long_rope(
        &self,
        cache: &mut BatchCache,
        len: usize,
        logits: bool,
    ) -> Result<Option<StepOut>> {
        let long = self.spec.rope_long(len);
        if self.rope.is_none() || long == cache.rope_long {
            return Ok(None);
        }
        let key = RopeKey { local: false, long };
        // (A decode graph reads the tables it replaces.)
        cache.graph = None;
        cache.rope = Some(self.batch_rope(key, &cache.positions)?);
        cache.rope_long = long;
        if cache.filled == 0 {
            return Ok(None);
        }
        let Some(ids) = &cache.ids else {
            candle_core::bail!("decode_batch: the cache kept no ids to decode again at {len}");
        };
        // (A copy: the call writes them back into the cache's ids.)
        let ids = ids.narrow(1, 0, len)?.copy()?;
        cache.filled = 0;
        for layer in cache.layers.iter_mut() {
            if let LayerState::Mamba { state, .. } = layer {
                *state = None;
            }
        }
        self.decode_batch(&ids, cache, logits).map(Some)
    }

    /// Each query's lowest key `[B, n]` (u32) of a prefill's `n` columns (flash attention's
    /// `starts`): a row's first token's column, the window's first column where that is later;
    /// a padding column itself (it sees itself alone, as in [`Self::step_mask`]).
    fn prefill_starts(
        &self,
        cache: &BatchCache,
        n: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let mut st = Vec::with_capacity(cache.batch() * n);
        for &pad in &cache.pads {
            for q in 0..n {
                let low = window.map_or(0, |w| (q + 1).saturating_sub(w));
                st.push(if q < pad { q } else { pad.max(low) } as u32);
            }
        }
        Tensor::from_vec(st, (cache.batch(), n), &self.device)
    }

    /// The additive mask `[B, 1, 1, n, len]` of `n` new columns after `cache.filled`: a row
    /// sees its own columns up to the query's, none of its padding, and with a `window` only
    /// the last `window` of them (a sliding layer's); a padding column sees itself alone (its
    /// values are never read, and a row of -inf would be NaN).
    fn step_mask(&self, cache: &BatchCache, n: usize, window: Option<usize>) -> Result<Tensor> {
        let (bsz, start) = (cache.batch(), cache.filled);
        let len = start + n;
        if n == 1 && window.is_none() {
            // One new column, after every prompt: the padding is all it must not see.
            return cache
                .pad_mask
                .narrow(1, 0, len)?
                .reshape((bsz, 1, 1, 1, len));
        }
        let mut m = Vec::with_capacity(bsz * n * len);
        for &pad in &cache.pads {
            for j in 0..n {
                let q = start + j;
                // (the window's first column: positions and columns differ by the row's pad)
                let low = window.map_or(0, |w| (q + 1).saturating_sub(w));
                for c in 0..len {
                    let seen = (c >= pad && c >= low && c <= q) || c == q;
                    m.push(if seen { 0.0 } else { f32::NEG_INFINITY });
                }
            }
        }
        Tensor::from_vec(m, (bsz, 1, 1, n, len), &self.device)?.to_dtype(self.dtype)
    }
}
