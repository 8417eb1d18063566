//! Dropout masks from a counter-based RNG, the same on every device and in every executor.
//!
//! A mask is a pure function of (the micro-batch's seed, the dropout site, the element): the
//! counter of Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
//! SC'11) names the element and its key is the seed. So a replayed or resumed step draws the
//! same mask, and the candle model (the CPU path and the oracle) and the whole-model CUDA step
//! draw the *same* masks: tests compare them with dropout on. kernels.cu holds the device side
//! of this file (`philox4x32_10`, `drop_bits8`, `dropout_mask_f32` and the flash kernels).
//!
//! Each Philox call gives eight 16-bit uniforms u; an element is kept iff u ≥ thr with
//! thr = round(p·65536), and scaled by 65536 / (65536 − thr), so the mask's mean is exactly 1.
//! Two layouts map elements to (counter, uniform):
//! - [`Layout::Rows`] for `[rows, cols]` activations (embedding and residual dropout): element
//!   (r, c) ↦ counter (r, c / 8), uniform c mod 8 — eight adjacent columns per call;
//! - [`Layout::Attention`] for attention probabilities `[B·H·T, T]`: element (query row r,
//!   key j), j = 64·tile + 8·nt + 2·t4 + e ↦ counter (r, 8·tile + 2·t4 + nt / 4), uniform
//!   2·(nt mod 4) + e — the fragment layout of the flash kernels' tensor-core tiles.

/// Where in the model a mask applies: its Philox counter's fourth word.
pub fn site_embedding() -> u32 {
    0
}

/// The attention probabilities of layer `l`.
pub fn site_attention(l: usize) -> u32 {
    3 * l as u32 + 1
}

/// The attention block's output of layer `l` (before the residual add).
pub fn site_attention_out(l: usize) -> u32 {
    3 * l as u32 + 2
}

/// The MLP's output of layer `l` (before the residual add).
pub fn site_mlp_out(l: usize) -> u32 {
    3 * l as u32 + 3
}

/// The input of the LoRA adapters of layer `l` in group `group` (0 q/k/v, 1 o, 2 gate/up,
/// 3 down: the adapters that share an input share its mask).
pub fn site_lora(l: usize, group: usize) -> u32 {
    0x4000_0000 | (4 * l + group) as u32
}

/// The seed of one micro-batch's masks: a function of the run's seed, the optimizer step and
/// the micro-batch index only, so a resumed run draws the same masks.
pub fn micro_seed(run_seed: u64, step: u64, micro: usize) -> u64 {
    run_seed ^ step.wrapping_mul(1 << 16).wrapping_add(micro as u64)
}

/// The keep threshold for drop probability `p` (0 = keep everything).
pub fn threshold(p: f64) -> u32 {
    (p.clamp(0.0, 1.0) * 65536.0).round().min(65535.0) as u32
}

/// The scale of a kept element: 1 / (1 − the drop probability the threshold realises).
pub fn keep_scale(thr: u32) -> f32 {
    (65536.0 / (65536.0 - thr as f64)) as f32
}

/// Philox4x32-10 of counter `c` under key `k`.
pub fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for _ in 0..10 {
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k[0] = k[0].wrapping_add(0x9E37_79B9);
        k[1] = k[1].wrapping_add(0xBB67_AE85);
    }
    c
}

/// How a mask's elements map to Philox counters (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Rows,
    Attention,
}

/// The mask of a `[rows, cols]` view: 0 for a dropped element, [`keep_scale`] for a kept one.
pub fn mask(rows: usize, cols: usize, seed: u64, site: u32, p: f64, layout: Layout) -> Vec<f32> {
    let thr = threshold(p);
    let scale = keep_scale(thr);
    let key = [seed as u32, (seed >> 32) as u32];
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows as u64 {
        let mut cached: Option<(u32, [u32; 4])> = None;
        for c in 0..cols {
            let (ctr2, u) = match layout {
                Layout::Rows => ((c >> 3) as u32, c & 7),
                Layout::Attention => {
                    let (tile, jj) = (c >> 6, c & 63);
                    let (nt, t4) = (jj >> 3, (jj >> 1) & 3);
                    ((8 * tile + 2 * t4 + nt / 4) as u32, 2 * (nt & 3) + (jj & 1))
                }
            };
            let words = match cached {
                Some((k, w)) if k == ctr2 => w,
                _ => {
                    let w = philox4x32_10([r as u32, (r >> 32) as u32, ctr2, site], key);
                    cached = Some((ctr2, w));
                    w
                }
            };
            let uniform = (words[u >> 1] >> (16 * (u & 1))) & 0xFFFF;
            out.push(if uniform >= thr { scale } else { 0.0 });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_known_answers() {
        // Random123's known-answer vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn masks_drop_at_the_asked_rate_keep_the_mean_and_differ_by_site_and_seed() {
        for layout in [Layout::Rows, Layout::Attention] {
            let m = mask(64, 256, 7, 1, 0.2, layout);
            let dropped = m.iter().filter(|&&v| v == 0.0).count() as f64 / m.len() as f64;
            let mean = m.iter().map(|&v| v as f64).sum::<f64>() / m.len() as f64;
            assert!(
                (dropped - 0.2).abs() < 0.01,
                "{layout:?}: dropped {dropped}"
            );
            assert!((mean - 1.0).abs() < 0.02, "{layout:?}: mean {mean}");
            assert_eq!(m, mask(64, 256, 7, 1, 0.2, layout), "a pure function");
            assert_ne!(m, mask(64, 256, 7, 2, 0.2, layout), "another site");
            assert_ne!(m, mask(64, 256, 8, 1, 0.2, layout), "another seed");
        }
        assert!(mask(4, 8, 1, 0, 0.0, Layout::Rows)
            .iter()
            .all(|&v| v == 1.0));
    }
}
