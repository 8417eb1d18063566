//! ZeRO-1 (`distributed.shard_optimizer`): each rank keeps and updates its range of the
//! optimizer state; gradients are reduce-scattered and weights all-gathered.

use super::Trainer;
use crate::engine::EngineError;
use candle_core::{DType, Tensor};

impl Trainer {
    /// ZeRO-1's optimizer step: this rank's range updated, then all-gathered. On the
    /// whole-model step the update writes its range's bf16 compute copies and those are
    /// gathered (half the bytes of the fp32 weights, and no cast or scatter after): the
    /// step computes with them, and the fp32 masters outside this rank's range wait for
    /// [`Self::full_masters`]. Otherwise the fp32 weights are gathered and every rank's
    /// weights set from them (the step's bf16 copies are cast again).
    pub(super) fn sharded_update(
        &mut self,
        flat: &Tensor,
        lr: f64,
        grad_scale: f64,
    ) -> Result<(), EngineError> {
        let (Some(shard), Some(d)) = (self.shard.as_mut(), self.dist.as_mut()) else {
            return Err(EngineError::Config(
                "optimizer sharding without ranks".into(),
            ));
        };
        // (The update decides, from every weight, whether the step's copies take it.)
        let step = self
            .whole_step
            .as_ref()
            .filter(|w| w.weight_buffer().is_some());
        if shard.update(&mut self.opt, flat, lr, grad_scale, step)? {
            if let Some(copies) = step.and_then(|w| w.weight_buffer()) {
                d.all_gather_in_place(copies)?;
                self.weights_copied = true;
                self.masters_partial = true;
                return Ok(());
            }
        }
        d.all_gather_in_place(flat)?;
        shard.scatter_weights(&self.opt, flat)?;
        self.weights_copied = false;
        self.masters_partial = false;
        Ok(())
    }

    /// ZeRO-1: every rank's fp32 master weights made whole again after updates that left
    /// them partial (each rank's range into the gradient buffer, free between steps, and
    /// an all-gather). A collective: every rank calls it at the same points (before a
    /// checkpoint, an evaluation, and at the end). Nothing to do otherwise.
    pub(super) fn full_masters(&mut self) -> Result<(), EngineError> {
        if !self.masters_partial {
            return Ok(());
        }
        let (Some(shard), Some(d), Some(flat)) = (
            self.shard.as_ref(),
            self.dist.as_mut(),
            self.whole_step.as_ref().and_then(|w| w.grad_buffer()),
        ) else {
            return Err(EngineError::Config(
                "optimizer sharding: partial weights without ranks".into(),
            ));
        };
        shard.masters_into(&self.opt, flat)?;
        d.all_gather_in_place(flat)?;
        shard.scatter_weights(&self.opt, flat)?;
        self.masters_partial = false;
        Ok(())
    }

    /// ZeRO-1: every slot's full moments for a checkpoint (on rank 0; the others take part
    /// and drop them). The gradient buffer is free between steps and serves as scratch.
    pub(super) fn gather_moments(&mut self) -> Result<Option<Vec<(String, Tensor)>>, EngineError> {
        let (Some(shard), Some(d)) = (self.shard.as_ref(), self.dist.as_mut()) else {
            return Ok(None);
        };
        let scratch = match self.whole_step.as_ref().and_then(|w| w.grad_buffer()) {
            Some(b) => b.clone(),
            None => Tensor::zeros(shard.total(), DType::F32, &self.device)?,
        };
        let m = shard.gather_moments(&self.opt, d.as_mut(), &scratch)?;
        Ok((self.rank == 0).then_some(m))
    }

    /// ZeRO-1 is on: several ranks and `distributed.shard_optimizer`.
    pub(super) fn sharding(&self) -> bool {
        self.world > 1 && self.cfg.distributed.shard_optimizer
    }

    /// ZeRO-1, after the backward: the flat gradient buffer (the whole-model step's, or the
    /// gradients packed) reduce-scattered — unless the step summed it already, bucket by
    /// bucket — and Σg² over this rank's range. On the whole-model step also Σw² of this
    /// rank's range of the regularized weights, and the penalty's gradient added to that
    /// range (world times, as the update divides the sum by the world). The shard is built
    /// on the first call.
    pub(super) fn shard_reduce(
        &mut self,
        grads: &[Tensor],
    ) -> Result<(Tensor, f64, Option<f64>), EngineError> {
        let buffer = self
            .whole_step
            .as_ref()
            .and_then(|w| w.grad_buffer())
            .cloned();
        if self.shard.is_none() {
            let (places, total) = match &buffer {
                Some(buf) => {
                    let places = grads
                        .iter()
                        .map(|g| (g.layout().start_offset(), g.elem_count()))
                        .collect::<Vec<_>>();
                    // Every trainable weight must be a view of the buffer.
                    let inside = self.opt.slots.iter().all(|s| {
                        self.whole_step
                            .as_ref()
                            .is_some_and(|w| matches!(w.grad_of(&s.var), Ok(Some(_))))
                    });
                    if !inside {
                        return Err(EngineError::Config(
                            "distributed.shard_optimizer: a trainable weight is not in the step's gradient buffer".into(),
                        ));
                    }
                    (places, buf.elem_count())
                }
                None => {
                    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
                    crate::engine::zero::packed_places(&sizes, self.world)
                }
            };
            let shard = crate::engine::zero::Shard::new(
                &mut self.opt,
                places,
                total,
                self.rank,
                self.world,
                &self.device,
            )?;
            self.shard = Some(shard);
        }
        let Some(shard) = self.shard.as_ref().filter(|_| self.dist.is_some()) else {
            return Err(EngineError::Config(
                "optimizer sharding without ranks".into(),
            ));
        };
        let flat = match buffer {
            Some(b) => b,
            None => shard.pack(grads)?,
        };
        let range = shard.range();
        if !self
            .whole_step
            .as_ref()
            .is_some_and(|w| w.overlaps_grad_sums())
        {
            self.sum_grad_buffer(&flat, Some(range))?;
        }
        let reg = self.shard_penalty()?;
        let sq = match self.shard.as_ref() {
            Some(s) => s.grad_sumsq(&flat)?,
            None => 0.0,
        };
        Ok((flat, sq, reg))
    }

    /// The whole-model step's SCU term under ZeRO-1, from this rank's range (exact there,
    /// whatever the rest holds): Σw² of its regularized pieces when the controller reads it
    /// after this step (None otherwise, and off the whole-model step, whose per-op path keeps
    /// the term in its loss), and λ's gradient 2·λ·coef·w added to its range of the summed
    /// gradients.
    pub(super) fn shard_penalty(&mut self) -> Result<Option<f64>, EngineError> {
        let control_due = self.control_due();
        let coef = self.penalty_coef();
        let (Some(shard), Some(whole)) = (self.shard.as_ref(), self.whole_step.as_mut()) else {
            return Ok(None);
        };
        if self.reg_slots.is_empty() {
            return Ok(Some(0.0));
        }
        let sumsq = match control_due {
            true => Some(shard.weight_sumsq(&self.opt, &self.reg_slots)?),
            false => None,
        };
        let lambda = self.scu.lambda;
        if lambda != 0.0 {
            let a = 2.0 * lambda * coef * self.world as f64 * self.scaler.scale;
            let pieces: Vec<(&candle_core::Var, usize, usize)> = shard
                .pieces_of(&self.reg_slots)
                .into_iter()
                .map(|(slot, at, n)| (&self.opt.slots[slot].var, at, n))
                .collect();
            whole.add_scaled_pieces(&pieces, a)?;
        }
        Ok(sumsq)
    }
}
