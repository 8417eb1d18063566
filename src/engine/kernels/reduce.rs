//! Data-parallel gradient sums overlapped with the backward (`distributed.overlap`): the
//! whole-model step's fp32 gradients live in one flat buffer, in which each layer's entries
//! sit in two runs (its matrices and adapters in the first part, its norms and biases in the
//! zeroed tail). Buckets of whole layers, from the top of the network down, are summed over
//! the ranks on a communication stream as soon as the backward has queued their last
//! gradient (after the main and side streams' work so far, by events: no host sync); the
//! rest of the buffer (embeddings, head, final norm) follows the backward's end, and the
//! main stream waits for the sums before the optimizer reads them. With
//! `distributed.reduce_dtype = "bf16"` each range is packed into a bf16 buffer on the
//! communication stream, summed there, and widened back into the gradients.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    result as drv,
    sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream},
    CudaFunction, CudaSlice, CudaStream, DevicePtr,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use super::buckets::Bucket;
use super::side::Side;
use crate::distributed::GradSum;

/// The buckets, the communicator and the events that order them.
pub(super) struct Overlap {
    sum: Box<dyn GradSum>,
    comm: CUstream,
    main: Arc<CudaStream>,
    ready: CUevent,
    side_ready: CUevent,
    done: CUevent,
    pub(super) buckets: Vec<Bucket>,
    /// bf16 sums: the buffer they run in (as long as the gradients), and the pack and
    /// unpack kernels.
    wire: Option<Wire>,
}

struct Wire {
    buf: CudaSlice<half::bf16>,
    pack: CudaFunction,
    unpack: CudaFunction,
}

// SAFETY: the events and streams are used from the engine thread only (as the step's).
unsafe impl Send for Overlap {}

impl Overlap {
    /// `bf16`: sums in bf16 over a buffer of `len` elements (the gradient buffer's).
    pub(super) fn new(
        sum: Box<dyn GradSum>,
        dev: &CudaDevice,
        main: &Arc<CudaStream>,
        buckets: Vec<Bucket>,
        bf16: Option<usize>,
    ) -> Result<Self> {
        main.context().bind_to_thread().w()?;
        let event = || drv::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).w();
        let wire = match bf16 {
            Some(len) => Some(Wire {
                buf: sum.stream().alloc_zeros::<half::bf16>(len.max(1)).w()?,
                pack: super::cuda::wire_kernel(dev, true)?,
                unpack: super::cuda::wire_kernel(dev, false)?,
            }),
            None => None,
        };
        Ok(Self {
            wire,
            comm: sum.stream().cu_stream(),
            sum,
            main: main.clone(),
            ready: event()?,
            side_ready: event()?,
            done: event()?,
            buckets,
        })
    }

    fn wait(stream: CUstream, event: CUevent) -> Result<()> {
        unsafe { drv::stream::wait_event(stream, event, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .w()
    }

    /// Enqueue bucket `b`'s sums after everything queued so far on the main stream (and the
    /// side stream, when there is one); `base` is the gradient buffer's address.
    pub(super) fn send(&self, b: &Bucket, base: u64, side: Option<&Side>) -> Result<()> {
        unsafe { drv::event::record(self.ready, self.main.cu_stream()) }.w()?;
        Self::wait(self.comm, self.ready)?;
        if let Some(side) = side {
            side.mark(self.side_ready)?;
            Self::wait(self.comm, self.side_ready)?;
        }
        let comm_err = |e: crate::distributed::CommError| candle_core::Error::Msg(e.to_string());
        let Some(w) = &self.wire else {
            for &(off, len) in &b.ranges {
                self.sum
                    .sum_f32(base + 4 * off as u64, len)
                    .map_err(comm_err)?;
            }
            return Ok(());
        };
        let stream = self.sum.stream();
        let (wbase, _sync) = w.buf.device_ptr(stream);
        for &(off, len) in &b.ranges {
            let (g, h) = (base + 4 * off as u64, wbase + 2 * off as u64);
            super::cuda::wire_launch(stream, &w.pack, g, h, len)?;
            self.sum.sum_bf16(h, len).map_err(comm_err)?;
            super::cuda::wire_launch(stream, &w.unpack, h, g, len)?;
        }
        Ok(())
    }

    /// The main stream waits for every sum enqueued so far.
    pub(super) fn join(&self) -> Result<()> {
        unsafe { drv::event::record(self.done, self.comm) }.w()?;
        Self::wait(self.main.cu_stream(), self.done)
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        let _ = self.main.context().bind_to_thread();
        unsafe {
            let _ = drv::stream::synchronize(self.comm);
            for e in [self.ready, self.side_ready, self.done] {
                if !e.is_null() {
                    let _ = drv::event::destroy(e);
                }
            }
        }
    }
}
