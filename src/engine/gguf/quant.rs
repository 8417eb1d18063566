//! ggml's tensor encodings that cockpit writes and reads: F32, F16, BF16, the 32-element
//! blocks Q8_0 (an f16 scale and 32 signed bytes), Q4_0 (an f16 scale, 32 nibbles) and Q4_1
//! (scale and minimum, 32 nibbles), and the k-quants Q4_K, Q5_K and Q6_K ([`super::kquant`]).

use super::kquant;

use half::{bf16, f16};

/// ggml's type codes (the ones cockpit knows by name, spelled as ggml spells them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q8_0 = 8,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    BF16 = 30,
}

impl GgmlType {
    pub fn from_code(c: u32) -> Option<GgmlType> {
        Some(match c {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_K => (kquant::QK, 144),
            GgmlType::Q5_K => (kquant::QK, 176),
            GgmlType::Q6_K => (kquant::QK, 210),
        }
    }
    /// Bytes of `n` elements (None when `n` is not a whole number of blocks).
    pub fn bytes_of(self, n: usize) -> Option<usize> {
        let (b, s) = self.block();
        n.is_multiple_of(b).then_some(n / b * s)
    }
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::BF16 => "BF16",
        }
    }
}

/// ggml's type names by code, for errors about types cockpit does not read.
pub fn code_name(c: u32) -> String {
    let known = [
        (6, "Q5_0"),
        (7, "Q5_1"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
    ];
    match GgmlType::from_code(c) {
        Some(t) => t.name().to_string(),
        None => known
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, n)| n.to_string())
            .unwrap_or_else(|| format!("type {c}")),
    }
}

/// `x` encoded as `ty` (`x.len()` a whole number of `ty`'s blocks).
pub fn encode(x: &[f32], ty: GgmlType) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.bytes_of(x.len()).unwrap_or(0));
    match ty {
        GgmlType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => out.extend(x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => out.extend(x.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for b in x.chunks(32) {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
            }
        }
        GgmlType::Q4_0 => {
            for b in x.chunks(32) {
                // The value of largest magnitude maps to -8.
                let max = b
                    .iter()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = max / -8.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                out.extend((0..16).map(|i| q(b[i]) | q(b[i + 16]) << 4));
            }
        }
        GgmlType::Q4_1 => {
            for b in x.chunks(32) {
                let min = b.iter().fold(f32::INFINITY, |m, v| m.min(*v));
                let max = b.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                let d = (max - min) / 15.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                out.extend((0..16).map(|i| q(b[i]) | q(b[i + 16]) << 4));
            }
        }
        GgmlType::Q4_K => kquant::encode_q4_k(x, &mut out),
        GgmlType::Q5_K => kquant::encode_q5_k(x, &mut out),
        GgmlType::Q6_K => kquant::encode_q6_k(x, &mut out),
    }
    out
}

/// `n` elements decoded from `bytes` (which hold exactly `ty.bytes_of(n)`).
pub fn decode(bytes: &[u8], ty: GgmlType) -> Vec<f32> {
    let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(h).collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        GgmlType::Q8_0 => bytes
            .chunks_exact(34)
            .flat_map(|b| {
                let d = h(&b[..2]);
                b[2..].iter().map(move |q| (*q as i8) as f32 * d)
            })
            .collect(),
        // Nibbles: the low ones are elements 0..16, the high ones 16..32.
        GgmlType::Q4_0 => bytes
            .chunks_exact(18)
            .flat_map(|b| {
                let d = h(&b[..2]);
                let q = &b[2..];
                let lo = q.iter().map(move |v| ((v & 0x0f) as i32 - 8) as f32 * d);
                let hi = q.iter().map(move |v| ((v >> 4) as i32 - 8) as f32 * d);
                lo.chain(hi).collect::<Vec<_>>()
            })
            .collect(),
        GgmlType::Q4_1 => bytes
            .chunks_exact(20)
            .flat_map(|b| {
                let (d, m) = (h(&b[..2]), h(&b[2..4]));
                let q = &b[4..];
                let lo = q.iter().map(move |v| (v & 0x0f) as f32 * d + m);
                let hi = q.iter().map(move |v| (v >> 4) as f32 * d + m);
                lo.chain(hi).collect::<Vec<_>>()
            })
            .collect(),
        GgmlType::Q4_K => kquant::decode_q45_k(bytes, false),
        GgmlType::Q5_K => kquant::decode_q45_k(bytes, true),
        GgmlType::Q6_K => kquant::decode_q6_k(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trips_within_a_step_of_its_block() {
        let x: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let bytes = encode(&x, GgmlType::Q8_0);
        assert_eq!(bytes.len(), GgmlType::Q8_0.bytes_of(64).unwrap());
        let y = decode(&bytes, GgmlType::Q8_0);
        for (b, (a, c)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let step = a.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (u, v) in a.iter().zip(c) {
                assert!((u - v).abs() <= step * 0.6, "block {b}: {u} vs {v}");
            }
        }
        let zeros = decode(&encode(&[0.0; 32], GgmlType::Q8_0), GgmlType::Q8_0);
        assert!(zeros.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn q4_blocks_decode_low_nibbles_first() {
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..16u8).map(|i| (i & 0x0f) | (15 - i) << 4));
        let y = decode(&b, GgmlType::Q4_0);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[15], 3.5);
        assert_eq!(y[16], 3.5);
    }

    #[test]
    fn q4_round_trips_within_a_step() {
        let x: Vec<f32> = (0..32).map(|i| ((i as f32) * 0.7).cos()).collect();
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1] {
            let y = decode(&encode(&x, ty), ty);
            for (u, v) in x.iter().zip(&y) {
                assert!((u - v).abs() <= 2.0 / 15.0 + 1e-3, "{ty:?}: {u} vs {v}");
            }
        }
    }
}
