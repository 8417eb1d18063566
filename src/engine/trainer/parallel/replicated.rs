//! DDP: every rank holds the whole optimizer state and takes the same step on the mean of
//! the ranks' gradients.

use super::{share, sum_flat, DataParallel, Local, Parts, Penalty, Reduced};
use crate::distributed::Collective;
use crate::engine::EngineError;
use candle_core::{DType, Tensor};

/// Gradients go to the all-reduce in buckets of at most this many elements (one flat f32
/// buffer each: a few large collectives instead of one per tensor, with bounded extra memory).
const BUCKET_ELEMS: usize = 1 << 25;

pub(super) struct Replicated {
    group: Box<dyn Collective>,
    /// `distributed.reduce_dtype = "bf16"`.
    bf16: bool,
    /// The bf16 buffer the ranks sum the flat gradient buffer in (allocated at the first sum).
    wire: Option<Tensor>,
}

impl Replicated {
    pub(super) fn new(group: Box<dyn Collective>, bf16: bool) -> Self {
        Replicated {
            group,
            bf16,
            wire: None,
        }
    }
}

impl DataParallel for Replicated {
    fn group(&mut self) -> Option<&mut dyn Collective> {
        Some(self.group.as_mut())
    }

    fn backend(&self) -> Option<&'static str> {
        Some(self.group.backend())
    }

    fn reduce(
        &mut self,
        parts: Parts<'_>,
        local: Local,
        _penalty: Penalty<'_>,
    ) -> Result<Reduced, EngineError> {
        let shared = share(self.group.as_mut(), &local, [0.0; 2])?;
        let world = self.group.world() as f64;
        let whole = parts.whole.as_deref();
        let flat = whole.and_then(|w| w.grad_buffer()).cloned();
        let summed = whole.is_some_and(|w| w.overlaps_grad_sums());
        // The whole-model step's gradients are views of one flat buffer: summed in place in
        // one call (or already, bucket by bucket during the backward), and the 1/world left
        // to the optimizer's gradient scale (no copies).
        let (grads, grad_scale) = match flat {
            Some(_) if summed => (local.grads, 1.0 / world),
            Some(flat) => {
                sum_flat(self.group.as_mut(), &mut self.wire, self.bf16, &flat, None)?;
                (local.grads, 1.0 / world)
            }
            None => (
                all_reduce_mean(self.group.as_mut(), &local.grads, self.bf16)?,
                1.0,
            ),
        };
        // Wait for the all-reduce here (not in the optimizer), so a stuck peer is seen as one.
        parts.device.synchronize()?;
        Ok(Reduced {
            ce: shared.ce,
            grads,
            ranks: shared.ranks,
            grad_scale,
            sharded: None,
            reg_sumsq: None,
            time_due: shared.time_due,
        })
    }
}

/// The mean of every rank's gradients, summed in buckets of up to [`BUCKET_ELEMS`] values
/// (`bf16`: each bucket summed in bf16, as `distributed.reduce_dtype = "bf16"` asks).
fn all_reduce_mean(
    d: &mut dyn Collective,
    grads: &[Tensor],
    bf16: bool,
) -> Result<Vec<Tensor>, EngineError> {
    let scale = 1.0 / d.world() as f64;
    let mut out = Vec::with_capacity(grads.len());
    let mut i = 0;
    while i < grads.len() {
        let (mut j, mut n) = (i, 0);
        while j < grads.len() && (j == i || n + grads[j].elem_count() <= BUCKET_ELEMS) {
            n += grads[j].elem_count();
            j += 1;
        }
        let flat = grads[i..j]
            .iter()
            .map(|g| g.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let sum = if bf16 {
            let wire = Tensor::cat(&flat, 0)?.to_dtype(DType::BF16)?;
            d.all_reduce_sum(wire)?.to_dtype(DType::F32)?
        } else {
            d.all_reduce_sum(Tensor::cat(&flat, 0)?)?
        };
        let mean = (sum * scale)?;
        let mut off = 0;
        for g in &grads[i..j] {
            let k = g.elem_count();
            out.push(mean.narrow(0, off, k)?.reshape(g.shape())?);
            off += k;
        }
        i = j;
    }
    Ok(out)
}
