//! `model.recompute = "offload"`: the backward recomputes whole blocks as with "full", and the
//! blocks' inputs — the one activation per layer that "full" keeps, `[N, C]` each — live in
//! pinned host memory instead of on the device.
//!
//! The device keeps two residual slots: block `l` reads its input from slot `l % 2` and writes
//! the next block's into the other. A copy stream moves them:
//! - forward: as soon as block `l`'s input is written, the copy stream copies it to the host
//!   while the block runs; block `l + 1` waits for that copy before it overwrites the slot
//!   (a whole block of compute hides it);
//! - backward: when block `l`'s backward starts, the slot of block `l + 1` (done with) is
//!   refilled from the host with block `l − 1`'s input, which block `l − 1` waits for.
//!
//! The top two blocks' inputs never leave the device (they are still in their slots when the
//! backward starts), so the device holds 2 residuals instead of L and the host L − 2.
//! Every wait is on an event recorded earlier in the same pass and the pass ends with the
//! main stream waiting for the copy stream's last load, so a pass captures into a CUDA graph
//! (the copies become its memcpy nodes) and nothing is left queued behind the step's back.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::{
    result as drv,
    sys::{self, CUevent, CUevent_flags, CUevent_wait_flags, CUstream},
    CudaStream,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use crate::engine::kernels::cuda::err;

pub(super) struct Offload {
    /// The copy stream (created here, destroyed in Drop).
    copy: CUstream,
    main: CUstream,
    /// Pinned host memory: the inputs of blocks `0..stored`, `bytes` each.
    host: *mut c_void,
    bytes: usize,
    stored: usize,
    /// Main → copy: what the next copy reads (or overwrites) is final.
    ready: CUevent,
    /// Per slot: its content's copy to the host is done (the slot may be overwritten).
    out: [CUevent; 2],
    /// Per slot: its content is back from the host.
    back: [CUevent; 2],
}

// SAFETY: driver handles and pinned memory, usable from any thread of the context; the
// offload lives in the step's arena, which moves to the engine thread whole and is used there
// alone.
unsafe impl Send for Offload {}

impl Offload {
    /// The copy stream, its events and pinned host memory for the inputs of blocks
    /// `0..stored`, `bytes` each (`main`: the step's stream, whose context is current).
    pub(super) fn new(main: &CudaStream, stored: usize, bytes: usize) -> Result<Self> {
        main.context().bind_to_thread().w()?;
        let event = || drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).w();
        let mut o = Offload {
            copy: std::ptr::null_mut(),
            main: main.cu_stream(),
            host: std::ptr::null_mut(),
            bytes,
            stored,
            ready: std::ptr::null_mut(),
            out: [std::ptr::null_mut(); 2],
            back: [std::ptr::null_mut(); 2],
        };
        // (Built field by field: a failure part-way destroys what exists, in Drop.)
        o.copy = drv::stream::create(drv::stream::StreamKind::NonBlocking).w()?;
        o.ready = event()?;
        for e in o.out.iter_mut().chain(o.back.iter_mut()) {
            *e = event()?;
        }
        let total = stored * bytes;
        // SAFETY: a plain pinned allocation, freed in Drop; every byte is written (by a
        // block's copy out) before it is read back.
        o.host = unsafe { drv::malloc_host(total, 0) }.map_err(|e| {
            err(format!(
                "model.recompute = \"offload\": pinning {:.2} GB of host memory for {stored} \
                 blocks' inputs: {e}",
                total as f64 / 1e9
            ))
        })?;
        Ok(o)
    }

    /// Whether block `l`'s input goes to the host.
    fn kept_on_host(&self, l: usize) -> bool {
        l < self.stored
    }

    fn record(event: CUevent, stream: CUstream) -> Result<()> {
        // SAFETY: both handles are live (owned here, or the step's stream).
        unsafe { drv::event::record(event, stream) }.w()
    }

    fn wait(stream: CUstream, event: CUevent) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { drv::stream::wait_event(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .w()
    }

    /// Forward: block `l`'s input was just written (queued on the main stream) at `slot`:
    /// copy it to the host behind the compute.
    pub(super) fn store(&self, l: usize, slot: u64) -> Result<()> {
        if !self.kept_on_host(l) {
            return Ok(());
        }
        Self::record(self.ready, self.main)?;
        Self::wait(self.copy, self.ready)?;
        // SAFETY: `slot` holds `bytes` on the device (an arena slot) and the host range is
        // inside the pinned allocation; the main stream waits for `out` before it rewrites
        // the slot, and the allocation outlives every queued copy (Drop synchronises).
        unsafe {
            let dst = self.host.cast::<u8>().add(l * self.bytes).cast::<c_void>();
            sys::cuMemcpyDtoHAsync_v2(dst, slot, self.bytes, self.copy).result()
        }
        .w()?;
        Self::record(self.out[l % 2], self.copy)
    }

    /// Forward, before block `l` writes block `l + 1`'s input into the slot that held block
    /// `l − 1`'s: the main stream waits for that input's copy to the host.
    pub(super) fn before_block(&self, l: usize) -> Result<()> {
        match l.checked_sub(1) {
            Some(prev) if self.kept_on_host(prev) => Self::wait(self.main, self.out[prev % 2]),
            _ => Ok(()),
        }
    }

    /// Backward, as block `l`'s starts: its input is back (the main stream waits for it), and
    /// block `l − 1`'s is fetched into its slot (`slot_below`: the one block `l + 1` read,
    /// whose backward is queued before this) while block `l`'s backward runs.
    pub(super) fn backward_block(&self, l: usize, slot_below: u64) -> Result<()> {
        if self.kept_on_host(l) {
            Self::wait(self.main, self.back[l % 2])?;
        }
        let Some(below) = l.checked_sub(1).filter(|&b| self.kept_on_host(b)) else {
            return Ok(());
        };
        Self::record(self.ready, self.main)?;
        Self::wait(self.copy, self.ready)?;
        // SAFETY: as in `store`; the host range was written by this pass's forward (the
        // copy stream runs its copies in order), and the main stream waits for `back`
        // before block `below` reads the slot.
        unsafe {
            let src = self
                .host
                .cast::<u8>()
                .add(below * self.bytes)
                .cast::<c_void>();
            sys::cuMemcpyHtoDAsync_v2(slot_below, src, self.bytes, self.copy).result()
        }
        .w()?;
        Self::record(self.back[below % 2], self.copy)
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        // SAFETY: the handles were created in `new` (null where creation failed) and are
        // destroyed once, here, after the copy stream has finished with the host memory.
        unsafe {
            if !self.copy.is_null() {
                let _ = drv::stream::synchronize(self.copy);
            }
            for e in std::iter::once(self.ready).chain(self.out).chain(self.back) {
                if !e.is_null() {
                    let _ = drv::event::destroy(e);
                }
            }
            if !self.host.is_null() {
                let _ = drv::free_host(self.host);
            }
            if !self.copy.is_null() {
                let _ = drv::stream::destroy(self.copy);
            }
        }
    }
}
