//! Data parallelism as one strategy behind [`DataParallel`], chosen once at setup:
//! - [`single::Single`]: one process; everything passes through;
//! - [`replicated::Replicated`] (DDP): every rank holds the whole optimizer state; after the
//!   backward the gradients' mean over the ranks (bucketed all-reduce, or the whole-model
//!   step's flat buffer summed in place);
//! - [`sharded::Sharded`] (ZeRO-1, `distributed.shard_optimizer`): each rank keeps and updates
//!   its range of the optimizer state; gradients are reduce-scattered and weights all-gathered.
//!
//! The training loop calls the same methods whatever the strategy; what a strategy needs of
//! the trainer for one call it borrows through [`Parts`].

mod replicated;
mod sharded;
mod single;

use crate::distributed::Collective;
use crate::engine::events::RankStat;
use crate::engine::kernels::ModelStep;
use crate::engine::model::Param;
use crate::engine::optim::{global_norm, AdamW};
use crate::engine::EngineError;
use candle_core::{DType, Device, Tensor};
use std::time::Duration;

/// The trainer's parts a strategy works on during one call.
pub(super) struct Parts<'a> {
    pub(super) opt: &'a mut AdamW,
    pub(super) whole: Option<&'a mut ModelStep>,
    pub(super) device: &'a Device,
}

/// This rank's step, before the reduction.
pub(super) struct Local {
    pub(super) ce: f64,
    pub(super) grads: Vec<Tensor>,
    pub(super) compute: Duration,
    pub(super) wait: Duration,
    /// Device memory in use after the backward (None: unknown).
    pub(super) memory: Option<u64>,
    /// GPU utilization % and temperature °C (None: unknown).
    pub(super) util: Option<f64>,
    pub(super) temp: Option<f64>,
    /// Rank 0's verdict that a timed checkpoint is due after this step.
    pub(super) time_due: bool,
}

/// SCU's penalty on the whole-model step, for a strategy that owns a range of the weights
/// (ZeRO-1: Σw² and the penalty's gradient come from the ranks' own ranges).
pub(super) struct Penalty<'a> {
    /// Indices into `opt.slots` of the regularized weights.
    pub(super) reg_slots: &'a [usize],
    /// The controller reads Σw² after this step.
    pub(super) sumsq_due: bool,
    /// The penalty gradient's factor on w (2·λ·coef·loss scale; 0 with λ = 0).
    pub(super) grad_factor: f64,
}

/// A step's loss, gradients and rank timings after the reduction.
pub(super) struct Reduced {
    pub(super) ce: f64,
    pub(super) grads: Vec<Tensor>,
    pub(super) ranks: Vec<RankStat>,
    /// What the gradients still need multiplying by: 1/world where they hold the ranks' sum.
    pub(super) grad_scale: f64,
    /// ZeRO-1: the flat buffer whose rank's range holds the summed gradients, and Σg² over
    /// all ranks' ranges (before `grad_scale`).
    pub(super) sharded: Option<(Tensor, f64)>,
    /// ZeRO-1 on the whole-model step: Σw² of the regularized weights, summed over the ranks'
    /// ranges (the step left it to the shards; None: the step's own figure stands).
    pub(super) reg_sumsq: Option<f64>,
    /// A timed checkpoint is due after this step (rank 0's clock, every rank's decision).
    pub(super) time_due: bool,
}

impl Reduced {
    /// One process: this rank's step as it is.
    fn local(l: Local) -> Self {
        Reduced {
            ce: l.ce,
            grads: l.grads,
            ranks: Vec::new(),
            grad_scale: 1.0,
            sharded: None,
            reg_sumsq: None,
            time_due: l.time_due,
        }
    }

    /// The global gradient norm times `scale` (what the gradients as held still need:
    /// `grad_scale`, and fp16's 1/loss scale) — of the whole gradients, or from the shards' Σg².
    pub(super) fn grad_norm(&self, scale: f64) -> candle_core::Result<f64> {
        Ok(match &self.sharded {
            Some((_, sq)) => sq.sqrt() * scale,
            None => global_norm(&self.grads)? * scale,
        })
    }
}

/// How a run's ranks share a step.
pub(super) trait DataParallel: Send {
    /// The ranks' process group (None: a single process).
    fn group(&mut self) -> Option<&mut dyn Collective>;
    /// The group's backend ("nccl", "tcp"), None on a single process.
    fn backend(&self) -> Option<&'static str>;
    /// The optimizer state is sharded over the ranks (ZeRO-1).
    fn sharded(&self) -> bool {
        false
    }
    /// The fp32 master weights outside this rank's range are stale (ZeRO-1 on the whole-model
    /// step, until [`Self::whole_masters`]).
    fn masters_partial(&self) -> bool {
        false
    }
    /// Every rank takes rank 0's weights.
    fn sync_weights(&mut self, params: &[Param]) -> Result<(), EngineError> {
        let Some(d) = self.group() else {
            return Ok(());
        };
        for p in params {
            // (Collectives move f32; a frozen bf16 base goes through it and back, exactly.)
            let t = d.broadcast(&p.var.as_tensor().to_dtype(DType::F32)?)?;
            p.var.set(&t.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }
    /// After the backward: the loss and gradients over the ranks, and every rank's timings.
    fn reduce(
        &mut self,
        parts: Parts<'_>,
        local: Local,
        penalty: Penalty<'_>,
    ) -> Result<Reduced, EngineError>;
    /// The optimizer step on the reduced gradients, scaled by `f`. True where the update
    /// wrote the whole-model step's bf16 copies (its next step need not cast them).
    fn update(
        &mut self,
        parts: Parts<'_>,
        r: &Reduced,
        lr: f64,
        f: f64,
    ) -> Result<bool, EngineError> {
        Ok(parts
            .opt
            .step_with_copies(&r.grads, lr, f, parts.whole.as_deref())?)
    }
    /// Every rank's fp32 master weights made whole (a collective where they may be partial:
    /// every rank calls it at the same points — before a checkpoint, an evaluation, the end).
    fn whole_masters(&mut self, _parts: Parts<'_>) -> Result<(), EngineError> {
        Ok(())
    }
    /// The full moments for a checkpoint where the optimizer does not hold them itself
    /// (ZeRO-1: gathered to rank 0; a collective). None: the optimizer's own.
    fn gather_moments(
        &mut self,
        _parts: Parts<'_>,
    ) -> Result<Option<Vec<(String, Tensor)>>, EngineError> {
        Ok(None)
    }
    /// Σw² and the second-moment-weighted Σw² of the regularized weights (for SCU's
    /// adaptive law), over the ranks' shards where the state is sharded (a collective then).
    fn penalty_stats(
        &mut self,
        opt: &AdamW,
        reg_slots: &[usize],
    ) -> Result<(f64, f64), EngineError> {
        Ok(opt.penalty_stats(reg_slots)?)
    }
    /// After a checkpoint is loaded into the optimizer: take this rank's share of it.
    fn absorb(&mut self, _opt: &mut AdamW) -> Result<(), EngineError> {
        Ok(())
    }
}

/// The strategy for a run: `group` is its process group (None: one process).
pub(super) fn strategy(
    group: Option<Box<dyn Collective>>,
    shard_optimizer: bool,
    bf16_sums: bool,
) -> Box<dyn DataParallel> {
    match group {
        None => Box::new(single::Single),
        Some(d) if d.world() > 1 && shard_optimizer => {
            Box::new(sharded::Sharded::new(d, bf16_sums))
        }
        Some(d) => Box::new(replicated::Replicated::new(d, bf16_sums)),
    }
}

/// The host values every step shares: Σ CE, every rank's timings, rank 0's timed-checkpoint
/// verdict, and two sums a strategy may add (ZeRO-1: Σg² and Σw² of the ranks' ranges).
struct Shared {
    ce: f64,
    ranks: Vec<RankStat>,
    time_due: bool,
    sums: [f64; 2],
}

/// One host all-reduce of [`Shared`]'s values: each rank fills only its own slots, so the
/// sum gathers them.
fn share(d: &mut dyn Collective, l: &Local, sums: [f64; 2]) -> Result<Shared, EngineError> {
    const PER: usize = 5;
    let (rank, world) = (d.rank(), d.world());
    let mut host = vec![0.0; 4 + world * PER];
    let tail = 1 + world * PER;
    host[0] = l.ce;
    host[tail] = sums[0];
    host[tail + 1] = f64::from(u8::from(rank == 0 && l.time_due));
    host[tail + 2] = sums[1];
    let mine = 1 + rank * PER;
    host[mine] = l.compute.as_secs_f64() * 1e3;
    host[mine + 1] = l.wait.as_secs_f64() * 1e3;
    host[mine + 2] = l.memory.map_or(-1.0, |m| m as f64);
    host[mine + 3] = l.util.unwrap_or(-1.0);
    host[mine + 4] = l.temp.unwrap_or(-1.0);
    d.all_reduce_host(&mut host)?;
    let ranks = (0..world)
        .map(|r| {
            let b = 1 + r * PER;
            RankStat {
                rank: r,
                compute_ms: host[b],
                data_wait_ms: host[b + 1],
                memory_bytes: (host[b + 2] >= 0.0).then_some(host[b + 2] as u64),
                gpu_util_pct: (host[b + 3] >= 0.0).then_some(host[b + 3]),
                gpu_temp_c: (host[b + 4] >= 0.0).then_some(host[b + 4]),
            }
        })
        .collect();
    Ok(Shared {
        ce: host[0] / world as f64,
        ranks,
        time_due: host[tail + 1] > 0.5,
        sums: [host[tail], host[tail + 2]],
    })
}

/// The flat f32 gradient buffer summed over the ranks, in place: all of it, or (ZeRO-1, a
/// reduce-scatter) only this rank's `part`. In bf16 the buffer is packed into `wire` (kept
/// between steps), summed there, and the needed part widened back into `flat`.
fn sum_flat(
    d: &mut dyn Collective,
    wire: &mut Option<Tensor>,
    bf16: bool,
    flat: &Tensor,
    part: Option<std::ops::Range<usize>>,
) -> Result<(), EngineError> {
    let sum = |d: &mut dyn Collective, t: &Tensor| match part {
        Some(_) => d.reduce_scatter_sum_in_place(t),
        None => d.all_reduce_sum_in_place(t),
    };
    if !bf16 {
        return Ok(sum(d, flat)?);
    }
    let n = flat.elem_count();
    let w = match wire.take() {
        Some(w) if w.elem_count() == n => w,
        _ => Tensor::zeros(n, DType::BF16, flat.device())?,
    };
    crate::engine::kernels::convert_into(flat, &w)?;
    let summed = sum(d, &w);
    let back = summed.map_err(EngineError::from).and_then(|()| {
        let r = part.clone().unwrap_or(0..n);
        let len = r.end - r.start;
        crate::engine::kernels::convert_into(
            &w.narrow(0, r.start, len)?,
            &flat.narrow(0, r.start, len)?,
        )
        .map_err(EngineError::from)
    });
    *wire = Some(w);
    back
}
