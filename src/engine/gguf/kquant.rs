//! ggml's k-quants that cockpit writes and reads: 256-element super-blocks with per-sub-block
//! scales themselves quantized against the super-block's f16 scale(s).
//!
//! - Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit minima,
//!   128 bytes of nibbles; x = d·sc_j·q − dmin·m_j over sub-blocks j of 32.
//! - Q5_K (176 bytes): as Q4_K, plus 32 bytes holding each element's fifth bit.
//! - Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales, f16
//!   d; x = d·sc_j·(q − 32) over sub-blocks j of 16.
//!
//! The quantizers take each sub-block's range (Q4_K/Q5_K: its minimum, or 0, and maximum; Q6_K:
//! its largest magnitude), quantize the sub-block scales to 6 (or 8) bits against the
//! super-block's largest, then round every element against the scale it will be read with.

use half::f16;

pub const QK: usize = 256;

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Sub-block j's (scale, minimum) from Q4_K/Q5_K's 12 packed bytes.
fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        let k = j - 4;
        (
            (s[k + 8] & 0x0f) | ((s[k] >> 6) << 4),
            (s[k + 8] >> 4) | ((s[k + 4] >> 6) << 4),
        )
    }
}

/// Eight 6-bit (scale, minimum) pairs packed into Q4_K/Q5_K's 12 bytes.
fn pack_scale_min(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    s
}

/// Q4_K (`levels` 15) or Q5_K (31): per sub-block of 32 the (scale, minimum) pair, quantized to
/// 6 bits against the block's d and dmin, and each element's level.
fn affine(x: &[f32], levels: f32) -> (f32, f32, [u8; 8], [u8; 8], [u8; QK]) {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sb) in x.chunks(32).enumerate() {
        let lo = sb.iter().fold(0f32, |m, v| m.min(*v));
        let hi = sb.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        scale[j] = (hi - lo) / levels;
        min[j] = -lo;
    }
    let max_scale = scale.iter().fold(0f32, |m, v| m.max(*v));
    let max_min = min.iter().fold(0f32, |m, v| m.max(*v));
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    let q6 = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: [u8; 8] = std::array::from_fn(|j| q6(scale[j], d));
    let m: [u8; 8] = std::array::from_fn(|j| q6(min[j], dmin));
    let mut q = [0u8; QK];
    for (i, v) in x.iter().enumerate() {
        let j = i / 32;
        let step = d * sc[j] as f32;
        let off = dmin * m[j] as f32;
        q[i] = if step > 0.0 {
            ((v + off) / step).round().clamp(0.0, levels) as u8
        } else {
            0
        };
    }
    (d, dmin, sc, m, q)
}

/// Q4_K's nibble bytes: chunk c of 32 bytes holds sub-block 2c in its low nibbles and 2c + 1 in
/// its high ones.
fn nibbles(q: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|b| {
        let (c, l) = (b / 32, b % 32);
        (q[c * 64 + l] & 0x0f) | ((q[c * 64 + 32 + l] & 0x0f) << 4)
    })
}

pub fn encode_q4_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let (d, dmin, sc, m, q) = affine(blk, 15.0);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(dmin).to_le_bytes());
        out.extend_from_slice(&pack_scale_min(&sc, &m));
        out.extend_from_slice(&nibbles(&q));
    }
}

pub fn encode_q5_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let (d, dmin, sc, m, q) = affine(blk, 31.0);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(dmin).to_le_bytes());
        out.extend_from_slice(&pack_scale_min(&sc, &m));
        // The fifth bits: bit b of byte l is element 32·b + l's.
        let qh: [u8; 32] = std::array::from_fn(|l| {
            (0..8).fold(0u8, |acc, b| acc | (((q[32 * b + l] >> 4) & 1) << b))
        });
        out.extend_from_slice(&qh);
        out.extend_from_slice(&nibbles(&q));
    }
}

pub fn encode_q6_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK) {
        let scale: [f32; 16] = std::array::from_fn(|j| {
            blk[16 * j..16 * (j + 1)]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()))
                / 31.0
        });
        let max_scale = scale.iter().fold(0f32, |m, v| m.max(*v));
        let d = f16::from_f32(max_scale / 127.0).to_f32();
        let sc: [i8; 16] = std::array::from_fn(|j| {
            if d > 0.0 {
                (scale[j] / d).round().clamp(-128.0, 127.0) as i8
            } else {
                0
            }
        });
        // Levels 0..=63 (the value + 32).
        let q: [u8; QK] = std::array::from_fn(|i| {
            let step = d * sc[i / 16] as f32;
            if step > 0.0 {
                ((blk[i] / step).round().clamp(-32.0, 31.0) + 32.0) as u8
            } else {
                32
            }
        });
        // Element e = 128·h + 32·s + i (h: half, s: 0..4, i: 0..32): its low nibble in byte
        // 64·h + 32·(s mod 2) + i (low half for s < 2), its high pair in byte 32·h + i at 2·s.
        let mut ql = [0u8; QK / 2];
        let mut qh = [0u8; QK / 4];
        for (e, &v) in q.iter().enumerate() {
            let (hf, r) = (e / 128, e % 128);
            let (s, i) = (r / 32, r % 32);
            ql[64 * hf + 32 * (s % 2) + i] |= (v & 0x0f) << (4 * (s / 2));
            qh[32 * hf + i] |= (v >> 4) << (2 * s);
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|v| *v as u8));
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

/// Q4_K (`fifth` false) or Q5_K blocks decoded.
pub fn decode_q45_k(bytes: &[u8], fifth: bool) -> Vec<f32> {
    let size = if fifth { 176 } else { 144 };
    let mut out = Vec::with_capacity(bytes.len() / size * QK);
    for b in bytes.chunks_exact(size) {
        let (d, dmin) = (h(&b[0..2]), h(&b[2..4]));
        let s = &b[4..16];
        let (qh, qs) = if fifth {
            (&b[16..48], &b[48..176])
        } else {
            (&b[0..0], &b[16..144])
        };
        for e in 0..QK {
            let j = e / 32;
            let (c, half, l) = (e / 64, (e / 32) % 2, e % 32);
            let mut q = (qs[32 * c + l] >> (4 * half)) & 0x0f;
            if fifth {
                q |= ((qh[l] >> j) & 1) << 4;
            }
            let (sc, m) = scale_min(s, j);
            out.push(d * sc as f32 * q as f32 - dmin * m as f32);
        }
    }
    out
}

pub fn decode_q6_k(bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / 210 * QK);
    for b in bytes.chunks_exact(210) {
        let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], h(&b[208..210]));
        for e in 0..QK {
            let (hf, r) = (e / 128, e % 128);
            let (s, i) = (r / 32, r % 32);
            let lo = (ql[64 * hf + 32 * (s % 2) + i] >> (4 * (s / 2))) & 0x0f;
            let hi = (qh[32 * hf + i] >> (2 * s)) & 3;
            let q = (lo | (hi << 4)) as i32 - 32;
            out.push(d * (sc[e / 16] as i8) as f32 * q as f32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    type Encoder = fn(&[f32], &mut Vec<u8>);

    fn signal(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37 + seed).sin() * (1.0 + (i % 7) as f32 * 0.3))
            .collect()
    }

    /// Each k-quant's round trip stays within about half a step of the sub-block it is read
    /// with (the scales' own 6-bit rounding adds a little).
    #[test]
    fn k_quants_round_trip_within_their_sub_block_steps() {
        let x = signal(2 * QK, 0.5);
        let cases: [(&str, Encoder, usize, f32); 3] = [
            ("Q4_K", encode_q4_k, 144, 15.0),
            ("Q5_K", encode_q5_k, 176, 31.0),
            ("Q6_K", encode_q6_k, 210, 62.0),
        ];
        for (name, enc, size, levels) in cases {
            let mut b = Vec::new();
            enc(&x, &mut b);
            assert_eq!(b.len(), 2 * size, "{name}");
            let y = match name {
                "Q4_K" => decode_q45_k(&b, false),
                "Q5_K" => decode_q45_k(&b, true),
                _ => decode_q6_k(&b),
            };
            assert_eq!(y.len(), x.len());
            let sub = if name == "Q6_K" { 16 } else { 32 };
            for (j, (a, c)) in x.chunks(sub).zip(y.chunks(sub)).enumerate() {
                let lo = a.iter().fold(0f32, |m, v| m.min(*v));
                let hi = a.iter().fold(0f32, |m, v| m.max(*v));
                let range = if name == "Q6_K" {
                    2.0 * a.iter().fold(0f32, |m, v| m.max(v.abs()))
                } else {
                    hi - lo
                };
                let step = range / levels;
                for (u, v) in a.iter().zip(c) {
                    assert!(
                        (u - v).abs() <= 0.75 * step + 1e-3,
                        "{name} sub-block {j}: {u} vs {v} (step {step})"
                    );
                }
            }
        }
    }

    #[test]
    fn scales_and_minima_pack_and_unpack() {
        let sc = [1, 63, 17, 32, 48, 5, 60, 33];
        let m = [0, 12, 63, 1, 40, 62, 7, 16];
        let s = pack_scale_min(&sc, &m);
        for j in 0..8 {
            assert_eq!(scale_min(&s, j), (sc[j], m[j]), "sub-block {j}");
        }
    }

    #[test]
    fn zeros_stay_zero() {
        let x = [0f32; QK];
        for (enc, dec) in [
            (encode_q4_k as Encoder, 0),
            (encode_q5_k, 1),
            (encode_q6_k, 2),
        ] {
            let mut b = Vec::new();
            enc(&x, &mut b);
            let y = match dec {
                0 => decode_q45_k(&b, false),
                1 => decode_q45_k(&b, true),
                _ => decode_q6_k(&b),
            };
            assert!(y.iter().all(|v| *v == 0.0));
        }
    }
}
