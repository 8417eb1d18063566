//! Dropout masks drawn on the GPU (src/engine/dropout.rs's arithmetic).

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{Device, Result, Tensor};

use super::{
    err, flat_cfg, i32_of, kernel_build, ptx_sm90, wrap, MODULE, MODULE_SM75, MODULE_SM90, PTX,
    PTX_SM75,
};

// Dropout masks (src/engine/dropout.rs's arithmetic, drawn on the GPU)

/// The dropout mask (f32: 0 or the keep scale) of a `[rows, cols]` view on `device`, drawn
/// by the GPU: the same values as [`crate::engine::dropout::mask`].
pub fn dropout_mask(
    device: &Device,
    (rows, cols): (usize, usize),
    seed: u64,
    site: u32,
    p: f64,
    layout: crate::engine::dropout::Layout,
) -> Result<Tensor> {
    use crate::engine::dropout;
    let Device::Cuda(dev) = device else {
        return Err(err("dropout_mask: not a CUDA device"));
    };
    let n = rows * cols;
    let thr = dropout::threshold(p);
    let scale = dropout::keep_scale(thr);
    // SAFETY: every element is written by the kernel.
    let out = unsafe { dev.alloc::<f32>(n.max(1))? };
    let f = load_kernel!(&dev, "dropout_mask_f32")?;
    let (r_i, c_i) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
    let attn = i32::from(layout == dropout::Layout::Attention);
    // SAFETY: the arguments match dropout_mask_f32; `out` holds rows·cols f32.
    unsafe {
        launch!(
            f,
            flat_cfg(n),
            [&out, &r_i, &c_i, &seed, &site, &thr, &scale, &attn]
        )
    }
    .w()?;
    Ok(wrap(out, dev, (rows, cols)))
}
