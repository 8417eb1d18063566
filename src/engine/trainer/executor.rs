//! Which executor runs a step: the whole-model CUDA step where the model fits it (built once,
//! at the first step), else the per-op candle path.

use super::Trainer;
use crate::engine::data::loader::Batch;
use crate::engine::data::DataError;
use crate::engine::EngineError;
use candle_core::Tensor;
use std::time::Duration;

impl Trainer {
    /// The loader's next batch; a token cache that cannot be read is kept in `data_fault`
    /// (see [`Self::step_error`]).
    pub(super) fn next_batch(&mut self) -> candle_core::Result<(Batch, Duration)> {
        let r = self.loader.next_batch();
        Self::keep_fault(&mut self.data_fault, r)
    }

    /// `r`, its data error (if any) kept in `fault` and handed on as a tensor error.
    pub(super) fn keep_fault<T>(
        fault: &mut Option<DataError>,
        r: Result<T, DataError>,
    ) -> candle_core::Result<T> {
        r.map_err(|e| {
            let msg = e.to_string();
            *fault = Some(e);
            candle_core::Error::Msg(msg)
        })
    }

    /// The error a failed step or eval ends the run with: the data's own, when a token cache
    /// failed, else `e`.
    pub(super) fn step_error(&mut self, e: impl Into<EngineError>) -> EngineError {
        match self.data_fault.take() {
            Some(d) => d.into(),
            None => e.into(),
        }
    }

    /// One optimizer step's forward/backward over `accum` micro-batches.
    /// Returns (mean CE, Σw² value, grads, data wait, compute time).
    pub(super) fn forward_backward(
        &mut self,
        lambda: f64,
    ) -> candle_core::Result<(f64, f64, Vec<Tensor>, Duration, Duration)> {
        self.faults.oom_at(self.micro_batch)?;
        self.try_whole_step()?;
        if self.whole_step.is_some() {
            return self.forward_backward_whole_step(lambda);
        }
        self.forward_backward_per_op(lambda)
    }

    /// Build the whole-model CUDA step once, where the model fits it.
    pub(super) fn try_whole_step(&mut self) -> candle_core::Result<()> {
        if !self.whole_step_tried {
            self.whole_step_tried = true;
            match self.model.step_plan() {
                Ok(mut w) => {
                    if self.sharding() {
                        w.shards = self.world;
                    }
                    let mut step = crate::engine::kernels::ModelStep::new(&w)?;
                    step.set_profiling(self.profile_kernels);
                    #[cfg(feature = "cuda")]
                    if let Some(d) = self.parallel.group() {
                        // (A collective: every rank builds its step at the same point.)
                        if d.world() > 1 && self.cfg.distributed.overlap {
                            let sum = d
                                .grad_sum()
                                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                            if let Some(sum) = sum {
                                let dc = &self.cfg.distributed;
                                step.set_grad_sum(sum, dc.bucket_mb, dc.bf16_sums())?;
                            }
                        }
                    }
                    self.whole_step = Some(step);
                }
                Err(why) if self.device.is_cuda() && self.cfg.kernels.step => {
                    self.per_op_reason = Some(why.to_string());
                }
                Err(_) => {}
            }
        }
        Ok(())
    }
}

impl Trainer {
    /// Whether a NaN is injected into this step (fault injection for tests), once.
    pub(super) fn take_nan_fault(&mut self) -> bool {
        self.faults.take_nan(self.step + 1)
    }
}
