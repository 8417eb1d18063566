//! Decoding through a hybrid's Mamba layers: no keys and values, a recurrent state instead
//! (the last conv inputs and the scan's state), kept in the layer's cache slot and carried
//! from one block of new positions to the next.

use super::decode_batch::decode_ops;
use super::mamba::{Mamba, MambaConsts, MambaState};
use super::{Block, Model};
use crate::engine::kernels::{self, MambaDecode};
use candle_core::{DType, Result, Tensor};

impl Model {
    /// A Mamba layer's block on `x [B, n, C]` (positions after those `slot` has seen; `valid`:
    /// a left-padded batch's real columns, [`Self::mamba_mix`]); the slot then holds the state
    /// after them — in its own tensors, written over, where `in_place` (a step captured in a
    /// CUDA graph reads and writes the same buffers at every step).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mamba_decode_block(
        &self,
        b: &Block,
        m: &Mamba,
        c: &MambaConsts,
        x: &Tensor,
        slot: &mut Option<MambaState>,
        valid: Option<&Tensor>,
        in_place: bool,
    ) -> Result<Tensor> {
        let h = self.block_input(&b.ln1, x)?;
        let (y, (conv, ssm)) = match self.mamba_step_kernel(m, c, &h, slot.as_ref(), valid)? {
            Some(step) => step,
            None => self.mamba_mix(m, c, &h, slot.as_ref(), valid)?,
        };
        // (Detached, as the attention layers' cache: no op graph across the steps; the conv
        // inputs copied out of the block's whole input, which they would keep alive.)
        match slot {
            Some((c, s)) if in_place => {
                c.slice_set(&conv.contiguous()?, 0, 0)?;
                s.slice_set(&ssm.contiguous()?, 0, 0)?;
            }
            _ if in_place => candle_core::bail!("decode_batch: no Mamba state to write over"),
            _ => *slot = Some((conv.contiguous()?.detach(), ssm.contiguous()?.detach())),
        }
        let x = (x + self.residual(y)?)?;
        let mlp = self.mlp(b, &self.block_input(&b.ln2, &x)?)?;
        x + self.residual(mlp)?
    }

    /// A hybrid's Mamba layer sizes as [`kernels::mamba_decode`] takes them; None for a model
    /// without Mamba layers.
    pub(super) fn mamba_decode_sizes(&self) -> Option<MambaDecode> {
        let hs = self.spec.hybrid.as_ref()?;
        Some(MambaDecode {
            heads: hs.mamba_n_heads,
            head_dim: hs.mamba_d_head,
            state: hs.mamba_d_state,
            groups: hs.mamba_n_groups,
            conv_k: hs.mamba_d_conv,
            dt_limits: (hs.dt_min > 0.0 || hs.dt_max.is_some())
                .then(|| (hs.dt_min as f32, hs.dt_max.map_or(f32::MAX, |v| v as f32))),
            eps: self.spec.norm_eps as f32,
        })
    }

    /// [`Self::mamba_mix`] for one new position of every row, in two CUDA launches from
    /// in_proj's output to the gated norm's ([`kernels::mamba_decode`]); None where that does
    /// not apply (not CUDA, several positions or padding columns, `COCKPIT_DECODE=ops`, sizes
    /// the kernel does not take), and the ops run.
    fn mamba_step_kernel(
        &self,
        m: &Mamba,
        c: &MambaConsts,
        x: &Tensor,
        state: Option<&MambaState>,
        valid: Option<&Tensor>,
    ) -> Result<Option<(Tensor, MambaState)>> {
        let (Some(hs), Some(d)) = (self.spec.hybrid.as_ref(), self.mamba_decode_sizes()) else {
            return Ok(None);
        };
        let (bsz, t, _) = x.dims3()?;
        if t != 1
            || valid.is_some()
            || !kernels::usable(x)
            || decode_ops()
            || !kernels::mamba_decode_takes(&d)
        {
            return Ok(None);
        }
        let (inner, conv, k) = (hs.mamba_inner(), hs.conv_dim(), d.conv_k);
        let proj = self.linear(&m.in_proj, x)?;
        let proj = proj.reshape((bsz, proj.dim(2)?))?.contiguous()?;
        let (hist, ssm) = match state {
            Some((c, s)) => (
                c.to_dtype(proj.dtype())?.contiguous()?,
                s.to_dtype(DType::F32)?.contiguous()?,
            ),
            None => (
                Tensor::zeros((bsz, k - 1, conv), proj.dtype(), x.device())?,
                Tensor::zeros((bsz, d.heads, d.head_dim, d.state), DType::F32, x.device())?,
            ),
        };
        let (y, hist, ssm) = kernels::mamba_decode(
            &proj,
            &hist,
            &c.conv_w,
            c.conv_b.as_ref(),
            &c.dt_bias,
            &c.a_log,
            &c.d,
            &c.norm,
            &ssm,
            &d,
        )?;
        let out = self.linear(&m.out_proj, &y.reshape((bsz, 1, inner))?)?;
        Ok(Some((out, (hist, ssm))))
    }
}
