//! The optimizer's launches: multi-tensor tables, the global gradient norm, fused AdamW,
//! weight copies.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor,
};

use super::{
    cpu_only, cuda_of, device_of, err, flat_cfg, i32_of, kernel_build, ptx_sm90, view, MODULE,
    MODULE_SM75, MODULE_SM90, PTX, PTX_SM75,
};
use crate::engine::kernels::AdamWArgs;

// Optimizer

/// Device addresses of contiguous f32 CUDA tensors (the storages stay locked while `f` runs).
pub(in crate::engine::kernels) fn with_f32_ptrs<R>(
    ts: &[&Tensor],
    f: impl FnOnce(&[u64]) -> Result<R>,
) -> Result<R> {
    with_ptrs::<f32, R>(ts, f)
}

/// [`with_f32_ptrs`] for tensors of element type `T`.
pub(in crate::engine::kernels) fn with_ptrs<T: CudaDType, R>(
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

pub(in crate::engine::kernels) fn multi_grid(max_n: usize, count: usize) -> Result<LaunchConfig> {
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

/// Elements per chunk of the multi-tensor kernels (`MT_CHUNK` in optimizer.cuh).
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
pub(super) struct Reused {
    tables: std::collections::HashMap<(candle_core::cuda_backend::DeviceId, Slot), CudaSlice<u64>>,
    accs: std::collections::HashMap<candle_core::cuda_backend::DeviceId, CudaSlice<f32>>,
    /// Each device's kernel build ([`kernel_build`]), asked of the driver once.
    pub(super) builds: std::collections::HashMap<candle_core::cuda_backend::DeviceId, &'static str>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Slot {
    Sumsq,
    Adamw,
    Copy,
}

thread_local! {
    pub(super) static REUSED: std::cell::RefCell<Reused> = std::cell::RefCell::new(Reused::default());
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
            let nt = i32_of(refs.len(), "tensors")?;
            // SAFETY: the table holds (pointer, length, first chunk) of live, locked f32
            // buffers, matching the kernel's SqTensor layout, in chunk order; acc is one f32.
            unsafe { launch!(f, chunk_grid(chunks), [table, &nt, &chunks, &acc]) }.w()?;
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
            // SAFETY: the table holds (source, destination, length) of live, locked f32
            // buffers, matching the kernel's MultiItem<float> layout; one grid row per pair.
            unsafe { launch!(f, multi_grid(max_n, pairs.len())?, [table]) }.w()?;
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
    pub copy: Option<crate::engine::kernels::WeightCopy<'a>>,
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
            // SAFETY: the table matches the kernel's AdamTensor layout (4 f32 pointers, the
            // bf16 copy or null, length, first chunk, flags) in chunk order, and points at
            // live, locked f32 buffers; a bf16 copy lies inside its step's weight buffer,
            // borrowed for 'a.
            unsafe { launch!(f, chunk_grid(chunks), [table, &nt, &chunks], &s) }.w()?;
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
    // SAFETY: argument list matches the kernel; the four buffers hold n f32 each and the
    // kernel updates w, m, v element-wise in place (the caller guarantees distinct storages).
    unsafe { launch!(f, flat_cfg(n), [&wv, &gv, &mv, &vv, &n], &s) }.w()?;
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
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 1024) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches the kernel; acc is one f32.
            unsafe { launch!(f, cfg, [&v, &n, &acc]) }.w()?;
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
