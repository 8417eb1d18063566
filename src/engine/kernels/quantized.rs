//! A frozen LoRA base matrix stored quantized on its device (`lora.base_dtype = "nf4"`): in
//! NF4, quantized by cockpit, or in a GGUF file's own 4–6-bit blocks, kept as the file has them.
//! Either is dequantized where a matmul reads it.

use super::ggml::GgmlBlocks;
use super::nf4::Nf4;
use candle_core::{DType, Result, Tensor};

#[derive(Clone, Debug)]
pub enum Quantized {
    Nf4(Nf4),
    Ggml(GgmlBlocks),
}

impl Quantized {
    /// `(out, in)` features.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Quantized::Nf4(q) => (q.out, q.inp),
            Quantized::Ggml(q) => (q.out, q.inp),
        }
    }

    /// The matrix in `dtype` (rounded to bf16 on the way on the GPU).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Quantized::Nf4(q) => q.dequantize(dtype),
            Quantized::Ggml(q) => q.dequantize(dtype),
        }
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        match self {
            Quantized::Nf4(q) => q.bytes(),
            Quantized::Ggml(q) => q.bytes(),
        }
    }

    /// The format's name: NF4, Q4_K, ….
    pub fn name(&self) -> &'static str {
        match self {
            Quantized::Nf4(_) => "NF4",
            Quantized::Ggml(q) => q.name(),
        }
    }
}
