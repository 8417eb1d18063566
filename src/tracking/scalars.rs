//! Which numbers of the event stream and the telemetry become logged scalars, under which tags
//! (the dashboard's panels: train, val, scu, time, perf, memory, gpuN, host).

use crate::advisor::MonitorUpdate;
use crate::engine::events::{Event, RunInfo};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The scalars an event carries, as `(tag, value)` at the event's step. `run` (the run's
/// `RunStarted` facts) gives MFU.
pub fn of_event(ev: &Event, run: Option<&RunInfo>) -> Vec<(String, f64)> {
    let mut v: Vec<(&str, f64)> = Vec::new();
    match ev {
        Event::Step(s) => {
            v.extend([
                ("train/loss", s.loss),
                ("train/bits_per_token", s.loss / std::f64::consts::LN_2),
                ("train/lr", s.lr),
                ("train/grad_norm", s.grad_norm),
                ("train/epoch", s.epoch),
                ("perf/tokens_per_sec", s.tokens_per_sec),
                ("perf/micro_batch", s.micro_batch as f64),
                ("time/step_ms", s.step_ms),
                ("time/data_wait_ms", s.data_wait_ms),
                ("time/compute_ms", s.compute_ms),
                ("time/optim_ms", s.optim_ms),
                ("time/comm_ms", s.comm_ms),
            ]);
            if let Some(r) = run {
                if let Some(peak) = r.peak_flops.filter(|p| *p > 0.0) {
                    v.push(("perf/mfu", s.tokens_per_sec * r.flops_per_token / peak));
                }
            }
            if let Some(b) = s.memory_bytes {
                v.push(("memory/device_gib", b as f64 / GIB));
            }
            if let Some(b) = s.host_rss_bytes {
                v.push(("memory/host_rss_gib", b as f64 / GIB));
            }
        }
        Event::Eval(e) => {
            v.extend([
                ("val/loss", e.val_loss),
                ("val/bits_per_token", e.val_bpt),
                ("val/perplexity", e.val_ppl),
            ]);
            if e.val_loss_se.is_finite() {
                v.push(("val/loss_se", e.val_loss_se));
                v.push(("val/loss_upper", e.val_loss + e.val_loss_se));
                v.push(("val/loss_lower", e.val_loss - e.val_loss_se));
            }
            if e.val_bpt_se.is_finite() {
                v.push(("val/bits_per_token_se", e.val_bpt_se));
            }
        }
        Event::Scu(s) => v.extend([
            ("scu/s_ratio", s.s_ratio),
            ("scu/s_hat", s.s_hat),
            ("scu/lambda", s.lambda),
            ("scu/target", s.target),
            ("scu/data_bpt", s.data_bpt),
            ("scu/param_bpt", s.param_bpt),
            ("scu/reg_loss", s.reg_loss),
        ]),
        _ => {}
    }
    v.into_iter().map(|(k, x)| (k.to_string(), x)).collect()
}

/// The telemetry of one sample: per GPU utilization, memory, power and temperature; host CPU
/// and RAM.
pub fn of_update(u: &MonitorUpdate) -> Vec<(String, f64)> {
    let mut v = Vec::new();
    for g in &u.snapshot.gpus {
        let p = format!("gpu{}", g.index);
        if let Some(x) = g.util_gpu {
            v.push((format!("{p}/util_pct"), f64::from(x)));
        }
        v.push((
            format!("{p}/memory_used_gib"),
            g.mem_used_bytes as f64 / GIB,
        ));
        if let Some(x) = g.power_w {
            v.push((format!("{p}/power_w"), x));
        }
        if let Some(x) = g.temperature_c {
            v.push((format!("{p}/temperature_c"), f64::from(x)));
        }
        if let Some(x) = g.sm_activity_pct {
            v.push((format!("{p}/sm_activity_pct"), x));
        }
    }
    let h = &u.snapshot.host;
    if h.cpu_pct.is_finite() {
        v.push(("host/cpu_pct".into(), h.cpu_pct));
    }
    if h.ram_total_bytes > 0 {
        v.push(("host/ram_used_gib".into(), h.ram_used_bytes as f64 / GIB));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{GpuSample, HostSample, Snapshot};

    #[test]
    fn telemetry_gives_per_gpu_and_host_scalars() {
        let u = MonitorUpdate {
            snapshot: Snapshot {
                timestamp_ms: 1,
                gpus: vec![GpuSample {
                    index: 1,
                    util_gpu: Some(87),
                    mem_used_bytes: 2 * 1024 * 1024 * 1024,
                    power_w: Some(310.5),
                    ..GpuSample::default()
                }],
                host: HostSample {
                    cpu_pct: 23.0,
                    ram_used_bytes: 1024 * 1024 * 1024,
                    ram_total_bytes: 4 * 1024 * 1024 * 1024,
                    ..HostSample::default()
                },
                gpu_notice: None,
            },
            ..MonitorUpdate::default()
        };
        let got: std::collections::HashMap<String, f64> = of_update(&u).into_iter().collect();
        assert_eq!(got["gpu1/util_pct"], 87.0);
        assert_eq!(got["gpu1/memory_used_gib"], 2.0);
        assert_eq!(got["gpu1/power_w"], 310.5);
        assert_eq!(got["host/cpu_pct"], 23.0);
        assert_eq!(got["host/ram_used_gib"], 1.0);
        assert!(!got.contains_key("gpu1/temperature_c"));
    }
}
