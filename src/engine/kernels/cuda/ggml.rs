//! ggml's quantized blocks (a GGUF file's Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) dequantized on the GPU.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::bf16;

use super::{
    cuda_of, device_of, err, kernel_build, ptx_sm90, view, wrap, MODULE, MODULE_SM75, MODULE_SM90,
    PTX, PTX_SM75,
};

/// `[rows, cols]` weights of ggml type `code` (blocks of `block` weights in `bytes` bytes, as
/// `data` U8 holds them, row after row) back to bf16 (ggml.cuh's `ggml_dequant_bf16`).
pub fn ggml_dequantize(
    data: &Tensor,
    (code, block, bytes): (u32, usize, usize),
    (rows, cols): (usize, usize),
) -> Result<Tensor> {
    let dev = device_of(data)?;
    let n = rows * cols;
    if data.dtype() != DType::U8
        || !data.is_contiguous()
        || !cols.is_multiple_of(block)
        || !block.is_multiple_of(8)
        || data.elem_count() != n / block * bytes
    {
        return Err(err(format!(
            "ggml_dequantize: {} bytes do not hold [{rows}, {cols}] in blocks of {block} weights, {bytes} bytes each",
            data.elem_count()
        )));
    }
    let (ds, dl) = data.storage_and_layout();
    let src = view::<u8>(cuda_of(&ds)?, dl)?;
    // SAFETY: every element is written by the kernel.
    let out = unsafe { dev.alloc::<bf16>(n)? };
    let (code, block_i, bytes_i, n8) = (code as i32, block as i32, bytes as i32, (n / 8) as i64);
    let f = load_kernel!(&dev, "ggml_dequant_bf16")?;
    let cfg = LaunchConfig {
        grid_dim: ((n / 8).div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel; one thread per 8 weights, all in one block
    // (a row is whole blocks, and a block a multiple of 8 weights).
    unsafe { launch!(f, cfg, [&src, &out, &code, &block_i, &bytes_i, &n8]) }.w()?;
    Ok(wrap(out, &dev, (rows, cols)))
}
