//! Device selection and device facts (compute capability, memory in use).

use crate::util::DeviceSpec;
use candle_core::Device;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("--device {0}: this cockpit was built without CUDA; rebuild with `cargo build --release --features cuda`, or use --device cpu")]
    NoCudaBuild(String),
    #[error("--device cuda:{0}: {1}")]
    Cuda(usize, String),
}

/// The candle device for a request. `Auto` takes CUDA 0 when built in and present, else the CPU.
pub fn open(spec: DeviceSpec) -> Result<Device, DeviceError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Auto => {
            if cfg!(feature = "cuda") {
                Ok(Device::new_cuda(0).unwrap_or(Device::Cpu))
            } else {
                Ok(Device::Cpu)
            }
        }
        DeviceSpec::Cuda(i) => {
            if !cfg!(feature = "cuda") {
                return Err(DeviceError::NoCudaBuild(format!("cuda:{i}")));
            }
            Device::new_cuda(i).map_err(|e| DeviceError::Cuda(i, e.to_string()))
        }
    }
}

/// For a process whose every CUDA op runs on the device's one stream (generation, chat):
/// stop cudarc's per-buffer event tracking. With it on, each allocation — every candle op's
/// output — creates two CUDA events and drops them with the buffer, a few microseconds a
/// launch that a decode step's few hundred small launches pay in full; the events only order
/// buffers between streams, and these processes have one. Affects buffers allocated after
/// the call. `COCKPIT_EVENT_TRACKING=1` keeps it on (to compare).
pub fn single_stream(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        if std::env::var("COCKPIT_EVENT_TRACKING").as_deref() != Ok("1") {
            // SAFETY: the caller runs every op on this device's default stream: no buffer is
            // used by two streams, which is all the events order.
            unsafe { d.disable_event_tracking() };
        }
    }
    let _ = device;
}

/// CUDA devices this process can see (after CUDA_VISIBLE_DEVICES): 0 without a CUDA build,
/// a driver or a device.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::result;
        // (The driver library is linked: with the driver missing this build does not start.)
        if result::init().is_err() {
            return 0;
        }
        result::device::get_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// A human label: "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)".
pub fn describe(device: &Device) -> String {
    match device {
        Device::Cpu => format!("cpu ({} threads)", candle_core::utils::get_num_threads()),
        _ => {
            #[cfg(feature = "cuda")]
            if let Some(name) = cuda::name(device) {
                return format!("cuda:{} ({name})", cuda::ordinal(device));
            }
            "cuda".to_string()
        }
    }
}

/// Compute capability of a CUDA device, None on CPU.
pub fn compute_capability(device: &Device) -> Option<(u32, u32)> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cuda::compute_capability(device);
    }
    let _ = device;
    None
}

/// Whether `e` is an allocation that failed for want of memory (CUDA's, or the host's).
pub fn is_out_of_memory(e: &candle_core::Error) -> bool {
    let s = e.to_string().to_ascii_lowercase();
    s.contains("out of memory") || s.contains("out_of_memory")
}

/// Bytes of memory in use: device memory in use on CUDA (whole device), this process's RSS on CPU.
pub fn memory_in_use(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cuda::memory_in_use(device);
    }
    let _ = device;
    rss_bytes()
}

/// Memory free for this process's tensors: the device's free memory on a GPU, the host's
/// available memory (Linux /proc/meminfo) on the CPU; None when unknown.
pub fn memory_free(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return cuda::memory_free(device);
    }
    let _ = device;
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident set size of this process (Linux /proc), None elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(0) as u64)
}

/// Peak dense FLOP/s for the dtype on known GPUs (for MFU); None when unknown.
pub fn peak_flops(name: &str, dtype: candle_core::DType) -> Option<f64> {
    let half = matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16);
    let n = name.to_ascii_uppercase();
    let (tc, fp32) = if n.contains("H200")
        || n.contains("H100") && n.contains("SXM")
        || n.contains("H100 80GB HBM3")
    {
        (989e12, 67e12)
    } else if n.contains("H100") {
        (756e12, 51e12)
    } else if n.contains("A100") {
        (312e12, 19.5e12)
    } else if n.contains("L40S") {
        (362e12, 91.6e12)
    } else if n.contains("A10") {
        (125e12, 31.2e12)
    } else if n.contains("4090") {
        (165e12, 82.6e12)
    } else if n.contains("V100") {
        (125e12, 15.7e12)
    } else {
        return None;
    };
    Some(if half { tc } else { fp32 })
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    use candle_core::Device;

    fn dev(device: &Device) -> Option<&candle_core::CudaDevice> {
        match device {
            Device::Cuda(d) => Some(d),
            _ => None,
        }
    }

    pub fn ordinal(device: &Device) -> usize {
        dev(device)
            .map(|d| d.cuda_stream().context().ordinal())
            .unwrap_or(0)
    }

    pub fn name(device: &Device) -> Option<String> {
        dev(device)?.cuda_stream().context().name().ok()
    }

    pub fn compute_capability(device: &Device) -> Option<(u32, u32)> {
        let ctx = dev(device)?.cuda_stream().context().clone();
        let maj = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .ok()?;
        let min = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .ok()?;
        Some((maj as u32, min as u32))
    }

    pub fn memory_in_use(device: &Device) -> Option<u64> {
        let ctx = dev(device)?.cuda_stream().context().clone();
        let (free, total) = ctx.mem_get_info().ok()?;
        Some((total - free) as u64)
    }

    pub fn memory_free(device: &Device) -> Option<u64> {
        let ctx = dev(device)?.cuda_stream().context().clone();
        let (free, _) = ctx.mem_get_info().ok()?;
        Some(free as u64)
    }
}
