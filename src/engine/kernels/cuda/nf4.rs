//! NF4 quantization and dequantization of a frozen LoRA base on the GPU.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};
use half::bf16;

use super::{
    cuda_of, device_of, err, kernel_build, ptx_sm90, view, wrap, MODULE, MODULE_SM75, MODULE_SM90,
    PTX, PTX_SM75,
};

/// A launch of one thread per item, 256 a block (the NF4 kernels index without a grid-stride
/// loop).
fn per_item_cfg(items: usize, threads_per_item: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((items * threads_per_item).div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// NF4 quantization of a contiguous bf16 matrix (nf4.cuh's `nf4_*`; the host reference is
/// `nf4::quantize_host`): (codes U8 [n/2], absq U8 [n/64], gscale F32 [⌈n/64/256⌉]).
/// `(block, group)`: nf4.rs's BLOCK and GROUP (the kernels are written for 64 and 256).
pub fn nf4_quantize(
    w: &Tensor,
    (block, group): (usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    const BLOCK: usize = 64;
    const GROUP: usize = 256;
    if (block, group) != (BLOCK, GROUP) {
        return Err(err(
            "nf4_quantize: the kernels take blocks of 64 in groups of 256",
        ));
    }
    let dev = device_of(w)?;
    let n = w.elem_count();
    if !n.is_multiple_of(BLOCK) || w.dtype() != DType::BF16 {
        return Err(err(
            "nf4_quantize: a bf16 matrix of whole 64-element blocks",
        ));
    }
    let (blocks, groups) = (n / BLOCK, (n / BLOCK).div_ceil(GROUP));
    let (ws, wl) = w.storage_and_layout();
    let src = view::<bf16>(cuda_of(&ws)?, wl)?;
    // SAFETY: every element of each is written by the kernels below before it is read.
    let (amax, absq, gscale, codes) = unsafe {
        (
            dev.alloc::<f32>(blocks)?,
            dev.alloc::<u8>(blocks)?,
            dev.alloc::<f32>(groups)?,
            dev.alloc::<u8>(n / 2)?,
        )
    };
    let (blocks_i, n8) = (blocks as i64, (n / 8) as i64);
    let f = load_kernel!(&dev, "nf4_absmax_bf16")?;
    // SAFETY: argument list matches the kernel; one warp per 64-element block.
    unsafe { launch!(f, per_item_cfg(blocks, 32), [&src, &amax, &blocks_i]) }.w()?;
    let f = load_kernel!(&dev, "nf4_group_f32")?;
    // SAFETY: as above; one warp per group of 256 blocks.
    unsafe {
        launch!(
            f,
            per_item_cfg(groups, 32),
            [&amax, &absq, &gscale, &blocks_i]
        )
    }
    .w()?;
    let f = load_kernel!(&dev, "nf4_codes_bf16")?;
    // SAFETY: as above; one thread per 8 elements, writing 4 code bytes as one 32-bit word
    // (the allocation is aligned; little-endian: byte i of the word is byte 4·t + i).
    unsafe {
        launch!(
            f,
            per_item_cfg(n / 8, 1),
            [&src, &absq, &gscale, &codes, &n8]
        )
    }
    .w()?;
    Ok((
        wrap(codes, &dev, n / 2),
        wrap(absq, &dev, blocks),
        wrap(gscale, &dev, groups),
    ))
}

/// A matrix in NF4 back to bf16 `[out, inp]` (nf4.cuh's `nf4_dequant_bf16`).
/// `parts`: the codes, block maxima and group scales of nf4.rs's `Nf4`.
pub fn nf4_dequantize(
    (codes, absq, gscale): (&Tensor, &Tensor, &Tensor),
    (rows, cols): (usize, usize),
) -> Result<Tensor> {
    let dev = device_of(codes)?;
    let n = rows * cols;
    if codes.elem_count() != n / 2 || !codes.is_contiguous() {
        return Err(err("nf4_dequantize: codes of another shape"));
    }
    let (cs, cl) = codes.storage_and_layout();
    let (asr, al) = absq.storage_and_layout();
    let (gs, gl) = gscale.storage_and_layout();
    let codes = view::<u8>(cuda_of(&cs)?, cl)?;
    let absq = view::<u8>(cuda_of(&asr)?, al)?;
    let gscale = view::<f32>(cuda_of(&gs)?, gl)?;
    // SAFETY: every element is written by the kernel.
    let out = unsafe { dev.alloc::<bf16>(n)? };
    let n8 = (n / 8) as i64;
    let f = load_kernel!(&dev, "nf4_dequant_bf16")?;
    // SAFETY: argument list matches the kernel; the codes are read as 32-bit words, so they
    // must start 4-byte aligned (a whole tensor of their own, as `nf4_quantize` makes them, is);
    // one thread per 8 elements.
    unsafe {
        launch!(
            f,
            per_item_cfg(n / 8, 1),
            [&codes, &absq, &gscale, &out, &n8]
        )
    }
    .w()?;
    Ok(wrap(out, &dev, (rows, cols)))
}
