//! What the chunked Mamba-2 scan computes as matrix products, for the chunk products' achieved
//! TFLOP/s that `cockpit bench --profile` reports beside flash attention's.

use super::ModelSpec;
use serde::{Deserialize, Serialize};

/// FLOPs (two a multiply-add) of one launch of each of the step's chunk kernels over one
/// sequence of a hybrid's Mamba layer: the products the state-space-duality scan is made of,
/// counted whole (the causal mask's zeros included, as the kernels compute them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MambaFlops {
    /// A chunk's outputs: its masked, decayed C·Bᵀ times x (L²·P) and C times its start
    /// state (L·S·P), per head.
    pub scan: f64,
    /// A chunk's own contribution to its end state, (dt·x)ᵀ·B (L·P·S), per head.
    pub chunk_state: f64,
    /// C·Bᵀ (L²·S), per group.
    pub cb: f64,
    /// The scan's backward: dM and dx (2·L²·P), dC and dB through dM (2·L²·S), dC through
    /// the state (L·P·S), per head.
    pub scan_bwd: f64,
    /// The state passing's backward: each chunk's share of its start state's gradient,
    /// (exp(lam)·dy)ᵀ·C (L·P·S), per head.
    #[serde(default)]
    pub walk_bwd: f64,
    /// The chunk state's backward: dB and dx (2·L·P·S), per head.
    pub chunk_state_bwd: f64,
}

impl MambaFlops {
    /// Each count × `k` (over `k` sequences: a micro-batch).
    pub fn times(&self, k: f64) -> Self {
        Self {
            scan: self.scan * k,
            chunk_state: self.chunk_state * k,
            cb: self.cb * k,
            scan_bwd: self.scan_bwd * k,
            walk_bwd: self.walk_bwd * k,
            chunk_state_bwd: self.chunk_state_bwd * k,
        }
    }
}

impl ModelSpec {
    /// [`MambaFlops`] over one sequence of `len` positions in chunks of `chunk`; None without
    /// Mamba layers.
    pub fn mamba_flops(&self, len: usize, chunk: usize) -> Option<MambaFlops> {
        let h = self.hybrid.as_ref()?;
        if len == 0 || chunk == 0 || !h.layers.contains(&crate::config::MixerKind::Mamba) {
            return None;
        }
        let chunks = len.div_ceil(chunk) as f64;
        let (l, p, s) = (chunk as f64, h.mamba_d_head as f64, h.mamba_d_state as f64);
        let heads = chunks * h.mamba_n_heads as f64;
        let groups = chunks * h.mamba_n_groups as f64;
        Some(MambaFlops {
            scan: heads * 2.0 * (l * l * p + l * s * p),
            chunk_state: heads * 2.0 * l * p * s,
            cb: groups * 2.0 * l * l * s,
            scan_bwd: heads * 2.0 * (2.0 * l * l * p + 2.0 * l * l * s + l * p * s),
            walk_bwd: heads * 2.0 * l * p * s,
            chunk_state_bwd: heads * 2.0 * 2.0 * l * p * s,
        })
    }
}
