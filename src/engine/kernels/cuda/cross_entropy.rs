//! Softmax cross-entropy over rows of logits: the custom op and its launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::{
    cpu_only, cuda_of, device_of, err, i32_of, kernel_build, last_dim, ptx_sm90, view, wrap, Elem,
    MODULE, MODULE_SM75, MODULE_SM90, PTX, PTX_SM75,
};

// Softmax cross-entropy

struct CrossEntropy;

fn ce_fwd_t<T: Elem>(
    x: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device();
    let (n, v) = last_dim(x.1)?;
    if t.1.shape().elem_count() != n {
        return Err(err("cross-entropy: targets and logits rows differ"));
    }
    let xv = view::<T>(x.0, x.1)?;
    let tv = view::<u32>(t.0, t.1)?;
    // SAFETY: every row is written by the kernel.
    let loss = unsafe { dev.alloc::<f32>(n)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("ce_fwd"))?;
    let (n_i, v_i) = (i32_of(n, "rows")?, i32_of(v, "vocab")?);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel.
    unsafe { launch!(f, cfg, [&xv, &tv, &loss, &n_i, &v_i]) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(loss, dev.clone()),
        Shape::from(n),
    ))
}

pub(super) fn ce_bwd_t<T: Elem>(
    x: &Tensor,
    t: &Tensor,
    loss: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    let dev = device_of(x)?;
    let (n, v) = x.dims2()?;
    let (xs, xl) = x.storage_and_layout();
    let (ts, tl) = t.storage_and_layout();
    let (ls, ll) = loss.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let xv = view::<T>(cuda_of(&xs)?, xl)?;
    let tv = view::<u32>(cuda_of(&ts)?, tl)?;
    let lv = view::<f32>(cuda_of(&ls)?, ll)?;
    let gv = view::<f32>(cuda_of(&gs)?, gl)?;
    // SAFETY: every element is written by the kernel.
    let dx = unsafe { dev.alloc::<T>(n * v)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("ce_bwd"))?;
    let (n_i, v_i) = (i32_of(n, "rows")?, i32_of(v, "vocab")?);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel.
    unsafe { launch!(f, cfg, [&xv, &tv, &lv, &gv, &dx, &n_i, &v_i]) }.w()?;
    drop((xs, ts, ls, gs));
    Ok(wrap(dx, &dev, (n, v)))
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cockpit-cross-entropy"
    }
    cpu_only_fwd!(2);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if t.dtype() != DType::U32 {
            return Err(err("cross-entropy: targets must be u32"));
        }
        by_dtype!(x.dtype(), ce_fwd_t((x, xl), (t, tl)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let dx = by_dtype!(x.dtype(), ce_bwd_t(x, t, res, &g))?;
        Ok((Some(dx), None))
    }
}

/// Per-row softmax cross-entropy in f32 (`[N]`) of logits `[N, V]` (compute dtype) against
/// u32 targets `[N]`; take `.mean_all()` for the usual mean loss. Differentiable in the logits.
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let t = targets.flatten_all()?.contiguous()?;
    logits.contiguous()?.apply_op2(&t, CrossEntropy)
}
