//! The whole-model CUDA step as executor: the micro-batches run as one hand-scheduled program
//! each, with the SCU penalty's gradient added in place.

use super::Trainer;
use crate::engine::data::packing::IGNORE;
use crate::engine::device;
use crate::engine::kernels::Rows;
use candle_core::Tensor;
use std::time::{Duration, Instant};

impl Trainer {
    /// [`Self::forward_backward`] on the whole-model CUDA step: the micro-batches run as
    /// one hand-scheduled program each, gradients accumulate in its flat fp32 buffer, and
    /// the loss comes back in one read at the end.
    pub(super) fn forward_backward_whole_step(
        &mut self,
        lambda: f64,
    ) -> candle_core::Result<(f64, f64, Vec<Tensor>, Duration, Duration)> {
        let mut wait = Duration::ZERO;
        let t0 = Instant::now();
        let inject_nan = self.take_nan_fault();
        let sharding = self.sharding();
        let control_due = self.control_due();
        let coef = self.penalty_coef();
        let Some(whole) = self.whole_step.as_mut() else {
            return Err(candle_core::Error::Msg("no whole-model step".into()));
        };
        // (With partial masters the bf16 copies are the only whole weights: never cast over.)
        whole.begin(std::mem::take(&mut self.weights_copied) || self.parallel.masters_partial())?;
        // fp16: the backward carries the loss scale from the loss gradient on (so small
        // gradients stay above fp16's underflow); the update divides it out.
        let scale = self.scaler.scale;
        let accum = self.accum as f64;
        // Data parallel with the sums inside the step: the last micro-batch's backward sums
        // the gradients over the ranks as it goes.
        let summed = whole.overlaps_grad_sums();
        for a in 0..self.accum {
            let (batch, w) = Self::keep_fault(&mut self.data_fault, self.loader.next_batch())?;
            wait += w;
            // The same masks as the per-op path draws (a pure function of this seed).
            whole.set_dropout_seed(crate::engine::dropout::micro_seed(
                self.cfg.run.seed,
                self.step,
                a,
            ));
            whole.set_grad_sum_now(summed && a + 1 == self.accum);
            // Each micro-batch's mean over its targets that train (all of a token stream's),
            // the step's loss the mean of those: as the per-op path.
            let trained = batch.targets.iter().filter(|&&y| y != IGNORE).count();
            if batch.segments.is_some() {
                self.trained_slots.0 += trained as u64;
                self.trained_slots.1 += batch.targets.len() as u64;
            }
            let g = if inject_nan {
                f32::NAN
            } else {
                (scale / (accum * trained.max(1) as f64)) as f32
            };
            let rows = Rows {
                inputs: &batch.inputs,
                targets: &batch.targets,
                // (Unpacked rows hold one sample, then padding that trains nothing: plain
                // causal attention gives the sample what it sees alone.)
                segments: batch.segments.as_deref().filter(|_| self.cfg.data.packing),
                b: batch.batch,
            };
            whole.micro_rows(&rows, g)?;
        }
        let mut sumsq_val = 0.0;
        // ZeRO-1: Σw² and the penalty's gradient come from each rank's own range after the
        // sum ([`Self::shard_reduce`]; the masters outside it may be stale).
        if !self.reg_slots.is_empty() && !sharding {
            let vars: Vec<&candle_core::Var> = self
                .reg_slots
                .iter()
                .map(|&i| &self.opt.slots[i].var)
                .collect();
            // (Σw² is read only by the controller, after this step when it is due: a pass over
            // the weights and a host read the other steps skip.)
            if control_due {
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                sumsq_val = crate::engine::kernels::sumsq(&ts)?;
            }
            if lambda != 0.0 {
                // d/dw of λ·Σw²/(2σ²)/N = 2·λ·coef·w, added to the CE gradient in place
                // (to the ranks' sum already, when the step summed: world times, as the
                // optimizer divides the sum by the world).
                let copies = if summed { self.world as f64 } else { 1.0 };
                whole.add_scaled_weights(&vars, 2.0 * lambda * coef * copies * scale)?;
            }
        }
        let ce = whole.loss()?;
        self.step_memory = device::memory_in_use(&self.device);
        let grads = self
            .opt
            .slots
            .iter()
            .map(|s| match whole.grad_of(&s.var)? {
                Some(g) => Ok(g),
                None => s.var.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let compute = t0.elapsed().saturating_sub(wait);
        Ok((ce, sumsq_val, grads, wait, compute))
    }
}
