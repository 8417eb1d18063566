//! A second CUDA stream for the backward's work that nothing on its critical path waits for:
//! the weight-gradient matmuls and the bias column sums. The main stream runs the chain of
//! data gradients (each layer's input gradient needs the one above); a weight gradient only
//! needs its layer's output gradient, and is needed by the optimizer alone. On one stream
//! every matmul's last, partly filled wave leaves multiprocessors idle, and the memory-bound
//! column sums leave the tensor cores idle; on two streams the other stream's kernels fill
//! them.
//!
//! The ordering is explicit and narrow, so the streams stay apart:
//! - [`Side::fork`]: the side stream waits for everything queued on the main stream so far
//!   (the gradient it is about to read is written);
//! - [`Side::release`] after the side stream's reads of a scratch buffer, and
//!   [`Side::reclaim`] before the main stream overwrites it: the main stream waits for those
//!   reads only, not for the side stream's whole queue;
//! - [`Side::join`] at the end of the backward: the main stream waits for all of it (the
//!   optimizer reads the gradients, and a CUDA graph capture must end joined).
//!
//! The stream is created through the driver and wrapped as borrowed, so the context does
//! not switch cudarc into its multi-stream mode (which would record events on every use of
//! every buffer); nothing here passes a tracked buffer to the side stream, only addresses.

use std::cell::Cell;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    result as drv,
    sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream},
    CudaStream,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

/// A scratch gradient buffer of the backward that the side stream reads and the main stream
/// rewrites once per layer.
#[derive(Clone, Copy, Debug)]
pub(super) enum Buf {
    /// The residual stream's gradient (read by the attention-out and MLP-down weight
    /// gradients).
    Dres = 0,
    /// The MLP's hidden gradient (MLP-up weight gradient and bias).
    Dh = 1,
    /// The packed q|k|v gradient (q|k|v weight gradient and bias).
    Dqkv = 2,
    /// With dropout: the residual gradient through a dropout mask (the attention-out and
    /// MLP-down projections' output gradient).
    Dmask = 3,
    /// Gemma's sandwich: a projection's output gradient through its output norm (the
    /// attention-out and MLP-down projections' weight gradients).
    Dpost = 4,
}
const BUFS: usize = 5;

pub(super) struct Side {
    /// `raw`, wrapped for cudarc's launch builder (borrowed: dropping it destroys nothing).
    stream: Arc<CudaStream>,
    raw: CUstream,
    main: Arc<CudaStream>,
    fork: CUevent,
    free: [CUevent; BUFS],
    done: CUevent,
    /// Which of `free` were recorded since the last join (waiting on one recorded before
    /// would be a wait on another pass, and inside a graph capture an error).
    armed: Cell<u8>,
    /// Whether the side stream was forked since the last join (a pass with nothing for it —
    /// LoRA's frozen base — must not join it: inside a capture that would be a dependency on
    /// uncaptured work).
    forked: Cell<bool>,
}

// SAFETY: the stream and events are driver handles, usable from any thread of the context;
// `Side` is not Sync (a Cell) and moves with the step to the engine thread, which alone uses it.
unsafe impl Send for Side {}

impl Side {
    pub(super) fn new(main: &Arc<CudaStream>) -> Result<Self> {
        let ctx = main.context();
        ctx.bind_to_thread().w()?;
        let event = || drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).w();
        let raw = drv::stream::create(drv::stream::StreamKind::NonBlocking).w()?;
        // Built field by field so that a failure part-way destroys what exists (Drop).
        let mut side = Side {
            // SAFETY: `raw` is a live stream of this context, destroyed only in Drop, after
            // the last use of this wrapper (a field of the same struct, not handed out owned).
            stream: unsafe { ctx.wrap_borrowed_stream(raw) },
            raw,
            main: main.clone(),
            fork: std::ptr::null_mut(),
            free: [std::ptr::null_mut(); BUFS],
            done: std::ptr::null_mut(),
            armed: Cell::new(0),
            forked: Cell::new(false),
        };
        side.fork = event()?;
        for f in &mut side.free {
            *f = event()?;
        }
        side.done = event()?;
        Ok(side)
    }

    /// `stream` waits for `event` as last recorded.
    fn wait(stream: CUstream, event: CUevent) -> Result<()> {
        // SAFETY: both handles are live (owned by this struct or the step).
        unsafe { drv::stream::wait_event(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .w()
    }

    fn record(event: CUevent, stream: CUstream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { drv::event::record(event, stream) }.w()
    }

    /// The side stream, after it waits for everything queued on the main stream so far.
    pub(super) fn fork(&self) -> Result<&Arc<CudaStream>> {
        Self::record(self.fork, self.main.cu_stream())?;
        Self::wait(self.raw, self.fork)?;
        self.forked.set(true);
        Ok(&self.stream)
    }

    /// The side stream's reads of `buf` queued so far are what [`Side::reclaim`] waits for.
    pub(super) fn release(&self, buf: Buf) -> Result<()> {
        Self::record(self.free[buf as usize], self.raw)?;
        self.armed.set(self.armed.get() | 1 << buf as u8);
        Ok(())
    }

    /// The main stream waits for the side stream's reads of `buf` (released since the last
    /// join) before it overwrites the buffer.
    pub(super) fn reclaim(&self, buf: Buf) -> Result<()> {
        if self.armed.get() & (1 << buf as u8) != 0 {
            Self::wait(self.main.cu_stream(), self.free[buf as usize])?;
        }
        Ok(())
    }

    /// The main stream waits for everything queued on the side stream.
    /// Record `event` on the side stream: everything queued there so far.
    pub(super) fn mark(&self, event: CUevent) -> Result<()> {
        Self::record(event, self.raw)
    }

    pub(super) fn join(&self) -> Result<()> {
        if self.forked.replace(false) {
            Self::record(self.done, self.raw)?;
            Self::wait(self.main.cu_stream(), self.done)?;
        }
        self.armed.set(0);
        Ok(())
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // Every pass ends joined, so the main stream already orders the side stream's work
        // before anything freed after this; the synchronise is for a pass that failed midway.
        let _ = self.main.context().bind_to_thread();
        // SAFETY: the handles were created in `new` (null where creation failed) and are
        // destroyed once, here; the wrapper in `stream` is borrowed and destroys nothing.
        unsafe {
            for e in std::iter::once(self.fork)
                .chain(self.free)
                .chain(std::iter::once(self.done))
            {
                if !e.is_null() {
                    let _ = drv::event::destroy(e);
                }
            }
            let _ = drv::stream::synchronize(self.raw);
            let _ = drv::stream::destroy(self.raw);
        }
    }
}
