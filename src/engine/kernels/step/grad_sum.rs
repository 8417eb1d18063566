//! Data parallel: the gradient buckets summed over the ranks while the backward runs.

use candle_core::Result;

use super::params::LayerIdx;
use super::ModelStep;
use crate::engine::kernels::buckets;
use crate::engine::kernels::reduce::Overlap;

impl ModelStep {
    /// Data parallel: sum the gradients over the ranks with `sum` while the backward runs,
    /// bucket by bucket from the top layer down (see `reduce.rs`), in the micro-batches
    /// [`Self::set_grad_sum_now`] names. The step then runs its launches eagerly (no CUDA
    /// graphs: the sums sit on another communicator's stream); `bf16`: summed in bf16.
    pub fn set_grad_sum(
        &mut self,
        sum: Box<dyn crate::distributed::GradSum>,
        bucket_mb: f64,
        bf16: bool,
    ) -> Result<()> {
        let min_len = ((bucket_mb * 1e6 / 4.0) as usize).max(1);
        let runs: Vec<Vec<(usize, usize)>> =
            self.layers.iter().map(|li| self.layer_runs(li)).collect();
        let plan = buckets::plan(&runs, self.grad.elem_count(), min_len);
        tracing::info!(
            buckets = plan.len(),
            bucket_mb,
            "gradient sums overlap the backward"
        );
        let wire = bf16.then(|| self.grad.elem_count());
        self.sums = Some(Overlap::new(sum, &self.dev, &self.stream, plan, wire)?);
        self.graphs = false;
        Ok(())
    }

    /// Whether the gradient sums run inside the step ([`Self::set_grad_sum`]).
    pub fn overlaps_grad_sums(&self) -> bool {
        self.sums.is_some()
    }

    /// Whether the next micro-batches sum the gradients over the ranks (the optimizer
    /// step's last micro-batch does).
    pub fn set_grad_sum_now(&mut self, on: bool) {
        self.sum_now = on;
    }

    /// Layer `li`'s gradient runs in the flat buffer as (start, end) element offsets: its
    /// trainable matrices and adapters, and its norms and biases in the zeroed tail.
    pub(super) fn layer_runs(&self, li: &LayerIdx) -> Vec<(usize, usize)> {
        let mut ids = vec![li.qkv_w, li.o_w, li.up_w, li.down_w, li.ln1_w, li.ln2_w];
        ids.extend(
            [li.ln1_b, li.qkv_b, li.o_b, li.ln2_b, li.up_b, li.down_b]
                .into_iter()
                .flatten(),
        );
        ids.extend(li.qk_norm.iter().flat_map(|&(q, k)| [q, k]));
        if let Some(m) = li.mamba {
            ids.extend([m.conv_w, m.dt_bias, m.a_log, m.d, m.norm]);
            ids.extend(m.conv_b);
        }
        if let Some(m) = li.moe {
            ids.extend([m.router, m.gate_up, m.down]);
        }
        ids.extend(li.lora.iter().flatten().flat_map(|ad| [ad.a, ad.b]));
        let (mut head, mut tail) = (None::<(usize, usize)>, None::<(usize, usize)>);
        for i in ids {
            let e = &self.entries[i];
            if e.frozen || e.ext || self.trained_grad_ptr(i).is_none() {
                continue;
            }
            let (s, end) = (e.off, e.off + e.n);
            let run = if s < self.zero_from {
                &mut head
            } else {
                &mut tail
            };
            *run = Some(run.map_or((s, end), |(a, b)| (a.min(s), b.max(end))));
        }
        [head, tail].into_iter().flatten().collect()
    }

    /// Enqueue the gradient sums of the buckets due after layer `after`'s backward (None:
    /// after the whole backward, which then also waits for them); nothing unless this
    /// micro-batch sums.
    pub(super) fn send_sums(&self, after: Option<usize>) -> Result<()> {
        let Some(sums) = self.sums.as_ref().filter(|_| self.sum_now) else {
            return Ok(());
        };
        for b in sums.buckets.iter().filter(|b| b.after == after) {
            sums.send(b, self.grad_p, self.side())?;
        }
        if after.is_none() {
            sums.join()?;
        }
        Ok(())
    }
}
