//! Joining one layer's llama.cpp tensors into a fused one (Phi-3's q|k|v and gate|up): a leaf
//! that the names table and the families' modules both use, so neither imports the other.

use candle_core::Tensor;
use std::collections::HashMap;

/// Join layer `i`'s `parts` (llama.cpp names, their rows in this order) into `into`.
pub fn fuse(
    by_name: &mut HashMap<String, Tensor>,
    i: usize,
    parts: &[&str],
    into: &str,
    w: &str,
) -> std::result::Result<(), String> {
    let pieces: Option<Vec<Tensor>> = parts
        .iter()
        .map(|p| by_name.remove(&format!("blk.{i}.{p}.{w}")))
        .collect();
    let Some(pieces) = pieces else {
        return Err(format!(
            "layer {i}: one of {} {w} missing",
            parts.join(", ")
        ));
    };
    let t = Tensor::cat(&pieces, 0).map_err(|e| format!("blk.{i}.{into}.{w}: {e}"))?;
    by_name.insert(format!("blk.{i}.{into}.{w}"), t);
    Ok(())
}
