//! Packed rows in the candle model: several samples in one row of `seq_len`, each attending
//! only to itself (a block-diagonal causal mask from the segment ids) with positions that
//! restart at each sample; and the loss over the targets that train.

use super::*;

/// The layout of the packed rows of the next forward ([`Model::set_segments`]).
#[derive(Clone, Debug)]
pub(super) struct Packed {
    /// (batch, seq_len) it was built for.
    pub dims: (usize, usize),
    /// Each slot's position in its sample, `[B·T]` u32.
    pub positions: Tensor,
    /// 0 where slot i may attend to slot j (same sample, j ≤ i), −∞ elsewhere: `[B, 1, T, T]`.
    pub mask: Tensor,
    /// The longest sample's length (what a LongRoPE model picks its factors by, as
    /// transformers does with `max(position_ids) + 1`).
    pub len: usize,
    /// A hybrid's Mamba layers: where each sample's conv window and scan state begin again
    /// (built once a batch for all of its Mamba layers).
    pub mamba: Option<ssd::SampleResets>,
}

impl Packed {
    /// RoPE cos/sin `[B, 1, T, hd]` of a table at the restarted positions.
    pub fn pick_rope(&self, (cos, sin): &(Tensor, Tensor)) -> Result<(Tensor, Tensor)> {
        let (b, t) = self.dims;
        let hd = cos.dim(1)?;
        let pick = |x: &Tensor| x.index_select(&self.positions, 0)?.reshape((b, 1, t, hd));
        Ok((pick(cos)?, pick(sin)?))
    }
}

/// Each slot's position in its sample: 0 at every change of segment id.
/// (The CUDA step's sample starts, [`kernels::rows::sample_starts`], subtracted from each
/// slot's column.)
pub fn positions(segments: &[u32], t: usize) -> Vec<u32> {
    kernels::rows::sample_starts(segments, t)
        .into_iter()
        .enumerate()
        .map(|(i, start)| (i % t.max(1)) as u32 - start as u32)
        .collect()
}

/// How a batch's loss is taken: the targets (ids; those that do not train replaced by 0),
/// each slot's weight (1: trains, 0: not) and how many train.
pub struct Masked {
    pub targets: Tensor,
    pub weights: Tensor,
    pub count: usize,
}

impl Masked {
    /// From targets where `ignore` marks those that do not train; `[B, T]` on `device`.
    pub fn new(
        targets: &[u32],
        ignore: u32,
        shape: (usize, usize),
        device: &Device,
    ) -> Result<Self> {
        let ids: Vec<u32> = targets
            .iter()
            .map(|&y| if y == ignore { 0 } else { y })
            .collect();
        let w: Vec<f32> = targets
            .iter()
            .map(|&y| f32::from(u8::from(y != ignore)))
            .collect();
        let count = w.iter().filter(|&&x| x > 0.0).count();
        Ok(Self {
            targets: Tensor::from_vec(ids, shape, device)?,
            weights: Tensor::from_vec(w, shape.0 * shape.1, device)?,
            count,
        })
    }
}

impl Model {
    /// Sample boundaries for the next forwards of `[batch, seq_len]` ids (None: each row is
    /// one sequence, plain causal attention).
    pub fn set_segments(&mut self, segments: Option<&[u32]>, batch: usize) -> Result<()> {
        let Some(seg) = segments else {
            self.packed = None;
            return Ok(());
        };
        let t = seg.len() / batch.max(1);
        let mamba = match &self.spec.hybrid {
            Some(h) if h.layers.contains(&crate::config::MixerKind::Mamba) => {
                let starts: Vec<usize> = kernels::rows::sample_starts(seg, t)
                    .into_iter()
                    .map(|s| s as usize)
                    .collect();
                let (chunk, taps) = (h.mamba_chunk_size, h.mamba_d_conv);
                let dev = &self.device;
                Some(ssd::SampleResets::new(
                    &starts, batch, t, chunk, taps, self.dtype, dev,
                )?)
            }
            _ => None,
        };
        let pos = positions(seg, t);
        let len = pos.iter().max().map_or(0, |&p| p as usize + 1);
        let mut mask = vec![0f32; batch * t * t];
        for b in 0..batch {
            let s = &seg[b * t..(b + 1) * t];
            for i in 0..t {
                for j in 0..t {
                    if j > i || s[i] != s[j] {
                        mask[(b * t + i) * t + j] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        let positions = Tensor::from_vec(pos, batch * t, &self.device)?;
        let mask = Tensor::from_vec(mask, (batch, 1, t, t), &self.device)?.to_dtype(self.dtype)?;
        self.packed = Some(Packed {
            dims: (batch, t),
            positions,
            mask,
            len,
            mamba,
        });
        Ok(())
    }

    /// The packed layout for a forward of `(batch, seq_len)`, when one is set for it.
    pub(super) fn packed_for(&self, dims: (usize, usize)) -> Option<&Packed> {
        self.packed.as_ref().filter(|p| p.dims == dims)
    }

    /// Mean cross-entropy in nats over the targets that train (Σ w·CE / Σ w): the tokens that
    /// do not train cost nothing but their place in the batch.
    pub fn masked_loss(&mut self, ids: &Tensor, m: &Masked, train: bool) -> Result<Tensor> {
        let per = self.token_losses_graph(ids, &m.targets, train)?;
        let ce = ((per * &m.weights)?.sum_all()? / m.count.max(1) as f64)?;
        self.with_router_aux(ce, train)
    }

    /// Cross-entropy of each prediction `[B·T]` (f32), in the graph.
    fn token_losses_graph(
        &mut self,
        ids: &Tensor,
        targets: &Tensor,
        train: bool,
    ) -> Result<Tensor> {
        if self.fused_head_loss() {
            let (x, head) = self.hidden(ids, train)?;
            return kernels::lm_head_cross_entropy(&x, &head, targets)?.to_dtype(DType::F32);
        }
        let logits = self.forward(ids, train)?;
        let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
        let t = targets.flatten_all()?.unsqueeze(1)?;
        logp.gather(&t, 1)?.squeeze(1)?.neg()
    }
}
