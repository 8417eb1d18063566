//! Events for the front ends' unit tests: a small run and its steps.

use crate::engine::events::{RunInfo, StepStats};

/// A 100-step run on the CPU, SCU off.
pub(crate) fn run_info() -> RunInfo {
    RunInfo {
        run_name: "t".into(),
        run_dir: "runs/t".into(),
        device: "cpu".into(),
        dtype: "f32".into(),
        dtype_reason: "cpu".into(),
        params_total: 1,
        params_trainable: 1,
        start_step: 0,
        max_steps: 100,
        micro_batch: 1,
        accum: 1,
        seq_len: 8,
        vocab_size: 16,
        train_tokens: 1000,
        entropy_floor_bpt: None,
        flops_per_token: 1.0,
        peak_flops: None,
        attention_flops_fwd: None,
        mamba_flops: None,
        scu_enabled: false,
        scu_target: 0.01,
        summary: String::new(),
    }
}

/// Step `step` at `elapsed_s` into the run: loss 2, 1k tokens/s, `step_ms` each.
pub(crate) fn step_stats(step: u64, elapsed_s: f64, step_ms: f64) -> StepStats {
    StepStats {
        step,
        loss: 2.0,
        lr: 1e-3,
        grad_norm: 1.0,
        tokens_per_sec: 1000.0,
        step_ms,
        data_wait_ms: 0.0,
        compute_ms: step_ms,
        optim_ms: 0.0,
        micro_batch: 1,
        accum: 1,
        tokens: step * 8,
        epoch: 0.0,
        elapsed_s,
        memory_bytes: None,
        host_rss_bytes: None,
        dropped_before: 0,
        comm_ms: 0.0,
        ranks: vec![],
        kernels: vec![],
        trained_share: None,
    }
}
