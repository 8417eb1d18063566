//! Decoding through a hybrid's Mamba layers: no keys and values, a recurrent state instead
//! (the last conv inputs and the scan's state), kept in the layer's cache slot and carried
//! from one block of new positions to the next.

use super::mamba::{Mamba, MambaState};
use super::{Block, Model};
use candle_core::{Result, Tensor};

impl Model {
    /// A Mamba layer's block on `x [B, n, C]` (positions after those `slot` has seen; `valid`:
    /// a left-padded batch's real columns, [`Self::mamba_mix`]); the slot then holds the state
    /// after them.
    pub(super) fn mamba_decode_block(
        &self,
        b: &Block,
        m: &Mamba,
        x: &Tensor,
        slot: &mut Option<MambaState>,
        valid: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = self.block_input(&b.ln1, x)?;
        let (y, (conv, ssm)) = self.mamba_mix(m, &h, slot.as_ref(), valid)?;
        // (Detached, as the attention layers' cache: no op graph across the steps; the conv
        // inputs copied out of the block's whole input, which they would keep alive.)
        *slot = Some((conv.contiguous()?.detach(), ssm.contiguous()?.detach()));
        let x = (x + self.residual(y)?)?;
        let mlp = self.mlp(b, &self.block_input(&b.ln2, &x)?)?;
        x + self.residual(mlp)?
    }
}
