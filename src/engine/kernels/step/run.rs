//! Running the step: an optimizer step's start, its micro-batches, the loss read-back and
//! evaluation.

use candle_core::cuda_backend::cudarc::driver::result as drv;
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::arena::Activations;
use super::ModelStep;
use crate::engine::kernels::cuda::err;
use crate::engine::kernels::rows::{sample_starts, Rows, IGNORE};

impl ModelStep {
    /// Start an optimizer step: cast the fp32 masters into the bf16 buffer (unless the last
    /// fused AdamW already wrote them there and nothing changed the weights since), zero the
    /// gradients and the loss accumulator.
    pub fn begin(&mut self, weights_copied: bool) -> Result<()> {
        if !weights_copied {
            self.cast_weights()?;
        }
        let start = self.grad_p + 4 * self.zero_from as u64;
        let bytes = (self.grad.elem_count() - self.zero_from) * 4;
        // SAFETY: from `zero_from` on, the live fp32 gradient buffer holds `bytes` bytes.
        unsafe { drv::memset_d8_async(start, 0, bytes, self.stream.cu_stream()) }
            .w()
            .map_err(|e| err(format!("zeroing {bytes} bytes of gradients: {e}")))?;
        if let Some(a) = &self.arena {
            let n = a.acts.b * self.t;
            // SAFETY: the loss accumulator holds n f32.
            unsafe { drv::memset_d8_async(a.acts.loss, 0, n * 4, self.stream.cu_stream()) }.w()?;
        }
        self.micro = 0;
        self.moe_host.get_mut().aux_sum = 0.0;
        Ok(())
    }

    /// Forward and backward of one micro-batch `[b, T]` of token ids and targets; gradients
    /// add into the fp32 buffer scaled by `g` per token (1/(tokens·accum) for a mean loss).
    pub fn micro(&mut self, inputs: &[u32], targets: &[u32], b: usize, g: f32) -> Result<()> {
        self.micro_rows(
            &Rows {
                inputs,
                targets,
                segments: None,
                b,
            },
            g,
        )
    }

    /// [`Self::micro`] for rows whose targets may be [`IGNORE`] (no loss, no gradient: the
    /// prompts and padding of instruction data) and which may pack several samples
    /// (`segments`: a sample id per slot; attention stays within a sample, positions restart
    /// at each). `g` scales each trained target's gradient; the step's [`Self::loss`] is the
    /// mean over the micro-batches of each one's mean over its trained targets.
    pub fn micro_rows(&mut self, r: &Rows, g: f32) -> Result<()> {
        let b = r.b;
        let had = self.arena.as_ref().map(|a| a.acts.b);
        self.ensure(b)?;
        if had != Some(b) {
            // A fresh arena: its loss accumulator must start from zero for this step.
            if self.micro > 0 {
                return Err(err(
                    "whole-model step: micro-batch size changed inside an optimizer step",
                ));
            }
            self.zero_loss()?;
        }
        let trained = self.upload(r)?;
        self.set_scales(g, 1.0 / trained.max(1) as f32)?;
        // (A mean loss's gradient scale for a term per micro-batch, the experts' balancing:
        // g · trained is the micro-batch's share, scale / accum — also where none trains, since
        // the loss adds the term for every micro-batch.)
        self.moe_g.set(g * trained.max(1) as f32);
        if self.drop_thr > 0 {
            // (Read by the kernels from the device: a replayed graph draws new masks.)
            let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
            let mut seed = a.words.slice_mut(0..1);
            self.stream.memcpy_htod(&[self.drop_seed], &mut seed).w()?;
        }
        self.run_micro(self.micro == 0)?;
        self.micro += 1;
        Ok(())
    }

    /// Rows' ids, targets and (packed) sample starts into the arena; how many targets train.
    fn upload(&mut self, r: &Rows) -> Result<usize> {
        let n = r.b * self.t;
        if r.inputs.len() != n || r.targets.len() != n || r.segments.is_some_and(|s| s.len() != n) {
            return Err(err(format!(
                "whole-model step: a batch of {}×{} needs {n} ids, targets and segment ids",
                r.b, self.t
            )));
        }
        if r.segments.is_some() && (!self.flash || self.rope.is_none() && self.wpe.is_some()) {
            return Err(err(
                "whole-model step: packed rows need flash attention and no learned positions",
            ));
        }
        let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
        self.stream.memcpy_htod(r.inputs, &mut a.ids).w()?;
        self.stream.memcpy_htod(r.targets, &mut a.targets).w()?;
        let starts = r.segments.map(|seg| sample_starts(seg, self.t));
        if let Some(st) = &starts {
            self.stream.memcpy_htod(st, &mut a.starts).w()?;
        }
        self.packed = starts.is_some();
        // (Unpacked rows' window lows depend on the micro-batch size alone: uploaded once per
        // arena, again only after packed rows replaced them.)
        if self.window > 0 && (starts.is_some() || !a.lows_plain) {
            // A sliding layer's query q sees keys from q − window + 1 on, within its sample.
            let (t, w) = (self.t.max(1), self.window);
            let lows: Vec<i32> = (0..n)
                .map(|i| {
                    let own = ((i % t + 1).saturating_sub(w)) as i32;
                    starts.as_ref().map_or(own, |st| own.max(st[i]))
                })
                .collect();
            self.stream.memcpy_htod(&lows, &mut a.lows).w()?;
            a.lows_plain = starts.is_none();
        }
        Ok(r.targets.iter().filter(|&&y| y != IGNORE).count())
    }

    /// The loss gradient's scale `g` and the loss accumulator's weight `lw` of the next
    /// micro-batch, into the arena (the cross-entropy kernel reads them there).
    fn set_scales(&mut self, g: f32, lw: f32) -> Result<()> {
        let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
        let word = u64::from(g.to_bits()) | (u64::from(lw.to_bits()) << 32);
        let mut at = a.words.slice_mut(1..2);
        self.stream.memcpy_htod(&[word], &mut at).w()
    }

    /// The packed sample starts' device address for the running micro-batch (0: not packed).
    pub(super) fn starts_ptr(&self, a: &Activations) -> u64 {
        if self.packed {
            a.starts
        } else {
            0
        }
    }

    /// Layer `l`'s attention's lowest key per slot: the window's (a sliding layer), else the
    /// packed sample starts ([`Self::starts_ptr`]).
    pub(super) fn lows_ptr(&self, a: &Activations, l: usize) -> u64 {
        if self.sliding.get(l).copied().unwrap_or(false) {
            a.lows
        } else {
            self.starts_ptr(a)
        }
    }

    /// The dropout seed of the next micro-batches ([`crate::engine::dropout::micro_seed`]: the candle model
    /// draws the same masks from it).
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.drop_seed = seed;
    }

    /// Rows per chunk of the LM head (None: sized by memory, [`Self::head_rows`]); takes
    /// effect with the next arena (tests use it to split small batches).
    pub fn set_head_chunk_rows(&mut self, rows: Option<usize>) {
        self.head_chunk_rows = rows;
        self.arena = None;
    }

    /// Rows per chunk of the MLP where the backward recomputes whole blocks (None: sized by
    /// memory, [`Self::mlp_rows`]); takes effect with the next arena (tests use it to split
    /// small batches).
    pub fn set_mlp_chunk_rows(&mut self, rows: Option<usize>) {
        self.mlp_chunk_rows = rows;
        self.arena = None;
    }

    /// Routed experts' products as grouped cuBLAS calls (the default where the build has them)
    /// or one call an expert (tests compare the two; `COCKPIT_MOE_GROUPED=0` at start).
    pub fn set_moe_grouped(&mut self, on: bool) {
        self.moe_grouped.set(if on && cfg!(cublas_grouped) {
            0b11_1111
        } else {
            0
        });
    }

    pub(super) fn fwd_bwd(&self, acts: &Activations, first: bool) -> Result<()> {
        self.forward(acts, first, true)?;
        self.backward(acts, first)
    }

    pub(super) fn zero_loss(&self) -> Result<()> {
        if let Some(a) = &self.arena {
            let n = a.acts.b * self.t;
            // SAFETY: the loss accumulator holds n f32.
            unsafe { drv::memset_d8_async(a.acts.loss, 0, n * 4, self.stream.cu_stream()) }.w()?;
        }
        Ok(())
    }

    /// The step's mean loss since [`Self::begin`]: the mean over its micro-batches of each
    /// one's mean over the targets that train (every target, for a token stream; one
    /// read-back; waits for the GPU).
    pub fn loss(&self) -> Result<f64> {
        let v = self.token_losses()?;
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        // (Routed experts: coef × the load-balancing loss, per micro-batch, as the per-op
        // model adds it to the training loss.)
        let aux = self.moe_host.try_borrow().map_or(0.0, |h| h.aux_sum);
        Ok((sum + aux) / self.micro.max(1) as f64)
    }

    /// The loss accumulator, one sum per token row of the arena (one read-back).
    pub(super) fn token_losses(&self) -> Result<Vec<f32>> {
        let a = self
            .arena
            .as_ref()
            .ok_or_else(|| err("no micro-batch ran"))?;
        let n = a.acts.b * self.t;
        let rows = a
            .f32s
            .try_slice(0..n)
            .ok_or_else(|| err("loss accumulator out of range"))?;
        self.stream.clone_dtoh(&rows).w()
    }

    /// Each sequence's mean loss in one batch `[b, T]` (over its targets that train; rows
    /// where none trains are left out), by the forward alone (evaluation: no dropout, no
    /// gradient; the LM head's backward is skipped), between optimizer steps: it reuses the
    /// loss accumulator, so read the step's [`Self::loss`] first. The bf16 copies are cast
    /// first unless `weights_current` (the last fused AdamW wrote them).
    pub fn eval_losses(&mut self, r: &Rows, weights_current: bool) -> Result<Vec<f64>> {
        if !weights_current {
            self.cast_weights()?;
        }
        self.ensure(r.b)?;
        self.zero_loss()?;
        self.upload(r)?;
        self.set_scales(0.0, 1.0)?;
        let acts = self
            .arena
            .as_ref()
            .ok_or_else(|| err("no arena"))?
            .acts
            .clone();
        let thr = std::mem::replace(&mut self.drop_thr, 0);
        let lora_thr = std::mem::replace(&mut self.lora_thr, 0);
        let run = self.forward(&acts, false, false);
        self.drop_thr = thr;
        self.lora_thr = lora_thr;
        run?;
        // The loss accumulator holds each token's loss: a mean per sequence.
        let v = self.token_losses()?;
        self.zero_loss()?;
        // (A step's accumulation ends here: the next starts with `begin`.)
        self.micro = 0;
        Ok(v.chunks(self.t)
            .zip(r.targets.chunks(self.t))
            .filter_map(|(row, y)| {
                let n = y.iter().filter(|&&v| v != IGNORE).count();
                (n > 0).then(|| row.iter().map(|&x| x as f64).sum::<f64>() / n as f64)
            })
            .collect())
    }
}
