//! CUDA graphs: each micro-batch's forward and backward captured once and replayed.

use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::{
    sys::{CUgraphInstantiate_flags, CUstreamCaptureMode},
    CudaGraph,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::ModelStep;
use crate::engine::kernels::cuda::err;

/// A CUDA graph error, saying what the step was doing with the graph.
fn graph_err(doing: &str, e: candle_core::Error) -> candle_core::Error {
    err(format!("{doing} the micro-batch's CUDA graph: {e}"))
}

/// What selects a captured micro-batch program: whether it is the step's first micro-batch
/// (its weight-gradient matmuls overwrite instead of adding) and whether its rows are packed
/// (attention and RoPE read the sample starts); the arena fixes everything else (the loss
/// scales are read from it).
pub(super) type GraphKey = (bool, bool);

/// CUDA graphs of whole micro-batches (forward and backward, a few hundred launches each),
/// replayed with one launch. A key is captured the second time it runs: the first run is
/// eager, and makes (and tunes) the matmul plans, which needs synchronising.
#[derive(Default)]
pub(super) struct Graphs {
    pub(super) seen: std::collections::HashSet<GraphKey>,
    pub(super) ready: HashMap<GraphKey, CudaGraph>,
}

// SAFETY: a `CudaGraph` holds driver handles that are not thread-safe to use concurrently;
// the graphs live inside the step, which is not Sync and moves to the engine thread whole,
// where it alone launches them.
unsafe impl Send for Graphs {}

impl ModelStep {
    /// The forward and backward of the arena's micro-batch: a replay of its captured graph,
    /// a capture (the key's second run), or eager launches.
    pub(super) fn run_micro(&mut self, first: bool) -> Result<()> {
        let key = (first, self.packed);
        let replay = self.graphs && self.prof.is_none();
        let a = self.arena.as_mut().ok_or_else(|| err("no arena"))?;
        if replay {
            if let Some(graph) = a.graphs.ready.get(&key) {
                return graph.launch().w().map_err(|e| graph_err("replaying", e));
            }
        }
        // (The layout is cloned only off the replay path: `fwd_bwd` borrows the step.)
        let acts = a.acts.clone();
        if !replay || a.graphs.seen.insert(key) {
            return self.fwd_bwd(&acts, first);
        }
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream
            .begin_capture(mode)
            .w()
            .map_err(|e| graph_err("capturing", e))?;
        let run = self.fwd_bwd(&acts, first);
        // End the capture whatever happened, so the stream is usable again.
        let flags = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = self.stream.end_capture(flags);
        run?;
        match graph.w().map_err(|e| graph_err("instantiating", e))? {
            Some(graph) => {
                graph.launch().w().map_err(|e| graph_err("launching", e))?;
                if let Some(a) = self.arena.as_mut() {
                    a.graphs.ready.insert(key, graph);
                }
                Ok(())
            }
            // Nothing was captured: run it eagerly, and keep doing so.
            None => {
                self.graphs = false;
                self.fwd_bwd(&acts, first)
            }
        }
    }

    /// How many micro-batch graphs the current arena holds (for tests and diagnostics).
    pub fn graphs_captured(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.graphs.ready.len())
    }
}
