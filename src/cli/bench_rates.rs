//! The rates `cockpit bench --profile` reports from a profiled step's kernel groups: flash
//! attention's TFLOP/s, and on a hybrid the Mamba-2 mixer's time a layer beside attention's
//! and its chunk products' TFLOP/s.

use crate::engine::events::KernelTime;
use crate::engine::spec::MambaFlops;
use serde::Serialize;

/// GPU ms and launches (the most of any one group) of the kernel groups `keep` takes.
fn sum(kernels: &[KernelTime], keep: impl Fn(&str) -> bool) -> (f64, u32) {
    kernels
        .iter()
        .filter(|k| keep(&k.name))
        .fold((0.0, 0), |(ms, n), k| (ms + k.ms, n.max(k.launches)))
}

/// The flash backward's launches: its main kernel's (flash_bwd, _wg or _ws), once per
/// attention layer and micro-batch — not the preprocess, the dq conversion or head dim 256's
/// dK, dV sum, whose time is the backward's too.
fn flash_bwd_launches(kernels: &[KernelTime]) -> u32 {
    kernels
        .iter()
        .filter(|k| {
            k.name.starts_with("flash_bwd")
                && !k.name.ends_with("preprocess")
                && !k.name.ends_with("convert")
                && !k.name.ends_with("kv_sum")
        })
        .map(|k| k.launches)
        .sum()
}

/// TFLOP/s of `flops` done in `ms`, where both are there.
fn tflops(flops: f64, ms: f64) -> Option<f64> {
    (flops > 0.0 && ms > 0.0).then(|| flops / (ms * 1e-3) / 1e12)
}

/// Flash attention's achieved TFLOP/s in a profiled step: the forward's launches (recomputed
/// ones included) and the backward's (its main kernel with the pass before and the dQ
/// conversion after), FLOPs counted as flash attention counts them (causal pairs only; the
/// backward 2.5x the forward).
#[derive(Debug, Serialize)]
pub struct AttentionRate {
    pub fwd_tflops: Option<f64>,
    pub fwd_ms: f64,
    pub fwd_launches: u32,
    pub bwd_tflops: Option<f64>,
    pub bwd_ms: f64,
    pub bwd_launches: u32,
}

impl AttentionRate {
    /// From the kernel groups of a profiled step, for `flops_fwd` FLOPs a launch of the
    /// forward (one layer over the micro-batch).
    pub fn of(kernels: &[KernelTime], flops_fwd: f64) -> Option<Self> {
        let (fwd_ms, fwd_launches) = sum(kernels, |n| n.starts_with("flash_fwd"));
        let bwd_launches = flash_bwd_launches(kernels);
        let (bwd_ms, _) = sum(kernels, |n| n.starts_with("flash_bwd"));
        if fwd_launches == 0 && bwd_launches == 0 {
            return None;
        }
        let rate = |launches: u32, flops: f64, ms: f64| tflops(launches as f64 * flops, ms);
        Some(Self {
            fwd_tflops: rate(fwd_launches, flops_fwd, fwd_ms),
            fwd_ms,
            fwd_launches,
            bwd_tflops: rate(bwd_launches, 2.5 * flops_fwd, bwd_ms),
            bwd_ms,
            bwd_launches,
        })
    }
}

/// A hybrid's Mamba-2 mixer in a profiled step: its kernels' GPU time (between in_proj and
/// out_proj, forward and backward, the states the backward computes again included) per Mamba
/// layer and micro-batch, beside flash attention's per attention layer (the same width: a
/// hybrid's attention layers); and the chunk kernels' products, counted by [`MambaFlops`], as
/// TFLOP/s over those kernels' time.
#[derive(Debug, Serialize)]
pub struct MambaRate {
    pub layer_ms: f64,
    pub attention_layer_ms: Option<f64>,
    pub chunk_tflops: Option<f64>,
    pub chunk_ms: f64,
}

impl MambaRate {
    /// From the kernel groups of a profiled step, for the chunk kernels' FLOPs a launch `f`
    /// (over the micro-batch).
    pub fn of(kernels: &[KernelTime], f: &MambaFlops) -> Option<Self> {
        // (The scan's backward runs once per Mamba layer and micro-batch.)
        let (_, layers) = sum(kernels, |n| n == "mamba_scan_bwd");
        if layers == 0 {
            return None;
        }
        let (mixer_ms, _) = sum(kernels, |n| n.starts_with("mamba_"));
        let (flash_ms, _) = sum(kernels, |n| n.starts_with("flash_"));
        let flash_layers = flash_bwd_launches(kernels);
        let products = [
            ("mamba_scan", f.scan),
            ("mamba_state_walk", f.chunk_state),
            ("mamba_cb", f.cb),
            ("mamba_scan_bwd", f.scan_bwd),
            ("mamba_chunk_state_bwd", f.chunk_state_bwd),
            // (where the scan's backward takes the chunk states' share through x, this kernel
            // takes dB: the two halves are counted here, the sum over the kernels is exact)
            ("mamba_chunk_state_db", f.chunk_state_bwd),
            ("mamba_state_walk_bwd", f.walk_bwd),
        ];
        let (mut chunk_ms, mut flops) = (0.0, 0.0);
        for k in kernels {
            if let Some((_, per)) = products.iter().find(|(n, _)| *n == k.name) {
                chunk_ms += k.ms;
                flops += k.launches as f64 * per;
            }
        }
        Some(Self {
            layer_ms: mixer_ms / layers as f64,
            attention_layer_ms: (flash_layers > 0).then(|| flash_ms / flash_layers as f64),
            chunk_tflops: tflops(flops, chunk_ms),
            chunk_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(name: &str, ms: f64, launches: u32) -> KernelTime {
        KernelTime {
            name: name.into(),
            ms,
            launches,
        }
    }

    /// Flash attention's rate from a profiled step: the forward's launches (recompute's too),
    /// the backward's main kernel's launches, and all three backward kernels' time.
    #[test]
    fn attention_rate_counts_launches_and_the_backward_s_three_kernels() {
        let kernels = [
            k("gemm", 50.0, 300),
            k("flash_fwd_wg", 2.0, 24),
            k("flash_bwd_ws", 4.0, 12),
            k("flash_bwd_preprocess", 0.5, 12),
            k("flash_bwd_dq_convert", 0.5, 12),
        ];
        let a = AttentionRate::of(&kernels, 1e10).expect("flash kernels ran");
        assert_eq!((a.fwd_launches, a.bwd_launches), (24, 12));
        assert_eq!(a.bwd_ms, 5.0);
        assert!((a.fwd_tflops.unwrap_or(0.0) - 24.0 * 1e10 / 2e-3 / 1e12).abs() < 1e-9);
        assert!((a.bwd_tflops.unwrap_or(0.0) - 12.0 * 2.5e10 / 5e-3 / 1e12).abs() < 1e-9);
        assert!(AttentionRate::of(&kernels[..1], 1e10).is_none());
        // Head dim 256: the dK, dV sum's time is the backward's, its launches are not.
        let d256 = [
            k("flash_fwd", 2.0, 24),
            k("flash_bwd", 4.0, 12),
            k("flash_bwd_kv_sum", 1.0, 12),
            k("flash_bwd_preprocess", 0.5, 12),
            k("flash_bwd_dq_convert", 0.5, 12),
        ];
        let a = AttentionRate::of(&d256, 1e10).expect("flash kernels ran");
        assert_eq!((a.bwd_launches, a.bwd_ms), (12, 6.0));
    }

    /// The mixer's time a layer over the scan's backward launches, attention's over the flash
    /// backward's, and the chunk products' rate over their kernels' time alone.
    #[test]
    fn mamba_rate_counts_the_chunk_products_and_a_layer_s_time() {
        let kernels = [
            k("gemm", 50.0, 300),
            k("mamba_conv", 2.0, 72),
            k("mamba_scan", 3.0, 36),
            k("mamba_cb", 1.0, 72),
            k("mamba_state_walk", 2.0, 72),
            k("mamba_scan_bwd", 9.0, 36),
            k("mamba_chunk_state_bwd", 3.0, 36),
            k("mamba_state_walk_bwd", 1.0, 36),
            k("flash_fwd", 1.0, 8),
            k("flash_bwd", 2.0, 4),
            k("flash_bwd_preprocess", 0.2, 4),
        ];
        let f = MambaFlops {
            scan: 1e9,
            chunk_state: 2e8,
            cb: 1e8,
            scan_bwd: 3e9,
            chunk_state_bwd: 4e8,
            walk_bwd: 2e8,
        };
        let m = MambaRate::of(&kernels, &f).expect("Mamba kernels ran");
        assert_eq!(m.layer_ms, 21.0 / 36.0);
        assert_eq!(m.attention_layer_ms, Some(3.2 / 4.0));
        assert_eq!(m.chunk_ms, 19.0);
        let flops = 36.0 * 1e9 + 72.0 * 2e8 + 72.0 * 1e8 + 36.0 * 3e9 + 36.0 * 4e8 + 36.0 * 2e8;
        assert!((m.chunk_tflops.unwrap_or(0.0) - flops / 19e-3 / 1e12).abs() < 1e-9);
        assert!(MambaRate::of(&kernels[..1], &f).is_none());
        // Where the scan's backward takes the chunk states' share through x, their dB kernel
        // carries the chunk states' backward's products: the same sum.
        let mut fused = kernels.clone();
        fused[6] = k("mamba_chunk_state_db", 3.0, 36);
        let m = MambaRate::of(&fused, &f).expect("Mamba kernels ran");
        assert_eq!(m.chunk_ms, 19.0);
        assert!((m.chunk_tflops.unwrap_or(0.0) - flops / 19e-3 / 1e12).abs() < 1e-9);
    }
}
