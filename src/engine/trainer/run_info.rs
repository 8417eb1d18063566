//! The run header (`RunStarted`): device, precision, parameter counts and a one-line summary.

use super::Trainer;
use crate::engine::data::loader::Windows;
use crate::engine::events::RunInfo;
use crate::engine::{device, precision};

impl Trainer {
    pub(super) fn run_info(&self) -> RunInfo {
        let (total, trainable) = self.model.param_count();
        let s = &self.model.spec;
        let dev = device::describe(&self.device);
        let c = &self.cfg;
        // Data parallelism: tokens/s are the job's, so MFU is against every rank's peak.
        let peak_flops = device::peak_flops(&dev, self.dtype).map(|p| p * self.world as f64);
        let dev = match self.parallel.backend() {
            Some(backend) => {
                format!(
                    "{dev} · rank {} of {} ({}), global batch {} sequences{}{}",
                    self.rank,
                    self.world,
                    backend,
                    self.world * self.micro_batch * self.accum,
                    if self.sharding() {
                        format!(
                            ", optimizer state sharded (ZeRO-1: {:.0} MB of Adam moments a rank)",
                            8.0 * trainable as f64 / self.world as f64 / 1e6
                        )
                    } else {
                        String::new()
                    },
                    if self.cfg.distributed.bf16_sums() {
                        ", gradients summed in bf16"
                    } else {
                        ""
                    }
                )
            }
            None => dev,
        };
        RunInfo {
            run_name: c.run.name.clone(),
            run_dir: self.run_dir.display().to_string(),
            peak_flops,
            attention_flops_fwd: s.attention_flops_fwd(s.seq_len),
            mamba_flops: s.mamba_flops(s.seq_len, crate::engine::kernels::spec::MAMBA_STEP_CHUNK),
            device: dev,
            dtype: precision::dtype_name(self.dtype).into(),
            dtype_reason: self.dtype_reason.clone(),
            params_total: total,
            params_trainable: trainable,
            start_step: self.step,
            max_steps: c.run.max_steps,
            micro_batch: self.micro_batch,
            accum: self.accum,
            seq_len: s.seq_len,
            vocab_size: s.vocab_size,
            train_tokens: self.dataset.train.len() as u64,
            entropy_floor_bpt: self.dataset.entropy_floor_bpt,
            flops_per_token: self.model.flops_per_token(),
            scu_enabled: c.scu.enabled,
            scu_target: self.scu.target,
            summary: format!(
                "{} {}L {}H d{} T{} vocab {} | {} | {} windows, {} | AdamW lr {:.1e} {:?} | {}",
                s.family(),
                s.n_layer,
                s.n_head,
                s.n_embd,
                s.seq_len,
                s.vocab_size,
                self.dataset.description,
                match self.loader.windows() {
                    Windows::Random => "random",
                    Windows::Aligned => "aligned",
                },
                self.val.describe(),
                c.optim.lr,
                c.schedule.kind,
                if c.lora.enabled {
                    format!("LoRA r{} on {:?}", c.lora.r, c.lora.targets)
                } else {
                    "full fine-tune".into()
                }
            ) + &self
                .launcher
                .as_ref()
                .map_or(String::new(), |l| format!(" | {l}")),
        }
    }
}
