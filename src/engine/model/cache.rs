//! The decode state of a batch of sequences: one state per layer, allocated once for the
//! prompts and every new token ([`Model::batch_cache`]), written in place as the batch
//! decodes ([`Model::decode_batch`]), and the batch's layout (left padding, positions).

use super::*;

/// Whether a batch's prefill runs its attention in flash attention's forward by default: yes
/// (held to the ops by `tests/gpu_kernels.rs`'s `flash_prefill_equals_the_ops_prefill`),
/// unless `COCKPIT_PREFILL=ops` (read once) keeps the candle ops, to compare.
pub(super) fn flash_prefill_default() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("COCKPIT_PREFILL").as_deref() != Ok("ops"))
}

/// What one layer keeps between decode steps.
pub enum LayerState {
    /// Attention: keys and values `[B, kv_heads, capacity, head_dim]` in the compute dtype,
    /// columns `0..filled` written.
    Kv { k: Tensor, v: Tensor },
    /// A hybrid's Mamba layer: every row's conv inputs and scan state after its tokens so far
    /// (None before the first; replaced, not grown, each step), and the mixer's
    /// [`super::mamba::MambaConsts`], taken at the first step for all of them.
    Mamba {
        state: Option<super::mamba::MambaState>,
        consts: Option<super::mamba::MambaConsts>,
    },
}

/// The per-layer states of a batch and where its rows' tokens are: every row is left-padded
/// to the longest prompt, so that column `c` is the same step for every row and row `b`'s
/// token at column `c` has position `c - pads[b]`.
pub struct BatchCache {
    pub(super) layers: Vec<LayerState>,
    /// Columns decoded so far.
    pub(super) filled: usize,
    pub(super) capacity: usize,
    /// Left padding of each row.
    pub(super) pads: Vec<usize>,
    /// `[B, capacity]`: 0 where a column holds one of the row's tokens, -inf on its padding
    /// (compute dtype).
    pub(super) pad_mask: Tensor,
    /// `[B, capacity]` (u32): the position of each column in its row (0 on the padding).
    pub(super) positions: Tensor,
    /// RoPE cos and sin of each row's columns, `[B, capacity, rotary_dim]`: LongRoPE's long
    /// factors once the columns pass the original context (`rope_long`).
    pub(super) rope: Option<(Tensor, Tensor)>,
    /// Whether `rope` holds LongRoPE's long factors.
    pub(super) rope_long: bool,
    /// `[B, capacity]` (u32): the ids of the filled columns, where the columns may cross a
    /// LongRoPE model's original context (the crossing decodes them all again with the long
    /// factors); None otherwise.
    pub(super) ids: Option<Tensor>,
    /// The same for the sliding layers' own θ (Gemma 3's `rope_local_base_freq`), where the
    /// model has one.
    pub(super) rope_local: Option<(Tensor, Tensor)>,
    /// The decode step's buffers and, from the second step, its CUDA graph
    /// ([`super::decode_graph`]); None before, and once anything it reads is replaced.
    pub(super) graph: Option<Box<super::graph_buffers::DecodeGraph>>,
    /// Decode steps run without a graph (it does not apply, or its capture failed).
    pub(super) graph_off: bool,
    /// The failed capture's error.
    pub(super) graph_error: Option<String>,
    /// A prefill's attention in flash attention's forward where it takes the model (CUDA,
    /// bf16, its head dims): by default; `COCKPIT_PREFILL=ops` or [`Self::set_flash_prefill`]
    /// turns it off.
    pub(super) flash_prefill: bool,
}

impl BatchCache {
    /// Columns decoded so far (the longest prompt, then one per step).
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// Columns the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn batch(&self) -> usize {
        self.pads.len()
    }

    /// Whether a prefill's attention runs in flash attention's forward where it takes the
    /// model (CUDA, bf16, its head dims) instead of the candle ops.
    pub fn set_flash_prefill(&mut self, on: bool) {
        self.flash_prefill = on;
    }

    /// Left padding of each row.
    pub fn pads(&self) -> &[usize] {
        &self.pads
    }

    /// A cache of `from.len()` rows, row `r` a copy of this cache's row `from[r]` (its keys
    /// and values, padding and positions): a prompt prefilled once, then its state copied to
    /// each of its samples. Allocated here, for the whole capacity.
    pub fn rows(&self, from: &[usize]) -> Result<BatchCache> {
        let b = self.batch();
        if let Some(bad) = from.iter().find(|&&r| r >= b) {
            candle_core::bail!("BatchCache::rows: row {bad} of a batch of {b}");
        }
        let dev = self.pad_mask.device();
        let idx = Tensor::from_vec(
            from.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            from.len(),
            dev,
        )?;
        let pick = |t: &Tensor| t.index_select(&idx, 0);
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kv { k, v } => Ok(LayerState::Kv {
                    k: pick(k)?,
                    v: pick(v)?,
                }),
                LayerState::Mamba { state, consts } => Ok(LayerState::Mamba {
                    state: match state {
                        Some((conv, ssm)) => Some((pick(conv)?, pick(ssm)?)),
                        None => None,
                    },
                    consts: consts.clone(),
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        let pick2 = |r: &Option<(Tensor, Tensor)>| -> Result<Option<(Tensor, Tensor)>> {
            match r {
                Some((cos, sin)) => Ok(Some((pick(cos)?, pick(sin)?))),
                None => Ok(None),
            }
        };
        let (rope, rope_local) = (pick2(&self.rope)?, pick2(&self.rope_local)?);
        Ok(BatchCache {
            layers,
            filled: self.filled,
            capacity: self.capacity,
            pads: from.iter().map(|&r| self.pads[r]).collect(),
            pad_mask: pick(&self.pad_mask)?,
            positions: pick(&self.positions)?,
            rope,
            rope_long: self.rope_long,
            ids: self.ids.as_ref().map(pick).transpose()?,
            rope_local,
            graph: None,
            graph_off: false,
            graph_error: None,
            flash_prefill: flash_prefill_default(),
        })
    }
}

impl Model {
    /// The state of a batch whose rows have `pads[b]` columns of left padding, for
    /// `capacity` columns in all (the longest prompt + the new tokens): allocated here,
    /// once.
    pub fn batch_cache(&self, pads: &[usize], capacity: usize) -> Result<BatchCache> {
        let s = &self.spec;
        let bsz = pads.len();
        if let Some(max) = self.max_positions() {
            let longest = pads.iter().map(|p| capacity - p.min(&capacity)).max();
            if longest.unwrap_or(0) > max {
                candle_core::bail!(
                    "{} positions are past the model's {max} learned positions",
                    longest.unwrap_or(0)
                );
            }
        }
        let dev = &self.device;
        let shape = (bsz, s.n_kv_head, capacity, s.head_dim());
        let layers = self
            .blocks
            .iter()
            .map(|b| match b.mixer {
                Mixer::Mamba(_) => Ok(LayerState::Mamba {
                    state: None,
                    consts: None,
                }),
                Mixer::Attention(_) => Ok(LayerState::Kv {
                    k: Tensor::zeros(shape, self.dtype, dev)?,
                    v: Tensor::zeros(shape, self.dtype, dev)?,
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut pos = Vec::with_capacity(bsz * capacity);
        let mut mask = Vec::with_capacity(bsz * capacity);
        for &p in pads {
            for c in 0..capacity {
                pos.push(c.saturating_sub(p) as u32);
                mask.push(if c < p { f32::NEG_INFINITY } else { 0.0 });
            }
        }
        let positions = Tensor::from_vec(pos, (bsz, capacity), dev)?;
        let pad_mask = Tensor::from_vec(mask, (bsz, capacity), dev)?.to_dtype(self.dtype)?;
        let local = RopeKey {
            local: true,
            long: false,
        };
        // (The short factors: the first call switches to the long ones where its columns
        // pass the original context.)
        let (rope, rope_local) = match self.rope {
            Some(_) => (
                Some(self.batch_rope(RopeKey::default(), &positions)?),
                s.rope_keys()
                    .contains(&local)
                    .then(|| self.batch_rope(local, &positions))
                    .transpose()?,
            ),
            None => (None, None),
        };
        let ids = s
            .rope_long(capacity)
            .then(|| Tensor::zeros((bsz, capacity), DType::U32, dev))
            .transpose()?;
        Ok(BatchCache {
            layers,
            filled: 0,
            capacity,
            pads: pads.to_vec(),
            pad_mask,
            positions,
            rope,
            rope_long: false,
            ids,
            rope_local,
            graph: None,
            graph_off: false,
            graph_error: None,
            flash_prefill: flash_prefill_default(),
        })
    }

    /// cos/sin `[B, capacity, rotary_dim]` of each row's `positions` `[B, capacity]` from
    /// the table of `key`.
    pub(super) fn batch_rope(&self, key: RopeKey, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (bsz, capacity) = positions.dims2()?;
        let (cos, sin) = rope_tables(
            &self.spec.rope_freqs(key),
            0,
            capacity,
            self.dtype,
            &self.device,
        )?;
        let rd = cos.dim(1)?;
        let flat = positions.flatten_all()?;
        Ok((
            cos.index_select(&flat, 0)?.reshape((bsz, capacity, rd))?,
            sin.index_select(&flat, 0)?.reshape((bsz, capacity, rd))?,
        ))
    }
}
