//! The CUDA side of the fused kernels: launches and the candle custom-op wiring.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use half::{bf16, f16};

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

// The kernel families, each with its custom ops and launches (declared after the macros
// above, which they use).
/// Launch kernel `f` on `cfg` with `args` pushed in order (then each element of `rest`, where
/// given): `unsafe { launch!(f, cfg, [&a, &b], &scalars) }.w()?`. The caller's `unsafe`
/// (with its SAFETY note) vouches that the arguments match the kernel's parameter list.
macro_rules! launch {
    ($f:expr, $cfg:expr, [$($arg:expr),* $(,)?] $(, $rest:expr)?) => {{
        let mut b = $f.builder();
        $(b.arg($arg);)*
        $(for x in $rest {
            b.arg(x);
        })?
        b.launch($cfg)
    }};
}

/// A custom op's `cpu_fwd` for a fused kernel that has no CPU side (the model uses the plain
/// path there): an error naming the op. The argument is the op's arity (1, 2 or 3 inputs).
macro_rules! cpu_only_fwd {
    (1) => {
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu_only(candle_core::CustomOp1::name(self))
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_only(candle_core::CustomOp2::name(self))
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_only(candle_core::CustomOp3::name(self))
        }
    };
}

mod bias;
mod cross_entropy;
mod decode_attention;
mod dropout;
mod ggml;
mod mamba_decode;
mod nf4;
mod norm;
mod optimizer;
mod region;
mod sampling;
mod softmax;
mod wire;

pub use self::bias::*;
pub use self::cross_entropy::*;
pub use self::decode_attention::*;
pub use self::dropout::*;
pub use self::ggml::*;
pub use self::mamba_decode::*;
pub use self::nf4::*;
pub use self::norm::*;
use self::optimizer::REUSED;
pub use self::optimizer::*;
pub use self::region::*;
pub use self::sampling::*;
pub use self::softmax::*;
pub use self::wire::*;

pub(super) fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    let (o1, o2) = l
        .contiguous_offsets()
        .ok_or_else(|| err("fused kernel: input is not contiguous"))?;
    Ok(s.as_cuda_slice::<T>()?.slice(o1..o2))
}

pub(super) fn cuda_of(st: &Storage) -> Result<&CudaStorage> {
    match st {
        Storage::Cuda(c) => Ok(c),
        _ => Err(err("fused kernel: tensor is not on a CUDA device")),
    }
}

pub(super) fn device_of(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => Err(err("fused kernel: tensor is not on a CUDA device")),
    }
}

pub(super) fn wrap<T: CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
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
