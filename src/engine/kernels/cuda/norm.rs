//! LayerNorm / RMSNorm: the custom ops and their launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{kernel_name, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};

use super::{
    cpu_only, cuda_of, device_of, err, i32_of, kernel_build, last_dim, ptx_sm90, row_cfg, view,
    wrap, Elem, MODULE, MODULE_SM75, MODULE_SM90, PTX, PTX_SM75, ROWS_PER_BLOCK, ROW_BLOCK,
};

// LayerNorm / RMSNorm

struct Norm {
    eps: f32,
    rms: bool,
}

fn norm_fwd_t<T: Elem>(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    rms: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.0.device();
    let (n, d) = last_dim(x.1)?;
    if w.1.shape().elem_count() != d || b.is_some_and(|b| b.1.shape().elem_count() != d) {
        return Err(err("norm: weight/bias length differs from the last dim"));
    }
    let xv = view::<T>(x.0, x.1)?;
    let wv = view::<T>(w.0, w.1)?;
    let bv = match b {
        Some((s, l)) => Some(view::<T>(s, l)?),
        None => None,
    };
    // SAFETY: every element is written by the kernel.
    let y = unsafe { dev.alloc::<T>(n * d)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("norm_fwd"))?;
    let mut bld = f.builder();
    let null = 0u64;
    let (n_i, d_i, rms_i) = (i32_of(n, "rows")?, i32_of(d, "dim")?, rms as i32);
    bld.arg(&xv);
    bld.arg(&wv);
    match &bv {
        Some(v) => bld.arg(v),
        None => bld.arg(&null),
    };
    bld.arg(&y);
    bld.arg(&n_i);
    bld.arg(&d_i);
    bld.arg(&eps);
    bld.arg(&rms_i);
    // SAFETY: argument list matches the kernel; a null bias pointer means no bias.
    unsafe { bld.launch(row_cfg(n)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        x.1.shape().clone(),
    ))
}

/// (dx, dw f32, db f32)
fn norm_bwd_t<T: Elem>(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f32,
    rms: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = device_of(x)?;
    let d = w.elem_count();
    let n = x.elem_count() / d.max(1);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let xv = view::<T>(cuda_of(&xs)?, xl)?;
    let wv = view::<T>(cuda_of(&ws)?, wl)?;
    let dv = view::<T>(cuda_of(&ds)?, dl)?;
    // SAFETY: every element is written by the kernel.
    let dx = unsafe { dev.alloc::<T>(n * d)? };
    let dw = dev.alloc_zeros::<f32>(d)?;
    let db = dev.alloc_zeros::<f32>(d)?;
    let f = load_kernel!(&dev, &kernel_name::<T>("norm_bwd"))?;
    let (n_i, d_i, rms_i) = (i32_of(n, "rows")?, i32_of(d, "dim")?, rms as i32);
    let shared = (2 * d * std::mem::size_of::<f32>()) as u32;
    if shared > 48 * 1024 {
        return Err(err(
            "norm backward: dim too large for the shared-memory accumulators",
        ));
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(ROWS_PER_BLOCK).clamp(1, 264) as u32, 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: shared,
    };
    // SAFETY: argument list matches the kernel; dw/db are zeroed accumulators of length d.
    unsafe {
        launch!(
            f,
            cfg,
            [&xv, &wv, &dv, &dx, &dw, &db, &n_i, &d_i, &eps, &rms_i]
        )
    }
    .w()?;
    drop((xs, ws, ds));
    Ok((
        wrap(dx, &dev, x.dims()),
        wrap(dw, &dev, d),
        wrap(db, &dev, d),
    ))
}

impl CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        "cockpit-layer-norm"
    }
    cpu_only_fwd!(3);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(
            x.dtype(),
            norm_fwd_t((x, xl), (w, wl), Some((b, bl)), self.eps, self.rms)
        )
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = grad.contiguous()?;
        let (dx, dw, db) = by_dtype!(x.dtype(), norm_bwd_t(x, w, &dy, self.eps, self.rms))?;
        Ok((
            Some(dx),
            Some(dw.to_dtype(w.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ))
    }
}

impl CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        "cockpit-rms-norm"
    }
    cpu_only_fwd!(2);
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        by_dtype!(
            x.dtype(),
            norm_fwd_t((x, xl), (w, wl), None, self.eps, self.rms)
        )
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = grad.contiguous()?;
        let (dx, dw, _) = by_dtype!(x.dtype(), norm_bwd_t(x, w, &dy, self.eps, self.rms))?;
        Ok((Some(dx), Some(dw.to_dtype(w.dtype())?)))
    }
}

/// LayerNorm over the last dim: `(x − mean)/√(var + eps)·w + b`, f32 statistics.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &b.contiguous()?,
        Norm {
            eps: eps as f32,
            rms: false,
        },
    )
}

/// RMSNorm over the last dim: `x/√(mean(x²) + eps)·w`, f32 statistics.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(
        &w.contiguous()?,
        Norm {
            eps: eps as f32,
            rms: true,
        },
    )
}
