//! The bf16 wire format of the data-parallel gradient sums: packing and unpacking launches.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Result, Tensor};
use half::bf16;

use super::optimizer::with_ptrs;
use super::{device_of, err, load_function};

/// The kernel that packs f32 gradients into the bf16 buffer of a data-parallel sum
/// (`to_wire`), or unpacks the summed bf16 buffer into f32 gradients
/// (`distributed.reduce_dtype = "bf16"`); launched by [`wire_launch`].
pub(in crate::engine::kernels) fn wire_kernel(
    dev: &CudaDevice,
    to_wire: bool,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaFunction> {
    let name = if to_wire {
        "wire_pack_f32_bf16"
    } else {
        "wire_unpack_bf16_f32"
    };
    load_function(dev, name, false)
}

/// [`wire_kernel`]'s `f` over `n` elements from device address `src` to `dst` on `stream`.
pub(in crate::engine::kernels) fn wire_launch(
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    f: &candle_core::cuda_backend::cudarc::driver::CudaFunction,
    src: u64,
    dst: u64,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let mut b = stream.launch_builder(f);
    let n64 = n as u64;
    b.arg(&src);
    b.arg(&dst);
    b.arg(&n64);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(4 * 256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller passes live device buffers of `n` elements of the kernel's types
    // (f32 and bf16), in the order its direction names.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// `dst ← src` between an f32 and a bf16 CUDA tensor of one device (contiguous, one length),
/// on the device's stream: [`wire_launch`] for tensors.
pub fn wire_convert(src: &Tensor, dst: &Tensor) -> Result<()> {
    let n = src.elem_count();
    if n != dst.elem_count() || !src.is_contiguous() || !dst.is_contiguous() {
        return Err(err(
            "bf16 gradient packing: contiguous tensors of one length",
        ));
    }
    let dev = device_of(src)?;
    let to_wire = match (src.dtype(), dst.dtype()) {
        (DType::F32, DType::BF16) => true,
        (DType::BF16, DType::F32) => false,
        (a, b) => {
            return Err(err(format!(
                "bf16 gradient packing converts f32 ↔ bf16, not {a:?} → {b:?}"
            )))
        }
    };
    let f = wire_kernel(&dev, to_wire)?;
    let (wide, narrow) = if to_wire { (src, dst) } else { (dst, src) };
    with_ptrs::<f32, _>(&[wide], |pw| {
        with_ptrs::<bf16, _>(&[narrow], |pn| {
            let (s, d) = if to_wire {
                (pw[0], pn[0])
            } else {
                (pn[0], pw[0])
            };
            wire_launch(&dev.cuda_stream(), &f, s, d, n)
        })
    })
}
