//! GGUF, llama.cpp's model file: written by `cockpit export SOURCE OUT.gguf`
//! ([`crate::engine::export_gguf`]: architecture metadata, tokenizer, tensors under llama.cpp's
//! names in f32, f16, bf16, q8_0, q4_0, q4_1 or llama.cpp's k-quant mixes q4_k_m, q5_k_m and
//! q6_k), and read as a model source ([`load`]).

pub mod fuse;
pub mod gemma3;
pub mod granite_hybrid;
pub mod kquant;
pub mod load;
pub mod names;
pub mod phi3;
pub mod quant;
pub mod reader;
pub mod tokenizer;
pub mod tokenizer_in;
pub mod writer;

use quant::GgmlType;

/// How an export encodes its matrices: one type for all, or a k-quant mix as llama.cpp's
/// `_M` files are (more bits where they matter most).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    Uniform(GgmlType),
    /// `base` (Q4_K or Q5_K) for most matrices; Q6_K for the output head (or the tied
    /// embedding that serves as one) and for attn_v and ffn_down in the layers llama.cpp
    /// gives more bits to ([`more_bits`]).
    KMix(GgmlType),
}

/// The encodings `--quant` names, with llama.cpp's `general.file_type` for each.
pub const QUANTS: &[(&str, Quant, u32)] = &[
    ("f32", Quant::Uniform(GgmlType::F32), 0),
    ("f16", Quant::Uniform(GgmlType::F16), 1),
    ("bf16", Quant::Uniform(GgmlType::BF16), 32),
    ("q8_0", Quant::Uniform(GgmlType::Q8_0), 7),
    ("q4_0", Quant::Uniform(GgmlType::Q4_0), 2),
    ("q4_1", Quant::Uniform(GgmlType::Q4_1), 3),
    ("q4_k_m", Quant::KMix(GgmlType::Q4_K), 15),
    ("q5_k_m", Quant::KMix(GgmlType::Q5_K), 17),
    ("q6_k", Quant::Uniform(GgmlType::Q6_K), 18),
];

/// Whether layer `i` of `n` gets more bits in a k-quant mix: the first and last eighth of the
/// layers and every third one between (llama.cpp's rule for attn_v and ffn_down).
pub fn more_bits(i: usize, n: usize) -> bool {
    // (Past the first disjunct i ≥ n/8: the subtraction cannot underflow.)
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl Quant {
    /// The type the tensor llama.cpp names `name` is written in (before the fallback for rows
    /// that are no whole number of its blocks); `n_layer` layers, `tied` head.
    pub fn type_for(self, name: &str, n_layer: usize, tied: bool) -> GgmlType {
        let base = match self {
            Quant::Uniform(t) => return t,
            Quant::KMix(t) => t,
        };
        if name == "output.weight" || (tied && name == "token_embd.weight") {
            return GgmlType::Q6_K;
        }
        // (a fused q|k|v, GPT-2's and Phi-3's, one step up as llama.cpp gives it)
        if name.ends_with("attn_qkv.weight") {
            return match base {
                GgmlType::Q4_K => GgmlType::Q5_K,
                _ => GgmlType::Q6_K,
            };
        }
        if name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight") {
            let layer = name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            if layer.is_some_and(|i| more_bits(i, n_layer)) {
                return GgmlType::Q6_K;
            }
        }
        base
    }

    /// llama.cpp's `general.file_type` of this encoding.
    pub fn file_type(self) -> u32 {
        QUANTS.iter().find(|q| q.1 == self).map_or(0, |q| q.2)
    }

    pub fn name(self) -> &'static str {
        QUANTS.iter().find(|q| q.1 == self).map_or("?", |q| q.0)
    }
}

/// `--quant NAME` read, or why not.
pub fn parse_quant(s: &str) -> Result<Quant, String> {
    let names: Vec<&str> = QUANTS.iter().map(|q| q.0).collect();
    if let Some(q) = QUANTS.iter().find(|q| q.0 == s.to_ascii_lowercase()) {
        return Ok(q.1);
    }
    let lower = s.to_ascii_lowercase();
    if lower.starts_with('q') && lower.contains("_k") {
        return Err(format!(
            "--quant {s:?}: this k-quant is not written (allowed: {}); llama.cpp's llama-quantize turns a q8_0/f16 export into {s}",
            names.join(", ")
        ));
    }
    Err(format!("--quant {s:?}: allowed: {}", names.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_cpp_does() {
        let q = parse_quant("Q4_K_M").unwrap();
        assert_eq!(q.file_type(), 15);
        assert_eq!(q.type_for("output.weight", 16, false), GgmlType::Q6_K);
        assert_eq!(q.type_for("token_embd.weight", 16, true), GgmlType::Q6_K);
        assert_eq!(q.type_for("token_embd.weight", 16, false), GgmlType::Q4_K);
        assert_eq!(q.type_for("blk.0.attn_v.weight", 16, true), GgmlType::Q6_K);
        assert_eq!(
            q.type_for("blk.4.ffn_down.weight", 16, true),
            GgmlType::Q6_K
        );
        assert_eq!(
            q.type_for("blk.3.ffn_down.weight", 16, true),
            GgmlType::Q4_K
        );
        assert_eq!(q.type_for("blk.15.attn_v.weight", 16, true), GgmlType::Q6_K);
        assert_eq!(q.type_for("blk.5.attn_q.weight", 16, true), GgmlType::Q4_K);
        assert_eq!(
            q.type_for("blk.5.attn_qkv.weight", 16, true),
            GgmlType::Q5_K
        );
        let more: Vec<usize> = (0..16).filter(|&i| more_bits(i, 16)).collect();
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 14, 15]);
        assert!(parse_quant("q2_k").unwrap_err().contains("not written"));
    }
}
