//! Data parallelism: rank 0's weights to every rank, and after the backward the mean of the
//! loss and gradients over the ranks (bucketed all-reduce, or the flat buffer summed in place).

use super::Trainer;
use crate::distributed::Collective;
use crate::engine::events::RankStat;
use crate::engine::EngineError;
use candle_core::{DType, Tensor};
use std::time::Duration;

/// Gradients go to the all-reduce in buckets of at most this many elements (one flat f32
/// buffer each: a few large collectives instead of one per tensor, with bounded extra memory).
const BUCKET_ELEMS: usize = 1 << 25;

/// A step's loss, gradients and rank timings after data parallelism's reduction.
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

impl Trainer {
    /// Data parallelism: every rank takes rank 0's weights.
    pub(super) fn sync_weights(&mut self) -> Result<(), EngineError> {
        self.weights_copied = false;
        let Some(d) = self.dist.as_mut() else {
            return Ok(());
        };
        for p in &self.model.params {
            // (Collectives move f32; a frozen bf16 base goes through it and back, exactly.)
            let t = d.broadcast(&p.var.as_tensor().to_dtype(DType::F32)?)?;
            p.var.set(&t.to_dtype(p.var.dtype())?)?;
        }
        Ok(())
    }

    /// Data parallelism, after the backward: the mean of the gradients and of the loss
    /// over the ranks (so every rank takes the same optimizer step and SCU sees the global
    /// loss), and every rank's timings. A single process passes its values through.
    pub(super) fn reduce_step(
        &mut self,
        ce: f64,
        grads: Vec<Tensor>,
        wait: Duration,
        compute: Duration,
    ) -> Result<Reduced, EngineError> {
        let world = self.world;
        if self.dist.is_none() {
            return Ok(Reduced {
                ce,
                grads,
                ranks: Vec::new(),
                grad_scale: 1.0,
                sharded: None,
                reg_sumsq: None,
                time_due: self.time_due,
            });
        }
        self.set_waiting(true);
        let r = self.reduce_step_inner(ce, grads, wait, compute, world);
        self.set_waiting(false);
        r
    }

    pub(super) fn set_waiting(&self, on: bool) {
        if let Some(p) = &self.progress {
            p.waiting.store(on, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub(super) fn reduce_step_inner(
        &mut self,
        ce: f64,
        grads: Vec<Tensor>,
        wait: Duration,
        compute: Duration,
        world: usize,
    ) -> Result<Reduced, EngineError> {
        let step_memory = self.step_memory;
        let gauge = |g: Option<&std::sync::atomic::AtomicU32>| {
            g.map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
                .filter(|&v| v != u32::MAX)
                .map_or(-1.0, f64::from)
        };
        let util = gauge(self.progress.as_deref().map(|p| &p.gpu_util_pct));
        let temp = gauge(self.progress.as_deref().map(|p| &p.gpu_temp_c));
        // ZeRO-1: the gradients are reduce-scattered first, so their Σg² rides on the host
        // all-reduce below.
        let sharded = if self.sharding() {
            Some(self.shard_reduce(&grads)?)
        } else {
            None
        };
        let Some(d) = self.dist.as_mut() else {
            return Ok(Reduced {
                ce,
                grads,
                ranks: Vec::new(),
                grad_scale: 1.0,
                sharded: None,
                reg_sumsq: None,
                time_due: self.time_due,
            });
        };
        // [Σ CE, then per rank: compute ms, data wait ms, memory bytes, GPU util %, GPU °C
        // (-1: unknown), then Σg² of the ranks' shards, rank 0's timed-checkpoint verdict
        // and Σw² of the shards' regularized weights]; each rank fills only its own slots,
        // so the sum gathers them.
        const PER: usize = 5;
        let mut host = vec![0.0; 4 + world * PER];
        host[0] = ce;
        host[1 + world * PER] = sharded.as_ref().map_or(0.0, |s| s.1);
        host[2 + world * PER] = f64::from(u8::from(self.rank == 0 && self.time_due));
        let reg_sumsq = sharded.as_ref().and_then(|s| s.2);
        host[3 + world * PER] = reg_sumsq.unwrap_or(0.0);
        let mine = 1 + self.rank * PER;
        host[mine] = compute.as_secs_f64() * 1e3;
        host[mine + 1] = wait.as_secs_f64() * 1e3;
        host[mine + 2] = step_memory.map_or(-1.0, |m| m as f64);
        host[mine + 3] = util;
        host[mine + 4] = temp;
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
        // The whole-model step's gradients are views of one flat buffer: summed in place in
        // one call, and the 1/world left to the optimizer's gradient scale (no copies).
        let time_due = host[2 + world * PER] > 0.5;
        if let Some((flat, _, _)) = sharded {
            self.device.synchronize()?;
            return Ok(Reduced {
                ce: host[0] / world as f64,
                grads,
                ranks,
                grad_scale: 1.0 / world as f64,
                sharded: Some((flat, host[1 + world * PER])),
                reg_sumsq: reg_sumsq.map(|_| host[3 + world * PER]),
                time_due,
            });
        }
        let bf16 = self.cfg.distributed.bf16_sums();
        let flat = self.whole_step.as_ref().and_then(|w| w.grad_buffer());
        let summed = self
            .whole_step
            .as_ref()
            .is_some_and(|w| w.overlaps_grad_sums());
        let (grads, grad_scale) = match flat {
            // (The step summed them already, bucket by bucket during the backward.)
            Some(_) if summed => (grads, 1.0 / world as f64),
            Some(flat) => {
                let flat = flat.clone();
                self.sum_grad_buffer(&flat, None)?;
                (grads, 1.0 / world as f64)
            }
            None => (all_reduce_mean(d.as_mut(), &grads, bf16)?, 1.0),
        };
        // Wait for the all-reduce here (not in the optimizer), so a stuck peer is seen as one.
        self.device.synchronize()?;
        Ok(Reduced {
            ce: host[0] / world as f64,
            grads,
            ranks,
            grad_scale,
            sharded: None,
            reg_sumsq: None,
            time_due,
        })
    }

    /// Sum the flat f32 gradient buffer over the ranks, in place: all of it, or (ZeRO-1, a
    /// reduce-scatter) only this rank's `part`. In bf16 the buffer is packed into
    /// [`Self::wire`], summed there, and the needed part widened back into `flat`.
    pub(super) fn sum_grad_buffer(
        &mut self,
        flat: &Tensor,
        part: Option<std::ops::Range<usize>>,
    ) -> Result<(), EngineError> {
        let bf16 = self.cfg.distributed.bf16_sums();
        let Some(d) = self.dist.as_mut() else {
            return Ok(());
        };
        let sum = |d: &mut Box<dyn Collective>, t: &Tensor| match part {
            Some(_) => d.reduce_scatter_sum_in_place(t),
            None => d.all_reduce_sum_in_place(t),
        };
        if !bf16 {
            return Ok(sum(d, flat)?);
        }
        let n = flat.elem_count();
        let wire = match self.wire.take() {
            Some(w) if w.elem_count() == n => w,
            _ => Tensor::zeros(n, DType::BF16, flat.device())?,
        };
        crate::engine::kernels::convert_into(flat, &wire)?;
        let summed = sum(d, &wire);
        let back = summed.map_err(EngineError::from).and_then(|()| {
            let r = part.unwrap_or(0..n);
            let len = r.end - r.start;
            crate::engine::kernels::convert_into(
                &wire.narrow(0, r.start, len)?,
                &flat.narrow(0, r.start, len)?,
            )
            .map_err(EngineError::from)
        });
        self.wire = Some(wire);
        back
    }
}
