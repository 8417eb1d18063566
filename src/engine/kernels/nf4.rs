//! NF4 — 4-bit NormalFloat (Dettmers et al., QLoRA, 2023) — for a frozen LoRA base
//! (`lora.base_dtype = "nf4"`): each block of 64 consecutive weights (row-major) keeps its
//! absolute maximum, and each weight the nearest of 16 levels spread as the quantiles of a
//! normal distribution, scaled by that maximum. The block maxima are quantized again (double
//! quantization): 8 bits each, against one fp32 scale per group of 256 blocks, rounded up so
//! that no weight leaves [-1, 1] after the division. 4.127 bits per weight in all.
//!
//! The CUDA kernels (cuda/nf4.cuh: `nf4_*`) quantize at load and dequantize into bf16 where a
//! matmul needs the weight; the host functions here are the reference of the same arithmetic
//! (and the CPU path's implementation).

use candle_core::{DType, Device, Result, Tensor};

/// The 16 NF4 levels (QLoRA's published table).
pub const LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Weights per absmax block.
pub const BLOCK: usize = 64;
/// Blocks per fp32 scale of the quantized block maxima.
pub const GROUP: usize = 256;

/// A matrix `[out, inp]` in NF4 on its device.
#[derive(Clone, Debug)]
pub struct Nf4 {
    /// U8 `[n/2]`: element 2i in the low nibble of byte i, 2i+1 in the high one.
    pub codes: Tensor,
    /// U8 `[n/64]`: each block's quantized absmax.
    pub absq: Tensor,
    /// F32 `[⌈n/64/256⌉]`: absmax = absq · gscale of the block's group.
    pub gscale: Tensor,
    pub out: usize,
    pub inp: usize,
}

/// Why a matrix cannot be stored in NF4 (its element count must fill whole blocks).
pub fn check_shape(out: usize, inp: usize) -> std::result::Result<(), String> {
    if !(out * inp).is_multiple_of(BLOCK) {
        return Err(format!(
            "a [{out}, {inp}] matrix does not split into NF4 blocks of {BLOCK} weights"
        ));
    }
    Ok(())
}

impl Nf4 {
    /// Quantize `w` `[out, inp]`, rounded to bf16 first (on the GPU with the CUDA kernels, on
    /// the host with [`quantize_host`]: the same codes).
    pub fn quantize(w: &Tensor) -> Result<Self> {
        let (out, inp) = w.dims2()?;
        check_shape(out, inp).map_err(candle_core::Error::Msg)?;
        let dev = w.device().clone();
        let (codes, absq, gscale) = if dev.is_cuda() {
            super::nf4_quantize(&w.to_dtype(DType::BF16)?.contiguous()?, (BLOCK, GROUP))?
        } else {
            // From bf16, as on the GPU: the same codes wherever a base is quantized.
            let v = w
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let (c, a, g) = quantize_host(&v);
            let (nc, na, ng) = (c.len(), a.len(), g.len());
            (
                Tensor::from_vec(c, nc, &dev)?,
                Tensor::from_vec(a, na, &dev)?,
                Tensor::from_vec(g, ng, &dev)?,
            )
        };
        Ok(Self {
            codes,
            absq,
            gscale,
            out,
            inp,
        })
    }

    /// The matrix back in `dtype` (bf16 through the CUDA kernel on the GPU).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let dev = self.codes.device();
        let t = if dev.is_cuda() {
            super::nf4_dequantize(
                (&self.codes, &self.absq, &self.gscale),
                (self.out, self.inp),
            )?
        } else {
            let v = dequantize_host(
                &self.codes.to_vec1::<u8>()?,
                &self.absq.to_vec1::<u8>()?,
                &self.gscale.to_vec1::<f32>()?,
            );
            Tensor::from_vec(v, (self.out, self.inp), &Device::Cpu)?
        };
        t.to_dtype(dtype)
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let n = self.out * self.inp;
        n / 2 + n / BLOCK + 4 * n.div_ceil(BLOCK * GROUP)
    }
}

/// The level nearest to `x` (ties to the lower one): the count of midpoints below `x`.
pub fn code(x: f32) -> u8 {
    let mut c = 0u8;
    for i in 0..15 {
        if x > 0.5 * (LEVELS[i] + LEVELS[i + 1]) {
            c += 1;
        }
    }
    c
}

/// Host reference of the kernels' quantization: (codes, absq, gscale) of `w` (`w.len()` a
/// multiple of [`BLOCK`]).
pub fn quantize_host(w: &[f32]) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let amax: Vec<f32> = w
        .chunks(BLOCK)
        .map(|b| b.iter().fold(0f32, |m, x| m.max(x.abs())))
        .collect();
    let mut absq = Vec::with_capacity(amax.len());
    let mut gscale = Vec::with_capacity(amax.len().div_ceil(GROUP));
    for g in amax.chunks(GROUP) {
        let sc = g.iter().fold(0f32, |m, &x| m.max(x)) / 255.0;
        gscale.push(sc);
        absq.extend(g.iter().map(|&a| {
            if sc > 0.0 {
                (a / sc).ceil().min(255.0) as u8
            } else {
                0
            }
        }));
    }
    let mut codes = vec![0u8; w.len() / 2];
    for (blk, chunk) in w.chunks(BLOCK).enumerate() {
        let am = absq[blk] as f32 * gscale[blk / GROUP];
        let inv = if am > 0.0 { 1.0 / am } else { 0.0 };
        for (k, pair) in chunk.chunks(2).enumerate() {
            let c = |x: f32| code((x * inv).clamp(-1.0, 1.0));
            codes[blk * BLOCK / 2 + k] = c(pair[0]) | (c(pair[1]) << 4);
        }
    }
    (codes, absq, gscale)
}

/// Host reference of the dequantization kernel.
pub fn dequantize_host(codes: &[u8], absq: &[u8], gscale: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(2 * codes.len());
    for (i, &byte) in codes.iter().enumerate() {
        let blk = 2 * i / BLOCK;
        let am = absq[blk] as f32 * gscale[blk / GROUP];
        out.push(LEVELS[(byte & 15) as usize] * am);
        out.push(LEVELS[(byte >> 4) as usize] * am);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_round_trip_and_codes_are_nearest() {
        for (i, &v) in LEVELS.iter().enumerate() {
            assert_eq!(code(v) as usize, i);
        }
        for k in 0..=2000 {
            let x = -1.0 + k as f32 * 1e-3;
            let c = code(x) as usize;
            let best = LEVELS
                .iter()
                .map(|l| (l - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!((LEVELS[c] - x).abs() <= best + 1e-7, "x {x}: code {c}");
        }
    }

    #[test]
    fn quantization_error_is_that_of_four_bit_normal_levels() {
        // Normal weights (as trained matrices are, near enough): NF4's relative RMS error on
        // them is about 0.1 (the levels' spacing); the double quantization of the block maxima
        // adds little, and no element leaves its block's range.
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut uni = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let n = 64 * 600;
        let w: Vec<f32> = (0..n)
            .map(|_| {
                let (u1, u2) = (1.0 - uni(), uni());
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 0.02) as f32
            })
            .collect();
        let (codes, absq, gscale) = quantize_host(&w);
        assert_eq!((codes.len(), absq.len(), gscale.len()), (n / 2, n / 64, 3));
        let back = dequantize_host(&codes, &absq, &gscale);
        let (mut e2, mut w2) = (0f64, 0f64);
        for (a, b) in w.iter().zip(&back) {
            e2 += ((a - b) as f64).powi(2);
            w2 += (*a as f64).powi(2);
        }
        let rel = (e2 / w2).sqrt();
        assert!(rel > 0.05 && rel < 0.12, "relative RMS error {rel}");
        // Each block's largest weight comes back within the 8-bit step of its absmax.
        for (blk, chunk) in w.chunks(BLOCK).enumerate() {
            let am = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            let q = absq[blk] as f32 * gscale[blk / GROUP];
            assert!(
                q >= am && q <= am + gscale[blk / GROUP] * 1.0001,
                "block {blk}"
            );
        }
    }

    #[test]
    fn a_zero_block_and_an_odd_shape() {
        let w = vec![0f32; 128];
        let (c, a, g) = quantize_host(&w);
        assert!(dequantize_host(&c, &a, &g).iter().all(|&x| x == 0.0));
        assert!(check_shape(3, 21).is_err());
        assert!(check_shape(4, 16).is_ok());
    }
}
