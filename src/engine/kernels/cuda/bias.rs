//! Bias add, bias + GELU and column sums: the custom ops and their launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::{
    cpu_only, cuda_of, device_of, err, flat_cfg, i32_of, kernel_build, last_dim, ptx_sm90, view,
    wrap, Elem, MODULE, MODULE_SM75, MODULE_SM90, PTX, PTX_SM75,
};

// Bias add, bias + GELU, column sums

fn col_sum_t<T: Elem>(x: &Tensor) -> Result<Tensor> {
    let dev = device_of(x)?;
    let c = *x.dims().last().ok_or_else(|| err("col_sum: scalar"))?;
    let n = x.elem_count() / c.max(1);
    let (xs, xl) = x.storage_and_layout();
    let xv = view::<T>(cuda_of(&xs)?, xl)?;
    let out = dev.alloc_zeros::<f32>(c)?;
    let f = load_kernel!(&dev, &kernel_name::<T>("col_sum"))?;
    let (n_i, c_i) = (i32_of(n, "rows")?, i32_of(c, "cols")?);
    let col_blocks = c.div_ceil(32);
    let row_blocks = (n.div_ceil(64))
        .clamp(1, (1024 / col_blocks).max(4))
        .min(65535);
    let cfg = LaunchConfig {
        grid_dim: (col_blocks as u32, row_blocks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel; out is a zeroed accumulator of length c.
    unsafe { launch!(f, cfg, [&xv, &out, &n_i, &c_i]) }.w()?;
    drop(xs);
    Ok(wrap(out, &dev, c))
}

/// Σ over all leading dims (a bias gradient), in f32.
pub(super) fn col_sum(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    by_dtype!(x.dtype(), col_sum_t(&x))
}

struct BiasAdd;

/// `y = f(x + b)` elementwise with `b` broadcast over the leading dims: `kernel` is the
/// bias kernel's base name (`bias_add`, `bias_gelu_fwd`), `what` names it in errors.
fn bias_map_t<T: Elem>(
    x: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    kernel: &str,
    what: &str,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device();
    let (n, c) = last_dim(x.1)?;
    if b.1.shape().elem_count() != c {
        return Err(err(format!(
            "{what}: bias length differs from the last dim"
        )));
    }
    let xv = view::<T>(x.0, x.1)?;
    let bv = view::<T>(b.0, b.1)?;
    // SAFETY: every element is written by the kernel.
    let y = unsafe { dev.alloc::<T>(n * c)? };
    let f = load_kernel!(&dev, &kernel_name::<T>(kernel))?;
    let (total, c_i) = (n * c, i32_of(c, "cols")?);
    // SAFETY: argument list matches the kernel (x, b, y, total, cols).
    unsafe { launch!(f, flat_cfg(total), [&xv, &bv, &y, &total, &c_i]) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        x.1.shape().clone(),
    ))
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "cockpit-bias-add"
    }
    cpu_only_fwd!(2);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(
            x.dtype(),
            bias_map_t((x, xl), (b, bl), "bias_add", "bias add")
        )
    }
    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = col_sum(grad)?.to_dtype(b.dtype())?;
        Ok((Some(grad.clone()), Some(db)))
    }
}

/// `x + b` with `b` broadcast over the leading dims; the bias gradient is a column sum.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

struct BiasGelu;

fn bias_gelu_bwd_t<T: Elem>(x: &Tensor, b: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dev = device_of(x)?;
    let c = b.elem_count();
    let total = x.elem_count();
    let (xs, xl) = x.storage_and_layout();
    let (bs, bl) = b.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let xv = view::<T>(cuda_of(&xs)?, xl)?;
    let bv = view::<T>(cuda_of(&bs)?, bl)?;
    let dv = view::<T>(cuda_of(&ds)?, dl)?;
    // SAFETY: every element is written by the kernel.
    let dx = unsafe { dev.alloc::<T>(total)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("bias_gelu_bwd"))?;
    let c_i = i32_of(c, "cols")?;
    // SAFETY: argument list matches the kernel.
    unsafe { launch!(f, flat_cfg(total), [&xv, &bv, &dv, &dx, &total, &c_i]) }.w()?;
    drop((xs, bs, ds));
    Ok(wrap(dx, &dev, x.dims()))
}

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "cockpit-bias-gelu"
    }
    cpu_only_fwd!(2);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(
            x.dtype(),
            bias_map_t((x, xl), (b, bl), "bias_gelu_fwd", "bias gelu")
        )
    }
    fn bwd(
        &self,
        x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = grad.contiguous()?;
        let dx = by_dtype!(x.dtype(), bias_gelu_bwd_t(x, b, &dy))?;
        let db = col_sum(&dx)?.to_dtype(b.dtype())?;
        Ok((Some(dx), Some(db)))
    }
}

/// `gelu_tanh(x + b)` (candle's `gelu`), `b` broadcast over the leading dims.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasGelu)
}
