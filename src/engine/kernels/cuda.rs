//! The CUDA side of the fused kernels: launches and the candle custom-op wiring.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{kernel_name, CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout,
    Result, Shape, Storage, Tensor, WithDType,
};
use half::{bf16, f16};

use super::AdamWArgs;

/// The kernels as PTX for compute_80 (bf16 tensor cores, cp.async: the flash kernels and the
/// whole-model step), JIT-compiled by the driver for sm_80 and newer.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels.ptx"));
const MODULE: &str = "cockpit_kernels";
/// The same kernels for compute_75 (T4-class GPUs), without the sm_80 instructions (the flash
/// kernels trap there; nothing launches them without bf16 tensor cores).
const PTX_SM75: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels_sm75.ptx"));
const MODULE_SM75: &str = "cockpit_kernels_sm75";
/// The compute_80 kernels with the step's 16-bit type switched to fp16 (`precision.dtype =
/// "f16"` on the whole-model step); their names keep the `_bf16` suffix.
const PTX_F16: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels_f16.ptx"));
const MODULE_F16: &str = "cockpit_kernels_f16";
/// The compute_75 kernels in fp16: the whole-model step on T4-class GPUs (flash attention's
/// products as m16n8k8 tensor-core instructions, its copies without cp.async).
const PTX_SM75_F16: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels_sm75_f16.ptx"));
const MODULE_SM75_F16: &str = "cockpit_kernels_sm75_f16";
/// The kernels for compute_90a (Hopper; arch-specific PTX, JIT-compiled for compute capability
/// 9.0 only): the compute_80 kernels plus flash attention's backward on wgmma.
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels_sm90.ptx"));
const MODULE_SM90: &str = "cockpit_kernels_sm90";
const PTX_SM90_F16: &str = include_str!(concat!(env!("OUT_DIR"), "/cockpit_kernels_sm90_f16.ptx"));
const MODULE_SM90_F16: &str = "cockpit_kernels_sm90_f16";

/// The Hopper bf16 kernels: the embedded build, or, for kernel work, the PTX file that
/// `COCKPIT_PTX_SM90` names (a variant measured without rebuilding cockpit; read once, and
/// an unreadable file is an error, never a silent fallback).
fn ptx_sm90() -> Result<&'static str> {
    static OVERRIDE: std::sync::OnceLock<std::result::Result<Option<String>, String>> =
        std::sync::OnceLock::new();
    let o = OVERRIDE.get_or_init(|| match std::env::var_os("COCKPIT_PTX_SM90") {
        None => Ok(None),
        Some(path) => std::fs::read_to_string(&path)
            .map(Some)
            .map_err(|e| format!("COCKPIT_PTX_SM90={}: {e}", path.to_string_lossy())),
    });
    match o {
        Ok(Some(ptx)) => Ok(ptx.as_str()),
        Ok(None) => Ok(PTX_SM90),
        Err(e) => Err(err(e.clone())),
    }
}

/// Which build of the kernels this GPU loads: "sm90" (compute capability 9.0), "sm80" (8.0 and
/// newer otherwise) or "sm75"; `COCKPIT_KERNELS=sm80` or `=sm75` forces an older one (to
/// compare, or to test it on a newer GPU).
pub fn kernel_build(dev: &CudaDevice) -> &'static str {
    static FORCED: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("COCKPIT_KERNELS").as_deref() {
        Ok("sm75") => Some("sm75"),
        Ok("sm80") => Some("sm80"),
        _ => None,
    });
    let known = REUSED.with(|r| r.borrow().builds.get(&dev.id()).copied());
    if let Some(b) = known {
        return b;
    }
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let major = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .unwrap_or(8);
    let minor = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .unwrap_or(0);
    let native = match (major, minor) {
        (..=7, _) => "sm75",
        (9, 0) => "sm90",
        _ => "sm80",
    };
    let build = match (forced, native) {
        (Some("sm75"), _) | (_, "sm75") => "sm75",
        (Some(_), _) => "sm80",
        (None, b) => b,
    };
    REUSED.with(|r| r.borrow_mut().builds.insert(dev.id(), build));
    build
}

/// Kernel `name` from this GPU's build of the module (loaded once per device); a macro
/// because candle does not export the type it returns.
macro_rules! load_kernel {
    ($dev:expr, $name:expr) => {
        match kernel_build($dev) {
            "sm75" => $dev.get_or_load_custom_func($name, MODULE_SM75, PTX_SM75),
            "sm90" => $dev.get_or_load_custom_func($name, MODULE_SM90, ptx_sm90()?),
            _ => $dev.get_or_load_custom_func($name, MODULE, PTX),
        }
    };
}

/// [`load_kernel!`] as a cudarc function (for the whole-model step's own launches); `half`
/// takes it from the fp16 build of this GPU's kernels.
pub(super) fn load_function(
    dev: &CudaDevice,
    name: &str,
    half: bool,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaFunction> {
    if half {
        let f = match kernel_build(dev) {
            "sm75" => dev.get_or_load_custom_func(name, MODULE_SM75_F16, PTX_SM75_F16)?,
            "sm90" => dev.get_or_load_custom_func(name, MODULE_SM90_F16, PTX_SM90_F16)?,
            _ => dev.get_or_load_custom_func(name, MODULE_F16, PTX_F16)?,
        };
        return Ok(f.into_cuda_function());
    }
    Ok(load_kernel!(dev, name)?.into_cuda_function())
}

/// Whether flash attention's kernels for head dim `hd` fit this GPU's shared memory per block.
pub(super) fn flash_fits(dev: &CudaDevice, hd: usize) -> bool {
    let (fwd, bwd) = super::spec::flash_smem(hd);
    fwd.max(bwd) as usize <= smem_per_block(dev)
}

/// The most shared memory one block may ask for on this GPU (bytes, opted in).
fn smem_per_block(dev: &CudaDevice) -> usize {
    dev.cuda_stream()
        .context()
        .attribute(
            candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        .map_or(48 * 1024, |b| b.max(0) as usize)
}
/// Threads per block for the row kernels (one warp per row).
const ROW_BLOCK: u32 = 256;
const ROWS_PER_BLOCK: usize = (ROW_BLOCK / 32) as usize;

trait Elem: CudaDType + DeviceRepr + WithDType {}
impl Elem for f32 {}
impl Elem for bf16 {}
impl Elem for f16 {}

pub(super) fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(msg.into())
}

/// Run `$f::<T>(args)` for the tensor dtype's element type.
macro_rules! by_dtype {
    ($dt:expr, $f:ident ( $($a:expr),* $(,)? )) => {
        match $dt {
            DType::F32 => $f::<f32>($($a),*),
            DType::BF16 => $f::<bf16>($($a),*),
            DType::F16 => $f::<f16>($($a),*),
            dt => Err(err(format!("fused kernels take f32, bf16 or f16, not {dt:?}"))),
        }
    };
}

fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    let (o1, o2) = l
        .contiguous_offsets()
        .ok_or_else(|| err("fused kernel: input is not contiguous"))?;
    Ok(s.as_cuda_slice::<T>()?.slice(o1..o2))
}

fn cuda_of(st: &Storage) -> Result<&CudaStorage> {
    match st {
        Storage::Cuda(c) => Ok(c),
        _ => Err(err("fused kernel: tensor is not on a CUDA device")),
    }
}

fn device_of(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => Err(err("fused kernel: tensor is not on a CUDA device")),
    }
}

fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())),
        shape,
        BackpropOp::none(),
        false,
    )
}

pub(super) fn row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn flat_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| err(format!("fused kernel: {what} = {n} exceeds i32")))
}

fn last_dim(l: &Layout) -> Result<(usize, usize)> {
    let dims = l.dims();
    let c = *dims
        .last()
        .ok_or_else(|| err("fused kernel: scalar input"))?;
    if c == 0 {
        return Err(err("fused kernel: empty last dim"));
    }
    Ok((l.shape().elem_count() / c, c))
}

fn cpu_only(name: &str) -> Result<(CpuStorage, Shape)> {
    Err(err(format!(
        "{name}: fused kernel called on the CPU (the model uses the plain path there)"
    )))
}

// ------------------------------------------------------------------------------------------
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
    let mut b = f.builder();
    let (rows_i, tq_i, tk_i) = (i32_of(rows, "rows")?, i32_of(tq, "Tq")?, i32_of(tk, "Tk")?);
    b.arg(&x);
    b.arg(&y);
    b.arg(&rows_i);
    b.arg(&tq_i);
    b.arg(&tk_i);
    b.arg(&scale);
    // SAFETY: argument list matches the kernel signature; buffers hold rows·tk elements.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        l.shape().clone(),
    ))
}

fn softmax_bwd_t<T: Elem>(y: &Tensor, dy: &Tensor, scale: f32) -> Result<Tensor> {
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
    let mut b = f.builder();
    let (rows_i, tq_i, tk_i) = (i32_of(rows, "rows")?, i32_of(tq, "Tq")?, i32_of(tk, "Tk")?);
    b.arg(&yv);
    b.arg(&dv);
    b.arg(&dx);
    b.arg(&rows_i);
    b.arg(&tq_i);
    b.arg(&tk_i);
    b.arg(&scale);
    // SAFETY: as in the forward.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
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

// ------------------------------------------------------------------------------------------
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
    let mut b = f.builder();
    let (n_i, d_i, rms_i) = (i32_of(n, "rows")?, i32_of(d, "dim")?, rms as i32);
    b.arg(&xv);
    b.arg(&wv);
    b.arg(&dv);
    b.arg(&dx);
    b.arg(&dw);
    b.arg(&db);
    b.arg(&n_i);
    b.arg(&d_i);
    b.arg(&eps);
    b.arg(&rms_i);
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
    unsafe { b.launch(cfg) }.w()?;
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
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp3::name(self))
    }
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
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(CustomOp2::name(self))
    }
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

// ------------------------------------------------------------------------------------------
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
    let mut b = f.builder();
    let (n_i, v_i) = (i32_of(n, "rows")?, i32_of(v, "vocab")?);
    b.arg(&xv);
    b.arg(&tv);
    b.arg(&loss);
    b.arg(&n_i);
    b.arg(&v_i);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(loss, dev.clone()),
        Shape::from(n),
    ))
}

fn ce_bwd_t<T: Elem>(x: &Tensor, t: &Tensor, loss: &Tensor, g: &Tensor) -> Result<Tensor> {
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
    let mut b = f.builder();
    let (n_i, v_i) = (i32_of(n, "rows")?, i32_of(v, "vocab")?);
    b.arg(&xv);
    b.arg(&tv);
    b.arg(&lv);
    b.arg(&gv);
    b.arg(&dx);
    b.arg(&n_i);
    b.arg(&v_i);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches the kernel.
    unsafe { b.launch(cfg) }.w()?;
    drop((xs, ts, ls, gs));
    Ok(wrap(dx, &dev, (n, v)))
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cockpit-cross-entropy"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }
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

// ------------------------------------------------------------------------------------------
// Bias add, bias + GELU, column sums

fn col_sum_t<T: Elem>(x: &Tensor) -> Result<Tensor> {
    let dev = device_of(x)?;
    let c = *x.dims().last().ok_or_else(|| err("col_sum: scalar"))?;
    let n = x.elem_count() / c.max(1);
    let (xs, xl) = x.storage_and_layout();
    let xv = view::<T>(cuda_of(&xs)?, xl)?;
    let out = dev.alloc_zeros::<f32>(c)?;
    let f = load_kernel!(&dev, &kernel_name::<T>("col_sum"))?;
    let mut b = f.builder();
    let (n_i, c_i) = (i32_of(n, "rows")?, i32_of(c, "cols")?);
    b.arg(&xv);
    b.arg(&out);
    b.arg(&n_i);
    b.arg(&c_i);
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
    unsafe { b.launch(cfg) }.w()?;
    drop(xs);
    Ok(wrap(out, &dev, c))
}

/// Σ over all leading dims (a bias gradient), in f32.
fn col_sum(x: &Tensor) -> Result<Tensor> {
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
    let mut bld = f.builder();
    let (total, c_i) = (n * c, i32_of(c, "cols")?);
    bld.arg(&xv);
    bld.arg(&bv);
    bld.arg(&y);
    bld.arg(&total);
    bld.arg(&c_i);
    // SAFETY: argument list matches the kernel (x, b, y, total, cols).
    unsafe { bld.launch(flat_cfg(total)) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(y, dev.clone()),
        x.1.shape().clone(),
    ))
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "cockpit-bias-add"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }
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
    let mut bld = f.builder();
    let c_i = i32_of(c, "cols")?;
    bld.arg(&xv);
    bld.arg(&bv);
    bld.arg(&dv);
    bld.arg(&dx);
    bld.arg(&total);
    bld.arg(&c_i);
    // SAFETY: argument list matches the kernel.
    unsafe { bld.launch(flat_cfg(total)) }.w()?;
    drop((xs, bs, ds));
    Ok(wrap(dx, &dev, x.dims()))
}

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "cockpit-bias-gelu"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }
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

// ------------------------------------------------------------------------------------------
// Optimizer

/// Device addresses of contiguous f32 CUDA tensors (the storages stay locked while `f` runs).
pub(super) fn with_f32_ptrs<R>(ts: &[&Tensor], f: impl FnOnce(&[u64]) -> Result<R>) -> Result<R> {
    with_ptrs::<f32, R>(ts, f)
}

/// [`with_f32_ptrs`] for tensors of element type `T`.
pub(super) fn with_ptrs<T: CudaDType, R>(
    ts: &[&Tensor],
    f: impl FnOnce(&[u64]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut ptrs = Vec::with_capacity(ts.len());
    for (st, l) in &guards {
        let c = cuda_of(st)?;
        let v = view::<T>(c, l)?;
        let stream = c.device().cuda_stream();
        let (p, _sync) = v.device_ptr(&stream);
        ptrs.push(p);
    }
    let r = f(&ptrs);
    drop(guards);
    r
}

pub(super) fn multi_grid(max_n: usize, count: usize) -> Result<LaunchConfig> {
    if count > 65_535 {
        return Err(err("multi-tensor kernel: more than 65535 tensors"));
    }
    Ok(LaunchConfig {
        grid_dim: (
            max_n.div_ceil(256 * 8).clamp(1, 1024) as u32,
            count as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Elements per chunk of the multi-tensor kernels (`MT_CHUNK` in kernels.cu).
const MT_CHUNK: usize = 8192;

/// Chunk offsets of tensors of these lengths for the chunked multi-tensor kernels: each
/// tensor's first chunk index, and the total.
fn chunk_offsets(lens: impl Iterator<Item = usize>) -> (Vec<u64>, u64) {
    let mut total = 0u64;
    let offs = lens
        .map(|n| {
            let at = total;
            total += n.div_ceil(MT_CHUNK) as u64;
            at
        })
        .collect();
    (offs, total)
}

/// A fixed grid that strides over `chunks` chunks of 256 threads each.
fn chunk_grid(chunks: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (chunks.clamp(1, 2048) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device buffers that the once-per-step multi-tensor kernels reuse (their pointer tables
/// and the norm's accumulator), per thread and device, so a training step allocates none.
#[derive(Default)]
struct Reused {
    tables: std::collections::HashMap<(candle_core::cuda_backend::DeviceId, Slot), CudaSlice<u64>>,
    accs: std::collections::HashMap<candle_core::cuda_backend::DeviceId, CudaSlice<f32>>,
    /// Each device's kernel build ([`kernel_build`]), asked of the driver once.
    builds: std::collections::HashMap<candle_core::cuda_backend::DeviceId, &'static str>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Slot {
    Sumsq,
    Adamw,
    Copy,
}

thread_local! {
    static REUSED: std::cell::RefCell<Reused> = std::cell::RefCell::new(Reused::default());
}

/// `f` with `host` in `dev`'s reused table `slot` (allocated, or grown, only when too small).
/// The copy is ordered on the device's stream after every earlier use of the table.
fn with_table<R>(
    dev: &CudaDevice,
    slot: Slot,
    host: &[u64],
    f: impl FnOnce(&CudaSlice<u64>) -> Result<R>,
) -> Result<R> {
    let key = (dev.id(), slot);
    let kept = REUSED.with(|r| r.borrow_mut().tables.remove(&key));
    let mut table = match kept {
        Some(t) if t.len() >= host.len() => t,
        // SAFETY: written below before the kernel reads it.
        _ => unsafe { dev.alloc::<u64>(host.len().max(1))? },
    };
    let stream = dev.cuda_stream();
    stream
        .memcpy_htod(host, &mut table.slice_mut(0..host.len()))
        .w()?;
    let r = f(&table);
    REUSED.with(|r| r.borrow_mut().tables.insert(key, table));
    r
}

/// `dev`'s reused one-float accumulator, zeroed on its stream.
fn zeroed_acc(dev: &CudaDevice) -> Result<CudaSlice<f32>> {
    let kept = REUSED.with(|r| r.borrow_mut().accs.remove(&dev.id()));
    match kept {
        Some(mut acc) => {
            dev.cuda_stream().memset_zeros(&mut acc).w()?;
            Ok(acc)
        }
        None => dev.alloc_zeros::<f32>(1),
    }
}

/// Σ‖g‖² over f32 gradients on one CUDA device: ONE chunked multi-tensor kernel over a table
/// of (pointer, length, first chunk), one atomic add per block, one read-back. The table and
/// the accumulator are reused from call to call.
pub fn sumsq(grads: &[Tensor]) -> Result<f64> {
    let Some(first) = grads.first() else {
        return Ok(0.0);
    };
    let dev = device_of(first)?;
    let gs = grads
        .iter()
        .map(|g| g.to_dtype(DType::F32)?.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Tensor> = gs.iter().filter(|g| g.elem_count() > 0).collect();
    if refs.is_empty() {
        return Ok(0.0);
    }
    let acc = zeroed_acc(&dev)?;
    let launched = with_f32_ptrs(&refs, |ptrs| {
        let (offs, chunks) = chunk_offsets(refs.iter().map(|g| g.elem_count()));
        let mut host = Vec::with_capacity(3 * refs.len());
        for ((p, g), c0) in ptrs.iter().zip(&refs).zip(&offs) {
            host.extend([*p, g.elem_count() as u64, *c0]);
        }
        with_table(&dev, Slot::Sumsq, &host, |table| {
            let f = load_kernel!(&dev, "sumsq_chunks_f32")?;
            let mut b = f.builder();
            let nt = i32_of(refs.len(), "tensors")?;
            b.arg(table);
            b.arg(&nt);
            b.arg(&chunks);
            b.arg(&acc);
            // SAFETY: the table holds (pointer, length, first chunk) of live, locked f32
            // buffers, matching the kernel's SqTensor layout, in chunk order; acc is one f32.
            unsafe { b.launch(chunk_grid(chunks)) }.w()?;
            Ok(())
        })
    });
    let host = launched.and_then(|_| dev.clone_dtoh(&acc));
    REUSED.with(|r| r.borrow_mut().accs.insert(dev.id(), acc));
    Ok(host?.first().copied().unwrap_or(0.0) as f64)
}

/// `dst ← src` for pairs of f32 CUDA tensors of one device (each contiguous, a pair of one
/// size): ONE multi-tensor launch over a reused table.
pub fn copy_multi(pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
    let pairs: Vec<&(&Tensor, &Tensor)> =
        pairs.iter().filter(|(s, _)| s.elem_count() > 0).collect();
    let Some(first) = pairs.first() else {
        return Ok(());
    };
    let dev = device_of(first.0)?;
    let mut all = Vec::with_capacity(2 * pairs.len());
    let mut max_n = 0;
    for (src, dst) in &pairs {
        let ok = [src, dst]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.is_contiguous());
        if !ok || src.elem_count() != dst.elem_count() {
            return Err(err("multi-tensor copy: contiguous f32 pairs of one size"));
        }
        all.extend([*src, *dst]);
        max_n = max_n.max(src.elem_count());
    }
    with_f32_ptrs(&all, |p| {
        let mut host = Vec::with_capacity(3 * pairs.len());
        for (i, (src, _)) in pairs.iter().enumerate() {
            host.extend([p[2 * i], p[2 * i + 1], src.elem_count() as u64]);
        }
        with_table(&dev, Slot::Copy, &host, |table| {
            let f = load_kernel!(&dev, "copy_multi_f32")?;
            let mut b = f.builder();
            b.arg(table);
            // SAFETY: the table holds (source, destination, length) of live, locked f32
            // buffers, matching the kernel's MultiItem<float> layout; one grid row per pair.
            unsafe { b.launch(multi_grid(max_n, pairs.len())?) }.w()?;
            Ok(())
        })
    })
}

/// One parameter of a multi-tensor AdamW update.
pub struct AdamItem<'a> {
    pub w: &'a Tensor,
    pub g: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    /// Whether weight decay applies (`AdamWArgs::decay` is its factor).
    pub decay: bool,
    /// Where to write the updated weight in bf16 as well, if anywhere.
    pub copy: Option<super::WeightCopy<'a>>,
}

/// AdamW over many parameters in ONE launch: a chunked multi-tensor kernel, float4 accesses
/// where aligned. Weights and moments are updated in place: contiguous f32, distinct storages.
/// The pointer table is reused from call to call.
pub fn adamw_multi(items: &[AdamItem], a: &AdamWArgs) -> Result<()> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    let dev = device_of(first.w)?;
    let mut gs = Vec::with_capacity(items.len());
    for it in items {
        let n = it.w.elem_count();
        for t in [it.w, it.m, it.v] {
            if t.dtype() != DType::F32 || !t.is_contiguous() || t.elem_count() != n {
                return Err(err(
                    "fused AdamW: weights and moments must be contiguous f32 of one size",
                ));
            }
        }
        if it.g.elem_count() != n {
            return Err(err("fused AdamW: gradient size differs from the weight"));
        }
        gs.push(it.g.to_dtype(DType::F32)?.contiguous()?);
    }
    let mut all: Vec<&Tensor> = Vec::with_capacity(4 * items.len());
    for (it, g) in items.iter().zip(&gs) {
        all.extend([it.w, g, it.m, it.v]);
    }
    with_f32_ptrs(&all, |ptrs| {
        let (offs, chunks) = chunk_offsets(items.iter().map(|it| it.w.elem_count()));
        let mut table = Vec::with_capacity(8 * items.len());
        for ((it, p), c0) in items.iter().zip(ptrs.chunks(4)).zip(&offs) {
            let copy = it.copy.map_or(0, |c| c.addr);
            let aligned = p.iter().all(|a| a % 16 == 0) && copy % 8 == 0;
            let flags = it.decay as u64 | (aligned as u64) << 1 | ((copy != 0) as u64) << 2;
            table.extend_from_slice(p);
            table.extend([copy, it.w.elem_count() as u64, *c0, flags]);
        }
        with_table(&dev, Slot::Adamw, &table, |table| {
            let f = load_kernel!(&dev, "adamw_chunks_f32")?;
            let mut b = f.builder();
            let nt = i32_of(items.len(), "tensors")?;
            let s = [
                a.lr as f32,
                a.beta1 as f32,
                a.beta2 as f32,
                a.eps as f32,
                a.bc1 as f32,
                a.bc2 as f32,
                a.grad_scale as f32,
                a.decay as f32,
            ];
            b.arg(table);
            b.arg(&nt);
            b.arg(&chunks);
            for x in &s {
                b.arg(x);
            }
            // SAFETY: the table matches the kernel's AdamTensor layout (4 f32 pointers, the
            // bf16 copy or null, length, first chunk, flags) in chunk order, and points at
            // live, locked f32 buffers; a bf16 copy lies inside its step's weight buffer,
            // borrowed for 'a.
            unsafe { b.launch(chunk_grid(chunks)) }.w()?;
            Ok(())
        })
    })
}

/// AdamW in place on fp32 `w`, `m`, `v` (contiguous, distinct storages) from gradient `g`.
pub fn adamw_update(w: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, a: &AdamWArgs) -> Result<()> {
    for t in [w, m, v] {
        if t.dtype() != DType::F32 || !t.is_contiguous() || t.elem_count() != w.elem_count() {
            return Err(err(
                "fused AdamW: weights and moments must be contiguous f32 of one size",
            ));
        }
    }
    let dev = device_of(w)?;
    let g = if g.dtype() == DType::F32 {
        g.contiguous()?
    } else {
        g.to_dtype(DType::F32)?
    };
    let n = w.elem_count();
    if g.elem_count() != n {
        return Err(err("fused AdamW: gradient size differs from the weight"));
    }
    let (ws, wl) = w.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let (ms, ml) = m.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let wv = view::<f32>(cuda_of(&ws)?, wl)?;
    let gv = view::<f32>(cuda_of(&gs)?, gl)?;
    let mv = view::<f32>(cuda_of(&ms)?, ml)?;
    let vv = view::<f32>(cuda_of(&vs)?, vl)?;
    let f = load_kernel!(&dev, "adamw_f32")?;
    let mut b = f.builder();
    let s = [
        a.lr as f32,
        a.beta1 as f32,
        a.beta2 as f32,
        a.eps as f32,
        a.decay as f32,
        a.bc1 as f32,
        a.bc2 as f32,
        a.grad_scale as f32,
    ];
    b.arg(&wv);
    b.arg(&gv);
    b.arg(&mv);
    b.arg(&vv);
    b.arg(&n);
    for x in &s {
        b.arg(x);
    }
    // SAFETY: argument list matches the kernel; the four buffers hold n f32 each and the
    // kernel updates w, m, v element-wise in place (the caller guarantees distinct storages).
    unsafe { b.launch(flat_cfg(n)) }.w()?;
    Ok(())
}

/// Σ w² of an f32 CUDA tensor as a differentiable scalar (grid-wide reduction, one kernel).
struct SumSq;

impl CustomOp1 for SumSq {
    fn name(&self) -> &'static str {
        "cockpit-sum-sq"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let v = view::<f32>(s, l)?;
        let n = l.shape().elem_count();
        let acc = dev.alloc_zeros::<f32>(1)?;
        if n > 0 {
            let f = load_kernel!(&dev, "sumsq_f32")?;
            let mut b = f.builder();
            b.arg(&v);
            b.arg(&n);
            b.arg(&acc);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches the kernel; acc is one f32.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(acc, dev.clone()),
            Shape::from(()),
        ))
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.detach().broadcast_mul(&(grad * 2.0)?)?))
    }
}

/// Σ t² (f32 scalar), differentiable: one reduction kernel on CUDA f32, the plain
/// `sqr().sum_all()` elsewhere.
pub fn sum_sq(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() && t.dtype() == DType::F32 {
        t.contiguous()?.apply_op1(SumSq)
    } else {
        t.sqr()?.sum_all()
    }
}

// ------------------------------------------------------------------------------------------
// Fused regions: a block computed outside the autograd graph (on detached tensors, with the
// kernels above and cuBLAS matmuls), attached to the graph as ONE node with a hand-written
// backward. candle's backprop materialises a zero tensor and an add for every graph edge, and
// every reshape/transpose is an edge: collapsing a linear layer or the attention core into one
// node removes most of those full-size adds and copies.

type RegionBwd = dyn Fn(&[Tensor], &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

struct Region {
    name: &'static str,
    y: Tensor,
    bwd: Box<RegionBwd>,
}

fn copy_t<T: Elem>(y: &Tensor) -> Result<(CudaStorage, Shape)> {
    let dev = device_of(y)?;
    let (ys, yl) = y.storage_and_layout();
    let src = view::<T>(cuda_of(&ys)?, yl)?;
    // SAFETY: fully overwritten by the copy below.
    let mut out = unsafe { dev.alloc::<T>(y.elem_count())? };
    dev.memcpy_dtod(&src, &mut out)?;
    drop(ys);
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        y.shape().clone(),
    ))
}

impl Region {
    fn out(&self) -> Result<(CudaStorage, Shape)> {
        by_dtype!(self.y.dtype(), copy_t(&self.y))
    }
    fn grads(&self, args: &[&Tensor], grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let args: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let g = (self.bwd)(&args, &grad.contiguous()?)?;
        if g.len() != args.len() {
            return Err(err(format!(
                "{}: backward returned the wrong arity",
                self.name
            )));
        }
        Ok(g)
    }
}

impl CustomOp1 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name)
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(&self, a: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.grads(&[a], grad)?;
        Ok(g.remove(0))
    }
}

impl CustomOp2 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name)
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Region {
    fn name(&self) -> &'static str {
        self.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_only(self.name)
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

/// Attach `y` (computed from detached `args`) to the graph as one node over `args`.
fn attach(name: &'static str, args: &[&Tensor], y: Tensor, bwd: Box<RegionBwd>) -> Result<Tensor> {
    let y = y.contiguous()?;
    let r = Region { name, y, bwd };
    match args {
        [a] => a.apply_op1(r),
        [a, b] => a.apply_op2(b, r),
        [a, b, c] => a.apply_op3(b, c, r),
        _ => Err(err("fused region: 1 to 3 inputs")),
    }
}

/// `x·Wᵀ (+ b)` over the last dim of `x` `[.., in]` with `W` `[out, in]`, as one graph node:
/// forward one 2-D cuBLAS matmul and the bias kernel; backward `dx = dy·W`, `dW = dyᵀ·x` and
/// `db` by the column-sum kernel. Nothing reshaped or transposed enters the graph.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let x_dims = x.dims().to_vec();
    let rows = x.elem_count() / inp.max(1);
    let mut y_dims = x_dims.clone();
    if let Some(l) = y_dims.last_mut() {
        *l = out;
    }
    let x2 = x.detach().reshape((rows, inp))?;
    let wd = w.detach();
    let mut y = x2.matmul(&wd.t()?)?;
    if let Some(b) = b {
        y = bias_add(&y, &b.detach())?;
    }
    let y = y.reshape(y_dims)?;
    let has_bias = b.is_some();
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let (x, w) = (&args[0], &args[1]);
        let dy2 = dy.reshape((rows, out))?;
        let dx = dy2.matmul(w)?.reshape(x.dims())?;
        let dw = dy2.t()?.matmul(&x.reshape((rows, inp))?)?;
        let mut g = vec![Some(dx), Some(dw)];
        if has_bias {
            g.push(Some(col_sum(&dy2)?.to_dtype(args[2].dtype())?));
        }
        Ok(g)
    });
    match b {
        Some(b) => attach("cockpit-linear", &[x, w, b], y, bwd),
        None => attach("cockpit-linear", &[x, w], y, bwd),
    }
}

fn split_heads_t<T: Elem>(
    qkv: &Tensor,
    (b, t, h, hd): (usize, usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = device_of(qkv)?;
    let n = b * t * h * hd;
    let (qs, ql) = qkv.storage_and_layout();
    let src = view::<T>(cuda_of(&qs)?, ql)?;
    // SAFETY: every element of q, k, v is written by the kernel.
    let (q, k, v) = unsafe { (dev.alloc::<T>(n)?, dev.alloc::<T>(n)?, dev.alloc::<T>(n)?) };
    let f = load_kernel!(&dev, &kernel_name::<T>("qkv_split"))?;
    let mut bld = f.builder();
    let dims = [
        i32_of(b, "B")?,
        i32_of(t, "T")?,
        i32_of(h, "H")?,
        i32_of(hd, "hd")?,
    ];
    bld.arg(&src);
    bld.arg(&q);
    bld.arg(&k);
    bld.arg(&v);
    for d in &dims {
        bld.arg(d);
    }
    // SAFETY: argument list matches the kernel; qkv holds 3·n elements.
    unsafe { bld.launch(flat_cfg(3 * n)) }.w()?;
    drop(qs);
    let shape = (b, h, t, hd);
    Ok((
        wrap(q, &dev, shape),
        wrap(k, &dev, shape),
        wrap(v, &dev, shape),
    ))
}

/// Parts `[B, H, T, hd]` → one `[B, T, parts·H·hd]` buffer (part i at columns i·H·hd..).
fn merge_heads_t<T: Elem>(
    parts: &[&Tensor],
    (b, t, h, hd): (usize, usize, usize, usize),
) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| err("merge_heads: no parts"))?;
    let dev = device_of(first)?;
    let c = h * hd;
    let ld = parts.len() * c;
    // SAFETY: every element is written by one of the launches below.
    let dst = unsafe { dev.alloc::<T>(b * t * ld)? };
    let f = load_kernel!(&dev, &kernel_name::<T>("heads_merge"))?;
    for (i, p) in parts.iter().enumerate() {
        let p = p.contiguous()?;
        if p.dims() != [b, h, t, hd] {
            return Err(err("merge_heads: part shape"));
        }
        let (ps, pl) = p.storage_and_layout();
        let src = view::<T>(cuda_of(&ps)?, pl)?;
        let mut bld = f.builder();
        let args = [
            i32_of(b, "B")?,
            i32_of(t, "T")?,
            i32_of(h, "H")?,
            i32_of(hd, "hd")?,
            i32_of(ld, "ld")?,
            i32_of(i * c, "offset")?,
        ];
        bld.arg(&src);
        bld.arg(&dst);
        for a in &args {
            bld.arg(a);
        }
        // SAFETY: argument list matches the kernel; dst holds B·T·ld elements.
        unsafe { bld.launch(flat_cfg(b * t * c)) }.w()?;
    }
    Ok(wrap(dst, &dev, (b, t, ld)))
}

fn embedding_bwd_t<T: Elem>(ids: &Tensor, dy: &Tensor, vocab: usize) -> Result<Tensor> {
    let dev = device_of(dy)?;
    let d = *dy
        .dims()
        .last()
        .ok_or_else(|| err("embedding: scalar grad"))?;
    let n = dy.elem_count() / d.max(1);
    let (is, il) = ids.storage_and_layout();
    let (ds, dl) = dy.storage_and_layout();
    let iv = view::<u32>(cuda_of(&is)?, il)?;
    let dv = view::<T>(cuda_of(&ds)?, dl)?;
    let dw = dev.alloc_zeros::<f32>(vocab * d)?;
    let f = load_kernel!(&dev, &kernel_name::<T>("embedding_bwd"))?;
    let mut bld = f.builder();
    let args = [
        i32_of(n, "rows")?,
        i32_of(d, "dim")?,
        i32_of(vocab, "vocab")?,
    ];
    bld.arg(&iv);
    bld.arg(&dv);
    bld.arg(&dw);
    for a in &args {
        bld.arg(a);
    }
    // SAFETY: argument list matches the kernel; dw is a zeroed [vocab, d] f32 accumulator.
    unsafe { bld.launch(flat_cfg(n * d)) }.w()?;
    drop((is, ds));
    Ok(wrap(dw, &dev, (vocab, d)))
}

/// Token embedding `w[ids]` (ids u32, any shape) as one graph node; the backward scatters
/// the gradient rows with f32 atomics (no index_add over the vocabulary).
pub fn embedding(ids: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (vocab, d) = w.dims2()?;
    let ids = ids.contiguous()?;
    let mut dims = ids.dims().to_vec();
    dims.push(d);
    let y = w.detach().embedding(&ids.flatten_all()?)?.reshape(dims)?;
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let dw = by_dtype!(dy.dtype(), embedding_bwd_t(&args[0], dy, vocab))?;
        Ok(vec![None, Some(dw.to_dtype(args[1].dtype())?)])
    });
    attach("cockpit-embedding", &[&ids, w], y, bwd)
}

/// Causal self-attention core on packed projections `qkv` `[B, T, 3·H·hd]` (q | k | v) →
/// `[B, T, H·hd]`, as one graph node: scores by a batched cuBLAS matmul, the fused causal
/// softmax kernel, probabilities·v; the backward reuses the saved probabilities
/// (`dS = softmax_bwd(P, dY·Vᵀ)`, `dQ = dS·K`, `dK = dSᵀ·Q`, `dV = Pᵀ·dY`).
pub fn causal_attention_qkv(qkv: &Tensor, n_head: usize, scale: f64) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    if c * 3 != c3 || n_head == 0 || c % n_head != 0 {
        return Err(err("fused attention: qkv width must be 3·H·hd"));
    }
    let hd = c / n_head;
    let dims = (b, t, n_head, hd);
    let x = qkv.detach().contiguous()?;
    let (q, k, v) = by_dtype!(x.dtype(), split_heads_t(&x, dims))?;
    let p = causal_softmax(&q.matmul(&k.t()?)?, scale)?;
    let y = by_dtype!(x.dtype(), merge_heads_t(&[&p.matmul(&v)?], dims))?;
    let scale = scale as f32;
    let bwd: Box<RegionBwd> = Box::new(move |_args, dy| {
        let dyh = dy
            .reshape((b, t, n_head, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let dt = dy.dtype();
        let dp = dyh.matmul(&v.t()?)?;
        let dv = p.t()?.matmul(&dyh)?;
        let ds = by_dtype!(p.dtype(), softmax_bwd_t(&p, &dp, scale))?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        let dqkv = by_dtype!(dt, merge_heads_t(&[&dq, &dk, &dv], dims))?;
        Ok(vec![Some(dqkv)])
    });
    attach("cockpit-attention", &[qkv], y, bwd)
}

/// Per-row cross-entropy (f32 `[N]`) of the logits `x·headᵀ` (`x` `[N, D]`, `head` `[V, D]`)
/// against u32 targets, as ONE graph node: the `[N, V]` logits live only inside it (no
/// gradient accumulation or copy of the logits in the graph); backward: the CE kernel writes
/// dlogits in the compute dtype, then `dx = dlogits·head`, `dhead = dlogitsᵀ·x`.
pub fn lm_head_cross_entropy(x: &Tensor, head: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let t = targets.flatten_all()?.contiguous()?;
    let logits = x.detach().matmul(&head.detach().t()?)?;
    let loss = cross_entropy_rows(&logits, &t)?;
    let saved_loss = loss.clone();
    let bwd: Box<RegionBwd> = Box::new(move |args, dy| {
        let (x, head, t) = (&args[0], &args[1], &args[2]);
        let g = dy.to_dtype(DType::F32)?.contiguous()?;
        let dl = by_dtype!(logits.dtype(), ce_bwd_t(&logits, t, &saved_loss, &g))?;
        let dx = dl.matmul(head)?;
        let dhead = dl.t()?.matmul(x)?;
        Ok(vec![Some(dx), Some(dhead), None])
    });
    attach("cockpit-lm-head-ce", &[x, head, &t], loss, bwd)
}

// ------------------------------------------------------------------------------------------
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
    let mut b = f.builder();
    let (r_i, c_i) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
    let attn = i32::from(layout == dropout::Layout::Attention);
    b.arg(&out);
    b.arg(&r_i);
    b.arg(&c_i);
    b.arg(&seed);
    b.arg(&site);
    b.arg(&thr);
    b.arg(&scale);
    b.arg(&attn);
    // SAFETY: the arguments match dropout_mask_f32; `out` holds rows·cols f32.
    unsafe { b.launch(flat_cfg(n)) }.w()?;
    Ok(wrap(out, dev, (rows, cols)))
}

/// A launch of one thread per item, 256 a block (the NF4 kernels index without a grid-stride
/// loop).
fn per_item_cfg(items: usize, threads_per_item: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((items * threads_per_item).div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// NF4 quantization of a contiguous bf16 matrix (kernels.cu's `nf4_*`; the host reference is
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
    let mut b = f.builder();
    b.arg(&src);
    b.arg(&amax);
    b.arg(&blocks_i);
    // SAFETY: argument list matches the kernel; one warp per 64-element block.
    unsafe { b.launch(per_item_cfg(blocks, 32)) }.w()?;
    let f = load_kernel!(&dev, "nf4_group_f32")?;
    let mut b = f.builder();
    b.arg(&amax);
    b.arg(&absq);
    b.arg(&gscale);
    b.arg(&blocks_i);
    // SAFETY: as above; one warp per group of 256 blocks.
    unsafe { b.launch(per_item_cfg(groups, 32)) }.w()?;
    let f = load_kernel!(&dev, "nf4_codes_bf16")?;
    let mut b = f.builder();
    b.arg(&src);
    b.arg(&absq);
    b.arg(&gscale);
    b.arg(&codes);
    b.arg(&n8);
    // SAFETY: as above; one thread per 8 elements, writing 4 code bytes as one 32-bit word
    // (the allocation is aligned; little-endian: byte i of the word is byte 4·t + i).
    unsafe { b.launch(per_item_cfg(n / 8, 1)) }.w()?;
    Ok((
        wrap(codes, &dev, n / 2),
        wrap(absq, &dev, blocks),
        wrap(gscale, &dev, groups),
    ))
}

/// A matrix in NF4 back to bf16 `[out, inp]` (kernels.cu's `nf4_dequant_bf16`).
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
    let mut b = f.builder();
    b.arg(&codes);
    b.arg(&absq);
    b.arg(&gscale);
    b.arg(&out);
    b.arg(&n8);
    // SAFETY: argument list matches the kernel; the codes are read as 32-bit words, so they
    // must start 4-byte aligned (a whole tensor of their own, as `nf4_quantize` makes them, is);
    // one thread per 8 elements.
    unsafe { b.launch(per_item_cfg(n / 8, 1)) }.w()?;
    Ok(wrap(out, &dev, (rows, cols)))
}

/// The kernel that packs f32 gradients into the bf16 buffer of a data-parallel sum
/// (`to_wire`), or unpacks the summed bf16 buffer into f32 gradients
/// (`distributed.reduce_dtype = "bf16"`); launched by [`wire_launch`].
pub(super) fn wire_kernel(
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
pub(super) fn wire_launch(
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
