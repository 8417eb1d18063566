//! CUDA graphs for a batch's decode steps. A decode step is a few hundred small launches,
//! each paid for on the host; a graph captures them once and replays them in one launch.
//!
//! A graph replays its launches with the arguments they were captured with, so the step it
//! captures ([`Cols::Device`]) reads what changes from step to step from buffers of its own:
//! the ids fed (`ids`), the new column and the columns after it (`at`); it writes the logits
//! and final hidden states to buffers of its own, the keys and values and the Mamba states in
//! place. The first step after the prompt runs that arithmetic without a graph (it loads
//! every kernel the capture records, and is checked like any other step), the second is
//! captured and launched, every later one is launched again.
//!
//! The ordinary steps run where a graph does not apply: off CUDA; with cudarc's event
//! tracking on (a training process's eval samples: a capture cannot wait on events recorded
//! outside it); routed experts (their routing reads the router's choices on the host); a
//! layer the decode kernels do not take; `COCKPIT_DECODE=ops`; `COCKPIT_DECODE_GRAPH=0` (to
//! compare). A capture that fails (nothing has run then) leaves the batch on the ordinary
//! steps, with a warning in the log.

use super::cache::{BatchCache, LayerState};
use super::decode_batch::{Cols, StepOut};
use super::graph_buffers::DecodeGraph;
use super::Model;
use candle_core::{Result, Tensor};

/// Whether `COCKPIT_DECODE_GRAPH=0` asks for decode steps without CUDA graphs; read once.
fn graphs_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("COCKPIT_DECODE_GRAPH").as_deref() == Ok("0"))
}

impl BatchCache {
    /// Decode this batch's steps without a CUDA graph (to compare).
    pub fn no_graph(&mut self) {
        self.graph = None;
        self.graph_off = true;
    }

    /// Why this batch's decode steps are not replayed from a CUDA graph where one applied: its
    /// capture's error.
    pub fn graph_error(&self) -> Option<&str> {
        self.graph_error.as_deref()
    }

    /// Whether this batch's decode steps are replayed from a CUDA graph.
    pub fn graphed(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.graph {
            return g.exec.is_some();
        }
        false
    }
}

impl Model {
    /// One new column of every row through the batch's CUDA graph ([`Self::decode_batch`]'s
    /// arithmetic); None where a graph does not apply, and the ordinary step runs.
    pub(super) fn decode_step_graphed(
        &self,
        ids: &Tensor,
        cache: &mut BatchCache,
        logits: bool,
    ) -> Result<Option<StepOut>> {
        if cache.graph_off {
            return Ok(None);
        }
        if !self.graph_applies(cache) {
            cache.graph_off = true;
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        return self.graph_step(ids, cache, logits);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ids, logits);
            Ok(None)
        }
    }

    /// Whether this model's decode steps may be captured (the module's list).
    fn graph_applies(&self, cache: &BatchCache) -> bool {
        let cuda = match &self.device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => !d
                .cuda_stream()
                .context()
                .is_managing_stream_synchronization(),
            _ => false,
        };
        let mamba_ok = self.spec.hybrid.is_none()
            || self
                .mamba_decode_sizes()
                .is_some_and(|d| crate::engine::kernels::mamba_decode_takes(&d));
        let states_ok = cache.layers.iter().all(|l| match l {
            LayerState::Kv { .. } => true,
            LayerState::Mamba { state, consts } => state.is_some() && consts.is_some(),
        });
        cuda && !graphs_off()
            && cache.filled > 0
            && self.blocks.iter().all(|b| b.moe.is_none())
            && self.decode_kernel_takes(&cache.pad_mask)
            && mamba_ok
            && states_ok
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// The captured step's arithmetic: the buffers' ids at the buffers' column, the logits and
    /// hidden states written to the buffers. Every tensor it makes is dropped before it
    /// returns (a capture must free what it allocates).
    fn graph_body(&self, g: &DecodeGraph, cache: &mut BatchCache) -> Result<()> {
        let Some((logits, hidden)) = &g.out else {
            candle_core::bail!("decode graph: no output buffers before its first step");
        };
        let out = self.decode_cols(&g.ids, cache, true, Cols::Device(&g.at))?;
        let Some(l) = out.logits else {
            candle_core::bail!("decode graph: the step gave no logits");
        };
        logits.slice_set(&l.contiguous()?, 0, 0)?;
        hidden.slice_set(&out.hidden.contiguous()?, 0, 0)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::graph_buffers::Exec;
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::DType;

    impl Model {
        pub(super) fn graph_step(
            &self,
            ids: &Tensor,
            cache: &mut BatchCache,
            logits: bool,
        ) -> Result<Option<StepOut>> {
            let start = cache.filled;
            let mut g = match cache.graph.take() {
                Some(g) => g,
                None => Box::new(self.graph_buffers(cache)?),
            };
            let (b, _) = ids.dims2()?;
            g.ids
                .slice_set(&ids.to_dtype(DType::U32)?.contiguous()?, 0, 0)?;
            let col = u32::try_from(start)
                .map_err(|_| candle_core::Error::Msg(format!("decode column {start}")))?;
            g.at.slice_set(&Tensor::new(&[col, col + 1], &self.device)?, 0, 0)?;
            match (&g.exec, &g.out) {
                (Some(exec), _) => exec.launch()?,
                (None, Some(_)) => match self.capture(&g, cache) {
                    Ok(exec) => {
                        exec.launch()?;
                        g.exec = Some(exec);
                    }
                    Err(e) => {
                        tracing::warn!(
                            "decode steps without a CUDA graph: its capture failed ({e})"
                        );
                        cache.graph_error = Some(e.to_string());
                        cache.graph_off = true;
                        return Ok(None);
                    }
                },
                (None, None) => {
                    // (The host data it uploads — candle's layouts of strided operands — kept
                    // on the device, for the capture to copy from.)
                    let _uploads = self.cuda()?.enable_cuda_graph_htod_cache();
                    let out = self.decode_cols(&g.ids, cache, true, Cols::Device(&g.at))?;
                    let Some(l) = out.logits else {
                        candle_core::bail!("decode graph: the step gave no logits");
                    };
                    g.out = Some((l.contiguous()?.copy()?, out.hidden.contiguous()?.copy()?));
                }
            }
            cache.filled = start + 1;
            let Some((l, h)) = &g.out else {
                candle_core::bail!("decode graph: no output after a step");
            };
            debug_assert_eq!(h.dim(0)?, b);
            // (Copies: the buffers are written over by the next step.)
            let step = StepOut {
                logits: if logits { Some(l.copy()?) } else { None },
                hidden: h.copy()?,
            };
            cache.graph = Some(g);
            Ok(Some(step))
        }

        fn cuda(&self) -> Result<&candle_core::CudaDevice> {
            match &self.device {
                candle_core::Device::Cuda(d) => Ok(d),
                _ => candle_core::bail!("decode graph: not a CUDA device"),
            }
        }

        /// The buffers of a batch's step; its Mamba states copied into tensors of their own,
        /// in the dtypes the step writes (the step writes over them in place).
        fn graph_buffers(&self, cache: &mut BatchCache) -> Result<DecodeGraph> {
            for l in cache.layers.iter_mut() {
                if let LayerState::Mamba {
                    state: Some((conv, ssm)),
                    ..
                } = l
                {
                    *conv = conv.to_dtype(self.dtype)?.copy()?;
                    *ssm = ssm.to_dtype(DType::F32)?.copy()?;
                }
            }
            Ok(DecodeGraph {
                ids: Tensor::zeros((cache.batch(), 1), DType::U32, &self.device)?,
                at: Tensor::zeros(2, DType::U32, &self.device)?,
                out: None,
                exec: None,
            })
        }

        /// [`Model::graph_body`] captured on the device's stream (nothing runs), instantiated.
        fn capture(&self, g: &DecodeGraph, cache: &mut BatchCache) -> Result<Exec> {
            let stream = self.cuda()?.cuda_stream();
            // A capture records a host-to-device copy as a copy from the host address, which
            // would be read again at every launch, long after it was freed: candle's layouts
            // of strided operands come instead from the device copies the first step cached
            // (an upload it did not cache fails the capture).
            let _uploads = self.cuda()?.enable_cuda_graph_htod_cache();
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .w()?;
            let body = self.graph_body(g, cache);
            // (Ended whatever the body gave: a stream left capturing runs nothing.)
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            body?;
            let graph = graph
                .w()?
                .ok_or_else(|| candle_core::Error::Msg("decode graph: nothing captured".into()))?;
            Ok(Exec {
                graph: Some(graph),
                device: stream.context().cu_device(),
                stream,
            })
        }
    }
}
