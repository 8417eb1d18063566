//! GGUF, llama.cpp's model file: written by `cockpit export SOURCE OUT.gguf`
//! ([`crate::engine::export_gguf`]: architecture metadata, tokenizer, tensors under llama.cpp's
//! names in f32, f16, bf16, q8_0, q4_0 or q4_1), and read as a model source ([`load`]).

pub mod load;
pub mod names;
pub mod quant;
pub mod reader;
pub mod tokenizer;
pub mod writer;

use quant::GgmlType;

/// The encodings `--quant` names, with llama.cpp's `general.file_type` for each.
pub const QUANTS: &[(&str, GgmlType, u32)] = &[
    ("f32", GgmlType::F32, 0),
    ("f16", GgmlType::F16, 1),
    ("bf16", GgmlType::BF16, 32),
    ("q8_0", GgmlType::Q8_0, 7),
    ("q4_0", GgmlType::Q4_0, 2),
    ("q4_1", GgmlType::Q4_1, 3),
];

/// `--quant NAME` read, or why not.
pub fn parse_quant(s: &str) -> Result<GgmlType, String> {
    let names: Vec<&str> = QUANTS.iter().map(|q| q.0).collect();
    if let Some(q) = QUANTS.iter().find(|q| q.0 == s.to_ascii_lowercase()) {
        return Ok(q.1);
    }
    let lower = s.to_ascii_lowercase();
    if lower.starts_with('q') && lower.contains("_k") {
        return Err(format!(
            "--quant {s:?}: k-quants are not written yet (allowed: {}); llama.cpp's llama-quantize turns a q8_0/f16 export into {s}",
            names.join(", ")
        ));
    }
    Err(format!("--quant {s:?}: allowed: {}", names.join(", ")))
}
