//! Causal softmax: the custom op and its launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::{
    cpu_only, cuda_of, device_of, err, i32_of, kernel_build, ptx_sm90, row_cfg, view, wrap, Elem,
    MODULE, MODULE_SM75, MODULE_SM90, PTX, PTX_SM75,
};

// Causal softmax

struct CausalSoftmax {
    scale: f32,
}

fn softmax_fwd_t<T: Elem>(s: &CudaStorage, l: &Layout, scale: f32) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let dims = l.dims();
    if dims.len() < 2 {
        return Err(err("causal softmax: needs [.., Tq, Tk]"));
    }
    let (tq, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows = l.shape().elem_count() / tk.max(1);
    let x = view::<T>(s, l)?;
    // SAFETY: every element is written by the kernel.
    let y = unsafe { dev.alloc::<T>(rows * tk)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("causal_softmax_fwd"))?;
    let (rows_i, tq_i, tk_i) = (i32_of(rows, "rows")?, i32_of(tq, "Tq")?, i32_of(tk, "Tk")?);
    // SAFETY: argument list matches the kernel signature; buffers hold rows·tk elements.
    unsafe { launch!(f, row_cfg(rows), [&x, &y, &rows_i, &tq_i, &tk_i, &scale]) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        l.shape().clone(),
    ))
}

pub(super) fn softmax_bwd_t<T: Elem>(y: &Tensor, dy: &Tensor, scale: f32) -> Result<Tensor> {
    let dev = device_of(y)?;
    let dims = y.dims().to_vec();
    let (tq, tk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows = y.elem_count() / tk.max(1);
    let (ys, yl) = y.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let yv = view::<T>(cuda_of(&ys)?, yl)?;
    let dv = view::<T>(cuda_of(&ds)?, dl)?;
    // SAFETY: every element is written by the kernel.
    let dx = unsafe { dev.alloc::<T>(rows * tk)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("causal_softmax_bwd"))?;
    let (rows_i, tq_i, tk_i) = (i32_of(rows, "rows")?, i32_of(tq, "Tq")?, i32_of(tk, "Tk")?);
    // SAFETY: as in the forward.
    unsafe {
        launch!(
            f,
            row_cfg(rows),
            [&yv, &dv, &dx, &rows_i, &tq_i, &tk_i, &scale]
        )
    }
    .w()?;
    drop((ys, ds));
    Ok(wrap(dx, &dev, dims))
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "cockpit-causal-softmax"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        by_dtype!(s.dtype(), softmax_fwd_t(s, l, self.scale))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dy = grad_res.contiguous()?;
        let dx = by_dtype!(res.dtype(), softmax_bwd_t(res, &dy, self.scale))?;
        Ok(Some(dx))
    }
}

/// `softmax(scale·att + causal mask)` over the last dim of `att` `[.., Tq, Tk]` (query i sees
/// keys j ≤ i + Tk − Tq); masked probabilities are exactly 0. Differentiable.
pub fn causal_softmax(att: &Tensor, scale: f64) -> Result<Tensor> {
    att.contiguous()?.apply_op1(CausalSoftmax {
        scale: scale as f32,
    })
}
