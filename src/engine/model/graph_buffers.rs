//! The buffers of a batch's decode steps replayed from a CUDA graph, and the graph
//! ([`super::decode_graph`] captures and launches it; the batch's cache holds it).

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::Tensor;

/// A batch's decode-step buffers and its captured step.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DecodeGraph {
    /// `[B, 1]` (u32): the ids the step feeds.
    pub(super) ids: Tensor,
    /// `[2]` (u32): the new column and the columns filled after it.
    pub(super) at: Tensor,
    /// The step's logits `[B, vocab]` and final hidden states `[B, n_embd]` (f32), from the
    /// first step on.
    pub(super) out: Option<(Tensor, Tensor)>,
    #[cfg(feature = "cuda")]
    pub(super) exec: Option<Exec>,
}

/// A captured step and the device whose graph memory it holds: dropping it hands that
/// memory back (a generation during training leaves the step's memory plan as it was).
#[cfg(feature = "cuda")]
pub(super) struct Exec {
    pub(super) graph: Option<CudaGraph>,
    pub(super) device: sys::CUdevice,
    /// The stream it launches on.
    pub(super) stream: std::sync::Arc<CudaStream>,
}

#[cfg(feature = "cuda")]
impl Exec {
    /// One replay of the step, on its stream.
    pub(super) fn launch(&self) -> candle_core::Result<()> {
        use candle_core::cuda_backend::WrapErr;
        match &self.graph {
            Some(g) => g.launch().w(),
            None => candle_core::bail!("decode graph: launched after it was destroyed"),
        }
    }
}

#[cfg(feature = "cuda")]
impl Drop for Exec {
    fn drop(&mut self) {
        // (Its last launch done before it is destroyed: a generation's last step is launched
        // just before the batch's cache, which holds it, is dropped.)
        let _ = self.stream.synchronize();
        drop(self.graph.take());
        // SAFETY: a device handle of a live context; trimming only releases graph
        // memory no graph holds.
        let _ = unsafe { sys::cuDeviceGraphMemTrim(self.device) };
    }
}
