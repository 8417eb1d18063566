//! ggml's quantized blocks kept as a GGUF file stores them, for a frozen LoRA base read from
//! one (`lora.base = "model.gguf"`, `lora.base_dtype = "nf4"`): the matrix is dequantized on the
//! device where a matmul reads it (cuda/ggml.cuh), so the weights are the file's, with no second
//! rounding into NF4. The host decoders of the same formats are in `engine::gguf::quant`.

use candle_core::{DType, Device, Result, Tensor};

/// The formats kept as blocks: (ggml type code, name, weights a block, bytes a block). Wider
/// ones (Q8_0, 16- and 32-bit) are quantized to NF4 like any dense base matrix.
pub const FORMATS: [(u32, &str, usize, usize); 5] = [
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
];

/// A format of [`FORMATS`] by ggml type code.
pub fn format(code: u32) -> Option<(u32, &'static str, usize, usize)> {
    FORMATS.iter().copied().find(|f| f.0 == code)
}

/// A matrix `[out, inp]` in one of ggml's block formats ([`FORMATS`]).
#[derive(Clone, Debug)]
pub struct GgmlBlocks {
    /// ggml's type code.
    pub code: u32,
    /// U8 `[out · inp / block · bytes]`: the rows one after another, each whole blocks.
    pub data: Tensor,
    pub out: usize,
    pub inp: usize,
}

impl GgmlBlocks {
    /// Blocks of `code` from the bytes of `out` rows of `inp` weights (on `device`).
    pub fn new(code: u32, out: usize, inp: usize, bytes: Vec<u8>, device: &Device) -> Result<Self> {
        let Some((_, name, block, size)) = format(code) else {
            return Err(candle_core::Error::Msg(format!(
                "ggml type {code} is not kept as blocks"
            )));
        };
        if !inp.is_multiple_of(block) || bytes.len() != out * inp / block * size {
            return Err(candle_core::Error::Msg(format!(
                "{} bytes are no [{out}, {inp}] matrix in {name} blocks of {block} weights",
                bytes.len()
            )));
        }
        let n = bytes.len();
        Ok(Self {
            code,
            data: Tensor::from_vec(bytes, n, device)?,
            out,
            inp,
        })
    }

    /// The format's name (Q4_K, …).
    pub fn name(&self) -> &'static str {
        format(self.code).map_or("?", |f| f.1)
    }

    /// The same blocks on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            data: self.data.to_device(device)?,
            ..self.clone()
        })
    }

    /// The matrix in `dtype`, through bf16 (the CUDA kernel; blocks on the CPU are read on the
    /// GPU only, as every quantized base is).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let Some((code, _, block, size)) = format(self.code) else {
            return Err(candle_core::Error::Msg(format!(
                "ggml type {} is not kept as blocks",
                self.code
            )));
        };
        super::ggml_dequantize(&self.data, (code, block, size), (self.out, self.inp))?
            .to_dtype(dtype)
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.data.elem_count()
    }
}
