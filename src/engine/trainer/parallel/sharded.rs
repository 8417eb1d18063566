//! ZeRO-1 (`distributed.shard_optimizer`): each rank keeps and updates its range of the
//! optimizer state; gradients are reduce-scattered and weights all-gathered. The shard's
//! arithmetic is [`crate::engine::zero`]; this is when and with what it runs.

use super::{share, sum_flat, DataParallel, Local, Parts, Penalty, Reduced};
use crate::distributed::Collective;
use crate::engine::kernels::ModelStep;
use crate::engine::optim::AdamW;
use crate::engine::zero::{packed_places, Shard};
use crate::engine::EngineError;
use candle_core::{DType, Tensor};

pub(super) struct Sharded {
    group: Box<dyn Collective>,
    /// `distributed.reduce_dtype = "bf16"`.
    bf16: bool,
    /// The bf16 buffer the ranks sum the flat gradient buffer in (allocated at the first sum).
    wire: Option<Tensor>,
    /// This rank's share of the optimizer state, built at the first reduction (the flat
    /// layout is known then).
    shard: Option<Shard>,
    /// On the whole-model step the last update wrote only this rank's range of the fp32
    /// master weights (and every rank's bf16 copies came by all-gather), so the masters
    /// outside that range are stale until [`DataParallel::whole_masters`] gathers them —
    /// which every reader of the fp32 weights (checkpoints, evaluation, samples, the end)
    /// calls first.
    masters_partial: bool,
}

fn no_shard() -> EngineError {
    EngineError::Config("optimizer sharding: no shard before the first step's reduction".into())
}

impl Sharded {
    pub(super) fn new(group: Box<dyn Collective>, bf16: bool) -> Self {
        Sharded {
            group,
            bf16,
            wire: None,
            shard: None,
            masters_partial: false,
        }
    }

    /// The shard, built on the first call from the whole-model step's flat gradient buffer
    /// (every trainable weight must be a view of it) or from the gradients packed.
    fn shard_for(
        &mut self,
        opt: &mut AdamW,
        whole: Option<&ModelStep>,
        grads: &[Tensor],
        device: &candle_core::Device,
    ) -> Result<&Shard, EngineError> {
        if self.shard.is_none() {
            let (rank, world) = (self.group.rank(), self.group.world());
            let (places, total) = match whole.and_then(|w| w.grad_buffer()) {
                Some(buf) => {
                    let inside = opt
                        .slots
                        .iter()
                        .all(|s| whole.is_some_and(|w| matches!(w.grad_of(&s.var), Ok(Some(_)))));
                    if !inside {
                        return Err(EngineError::Config(
                            "distributed.shard_optimizer: a trainable weight is not in the step's gradient buffer".into(),
                        ));
                    }
                    let places = grads
                        .iter()
                        .map(|g| (g.layout().start_offset(), g.elem_count()))
                        .collect::<Vec<_>>();
                    (places, buf.elem_count())
                }
                None => {
                    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
                    packed_places(&sizes, world)
                }
            };
            self.shard = Some(Shard::new(opt, places, total, rank, world, device)?);
        }
        self.shard.as_ref().ok_or_else(no_shard)
    }
}

impl DataParallel for Sharded {
    fn group(&mut self) -> Option<&mut dyn Collective> {
        Some(self.group.as_mut())
    }

    fn backend(&self) -> Option<&'static str> {
        Some(self.group.backend())
    }

    fn sharded(&self) -> bool {
        true
    }

    fn masters_partial(&self) -> bool {
        self.masters_partial
    }

    /// The flat gradient buffer (the whole-model step's, or the gradients packed)
    /// reduce-scattered — unless the step summed it already, bucket by bucket — and Σg² over
    /// this rank's range; on the whole-model step also Σw² of this rank's range of the
    /// regularized weights, and the penalty's gradient added to that range (world times, as
    /// the update divides the sum by the world). Both sums ride on the host all-reduce.
    fn reduce(
        &mut self,
        parts: Parts<'_>,
        local: Local,
        penalty: Penalty<'_>,
    ) -> Result<Reduced, EngineError> {
        let Parts { opt, whole, device } = parts;
        let world = self.group.world() as f64;
        let shard = self.shard_for(opt, whole.as_deref(), &local.grads, device)?;
        let flat = match whole.as_deref().and_then(|w| w.grad_buffer()) {
            Some(b) => b.clone(),
            None => shard.pack(&local.grads)?,
        };
        let range = shard.range();
        if !whole.as_deref().is_some_and(|w| w.overlaps_grad_sums()) {
            sum_flat(
                self.group.as_mut(),
                &mut self.wire,
                self.bf16,
                &flat,
                Some(range),
            )?;
        }
        let shard = self.shard.as_ref().ok_or_else(no_shard)?;
        // The whole-model step's SCU term, from this rank's range (exact there, whatever the
        // rest holds); off the whole-model step the per-op path keeps it in its loss.
        let reg_sumsq = match whole {
            None => None,
            Some(_) if penalty.reg_slots.is_empty() => Some(0.0),
            Some(w) => {
                let sumsq = match penalty.sumsq_due {
                    true => Some(shard.weight_sumsq(opt, penalty.reg_slots)?),
                    false => None,
                };
                if penalty.grad_factor != 0.0 {
                    let pieces: Vec<(&candle_core::Var, usize, usize)> = shard
                        .pieces_of(penalty.reg_slots)
                        .into_iter()
                        .map(|(slot, at, n)| (&opt.slots[slot].var, at, n))
                        .collect();
                    w.add_scaled_pieces(&pieces, penalty.grad_factor * world)?;
                }
                sumsq
            }
        };
        let sq = shard.grad_sumsq(&flat)?;
        let shared = share(self.group.as_mut(), &local, [sq, reg_sumsq.unwrap_or(0.0)])?;
        device.synchronize()?;
        Ok(Reduced {
            ce: shared.ce,
            grads: local.grads,
            ranks: shared.ranks,
            grad_scale: 1.0 / world,
            sharded: Some((flat, shared.sums[0])),
            reg_sumsq: reg_sumsq.map(|_| shared.sums[1]),
            time_due: shared.time_due,
        })
    }

    /// This rank's range updated, then all-gathered. On the whole-model step the update
    /// writes its range's bf16 compute copies and those are gathered (half the bytes of the
    /// fp32 weights, and no cast or scatter after): the step computes with them, and the fp32
    /// masters outside this rank's range wait for [`DataParallel::whole_masters`]. Otherwise
    /// the fp32 weights are gathered and every rank's weights set from them (the step's bf16
    /// copies are cast again).
    fn update(
        &mut self,
        parts: Parts<'_>,
        r: &Reduced,
        lr: f64,
        f: f64,
    ) -> Result<bool, EngineError> {
        let Some((flat, _)) = &r.sharded else {
            return Err(EngineError::Config(
                "optimizer sharding: the reduction left no sharded gradients".into(),
            ));
        };
        let shard = self.shard.as_mut().ok_or_else(no_shard)?;
        // (The update decides, from every weight, whether the step's copies take it.)
        let step = parts
            .whole
            .as_deref()
            .filter(|w| w.weight_buffer().is_some());
        if shard.update(parts.opt, flat, lr, f, step)? {
            if let Some(copies) = step.and_then(|w| w.weight_buffer()) {
                self.group.all_gather_in_place(copies)?;
                self.masters_partial = true;
                return Ok(true);
            }
        }
        self.group.all_gather_in_place(flat)?;
        shard.scatter_weights(parts.opt, flat)?;
        self.masters_partial = false;
        Ok(false)
    }

    /// Each rank's range of the masters into the gradient buffer (free between steps), and
    /// an all-gather.
    fn whole_masters(&mut self, parts: Parts<'_>) -> Result<(), EngineError> {
        if !self.masters_partial {
            return Ok(());
        }
        let (Some(shard), Some(flat)) = (
            self.shard.as_ref(),
            parts.whole.as_deref().and_then(|w| w.grad_buffer()),
        ) else {
            return Err(EngineError::Config(
                "optimizer sharding: partial weights without the step's buffer".into(),
            ));
        };
        shard.masters_into(parts.opt, flat)?;
        self.group.all_gather_in_place(flat)?;
        shard.scatter_weights(parts.opt, flat)?;
        self.masters_partial = false;
        Ok(())
    }

    /// Every slot's full moments (on rank 0; the others take part and drop them). The
    /// gradient buffer is free between steps and serves as scratch.
    fn gather_moments(
        &mut self,
        parts: Parts<'_>,
    ) -> Result<Option<Vec<(String, Tensor)>>, EngineError> {
        let Some(shard) = self.shard.as_ref() else {
            return Ok(None);
        };
        let scratch = match parts.whole.as_deref().and_then(|w| w.grad_buffer()) {
            Some(b) => b.clone(),
            None => Tensor::zeros(shard.total(), DType::F32, parts.device)?,
        };
        let m = shard.gather_moments(parts.opt, self.group.as_mut(), &scratch)?;
        Ok((self.group.rank() == 0).then_some(m))
    }

    /// Both from the ranks' own ranges (the weights outside them may be stale), summed.
    fn penalty_stats(
        &mut self,
        opt: &AdamW,
        reg_slots: &[usize],
    ) -> Result<(f64, f64), EngineError> {
        let Some(shard) = self.shard.as_ref() else {
            return Ok(opt.penalty_stats(reg_slots)?);
        };
        let mut sums = [
            shard.weight_sumsq(opt, reg_slots)?,
            shard.penalty_weighted(opt, reg_slots)?,
        ];
        self.group.all_reduce_host(&mut sums)?;
        Ok((sums[0], sums[1]))
    }

    /// This rank keeps its range of the moments just loaded; every weight is whole again.
    fn absorb(&mut self, opt: &mut AdamW) -> Result<(), EngineError> {
        self.masters_partial = false;
        if let Some(shard) = self.shard.as_mut() {
            shard.absorb(opt)?;
        }
        Ok(())
    }
}
