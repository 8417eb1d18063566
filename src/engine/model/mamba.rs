//! The Mamba-2 mixer of a Granite 4.0 hybrid layer (transformers' `GraniteMoeHybridMambaLayer`
//! arithmetic): in_proj → z | x,B,C | dt; a depthwise causal conv1d + SiLU over x,B,C; the
//! selective scan ([`super::ssd`], f32) with per-head A = −exp(A_log), dt = softplus(dt +
//! dt_bias) within its limits and the D skip; the gated RMSNorm; out_proj. Weight names are
//! Hugging Face's (`model.layers.N.mamba.*`).

use super::ssd::{self, ScanIn};
use super::*;
use crate::config::HybridConfig;

/// One Mamba-2 mixer's weights.
#[derive(Clone, Debug)]
pub(super) struct Mamba {
    pub(super) in_proj: Linear,
    /// `[conv channels, 1, d_conv]` (PyTorch's depthwise Conv1d layout).
    pub(super) conv_w: Var,
    pub(super) conv_b: Option<Var>,
    pub(super) dt_bias: Var,
    pub(super) a_log: Var,
    pub(super) d: Var,
    pub(super) norm: Var,
    pub(super) out_proj: Linear,
}

/// A Mamba layer's decoding state: the last `d_conv − 1` conv inputs `[B, d_conv − 1,
/// channels]` and the scan's state `[B, heads, head width, state]`.
pub(super) type MambaState = (Tensor, Tensor);

/// What the mixer reads of its weights besides the projections, as it computes with them: the
/// conv's weight `[channels, d_conv]` and bias in the compute dtype; dt_bias, A_log,
/// A = −exp(A_log), D and the norm's weight in f32. A forward takes them afresh (their
/// gradients flow through); a generation takes them once for all its steps (the weights do not
/// change while it decodes) instead of a dozen casts a layer a step.
#[derive(Clone, Debug)]
pub struct MambaConsts {
    pub(super) conv_w: Tensor,
    pub(super) conv_b: Option<Tensor>,
    pub(super) dt_bias: Tensor,
    pub(super) a_log: Tensor,
    pub(super) a: Tensor,
    pub(super) d: Tensor,
    pub(super) norm: Tensor,
}

impl Mamba {
    /// The mixer of layer prefix `p` (`model.layers.N`), initialised as transformers does
    /// (A = 1..=heads, D = 1, dt_bias = 1, unit norm) with normal projections.
    pub(super) fn new(init: &mut Init, p: &str, s: &ModelSpec, h: &HybridConfig) -> Result<Self> {
        let std = s.init_std;
        let resid_std = std / (2.0 * s.n_layer as f64).sqrt();
        let (inner, conv, nh, k) = (
            h.mamba_inner(),
            h.conv_dim(),
            h.mamba_n_heads,
            h.mamba_d_conv,
        );
        let m = format!("{p}.mamba");
        let in_proj = init.linear(
            &format!("{m}.in_proj"),
            h.in_proj_width(),
            s.n_embd,
            std,
            h.mamba_proj_bias,
        )?;
        let w = init.draw((conv, k), (1.0 / k as f64).sqrt())?;
        let conv_w = init.tensor(
            format!("{m}.conv1d.weight"),
            &w.reshape((conv, 1, k))?,
            ParamKind::Matrix,
        )?;
        let conv_b = if h.mamba_conv_bias {
            Some(init.constant(format!("{m}.conv1d.bias"), conv, 0.0, ParamKind::Bias)?)
        } else {
            None
        };
        let dt_bias = init.constant(format!("{m}.dt_bias"), nh, 1.0, ParamKind::Bias)?;
        let a: Vec<f32> = (1..=nh).map(|i| (i as f32).ln()).collect();
        let a_log = init.tensor(
            format!("{m}.A_log"),
            &Tensor::from_vec(a, nh, init.device)?,
            ParamKind::Bias,
        )?;
        let d = init.constant(format!("{m}.D"), nh, 1.0, ParamKind::Bias)?;
        let norm = init.constant(format!("{m}.norm.weight"), inner, 1.0, ParamKind::Norm)?;
        let out_proj = init.linear(
            &format!("{m}.out_proj"),
            s.n_embd,
            inner,
            resid_std,
            h.mamba_proj_bias,
        )?;
        Ok(Self {
            in_proj,
            conv_w,
            conv_b,
            dt_bias,
            a_log,
            d,
            norm,
            out_proj,
        })
    }
}

impl Model {
    fn hybrid_spec(&self) -> Result<&HybridConfig> {
        self.spec
            .hybrid
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("a Mamba layer outside a hybrid model".into()))
    }

    /// The mixer's output `[B, T, n_embd]` for its normed input `x [B, T, n_embd]`.
    pub(super) fn mamba(&self, m: &Mamba, x: &Tensor) -> Result<Tensor> {
        Ok(self.mamba_mix(m, &self.mamba_consts(m)?, x, None, None)?.0)
    }

    /// [`MambaConsts`] of mixer `m`.
    pub(super) fn mamba_consts(&self, m: &Mamba) -> Result<MambaConsts> {
        let h = self.hybrid_spec()?;
        let (conv, k) = (h.conv_dim(), h.mamba_d_conv);
        let f32v = |v: &Var| v.as_tensor().to_dtype(DType::F32)?.contiguous();
        let a_log = f32v(&m.a_log)?;
        Ok(MambaConsts {
            conv_w: self.cast(&m.conv_w)?.reshape((conv, k))?.contiguous()?,
            conv_b: match &m.conv_b {
                Some(b) => Some(self.cast(b)?.contiguous()?),
                None => None,
            },
            dt_bias: f32v(&m.dt_bias)?,
            a: a_log.exp()?.neg()?,
            a_log,
            d: f32v(&m.d)?,
            norm: f32v(&m.norm)?,
        })
    }

    /// [`Self::mamba`] continuing from a decoding state (none: the sequence's start), and the
    /// state after `x`'s last position. `valid` `[B, T]` (1 or 0, the compute dtype): a left-
    /// padded batch's real columns; a padding column changes no state (its conv input is
    /// zero and its dt 0, so the scan neither decays nor adds), so that each row's state is
    /// the one of its own tokens alone. Its outputs there mean nothing.
    pub(super) fn mamba_mix(
        &self,
        m: &Mamba,
        c: &MambaConsts,
        x: &Tensor,
        state: Option<&MambaState>,
        valid: Option<&Tensor>,
    ) -> Result<(Tensor, MambaState)> {
        let h = self.hybrid_spec()?;
        let (bsz, t, _) = x.dims3()?;
        let (inner, conv, nh, hd) = (
            h.mamba_inner(),
            h.conv_dim(),
            h.mamba_n_heads,
            h.mamba_d_head,
        );
        let (ng, ds, k) = (h.mamba_n_groups, h.mamba_d_state, h.mamba_d_conv);
        let proj = self.linear(&m.in_proj, x)?;
        let z = proj.narrow(2, 0, inner)?;
        let mut xbc = proj.narrow(2, inner, conv)?;
        let dt = proj.narrow(2, inner + conv, nh)?;
        if let Some(v) = valid {
            xbc = xbc.broadcast_mul(&v.unsqueeze(2)?)?;
        }
        // Packed rows (training only: a decoding state continues one sequence): each sample's
        // conv window and scan state start at its first slot.
        let resets = match state {
            None => self.packed_for((bsz, t)).and_then(|p| p.mamba.as_ref()),
            Some(_) => None,
        };
        // Depthwise causal conv: each channel sees its last d_conv inputs (of its own sample).
        let hist = match state {
            Some((prev, _)) => prev.to_dtype(xbc.dtype())?,
            None => Tensor::zeros((bsz, k - 1, conv), xbc.dtype(), x.device())?,
        };
        let full = Tensor::cat(&[&hist, &xbc], 1)?;
        let new_hist = full.narrow(1, t, k - 1)?;
        let w = &c.conv_w;
        // tap j reads the input k − 1 − j slots back
        let tap = |j: usize| -> Result<Tensor> {
            let xj = full.narrow(1, j, t)?;
            match resets {
                Some(r) if j + 1 < k => xj.broadcast_mul(r.conv_tap(k - 1 - j)?),
                _ => Ok(xj),
            }
        };
        let mut y = tap(0)?.broadcast_mul(&w.narrow(1, 0, 1)?.t()?)?;
        for j in 1..k {
            y = (y + tap(j)?.broadcast_mul(&w.narrow(1, j, 1)?.t()?)?)?;
        }
        if let Some(b) = &c.conv_b {
            y = y.broadcast_add(b)?;
        }
        let xbc = candle_nn::ops::silu(&y)?.to_dtype(DType::F32)?;
        let xs = xbc.narrow(2, 0, inner)?.reshape((bsz, t, nh, hd))?;
        let bm = xbc.narrow(2, inner, ng * ds)?.reshape((bsz, t, ng, ds))?;
        let cm = xbc
            .narrow(2, inner + ng * ds, ng * ds)?
            .reshape((bsz, t, ng, ds))?;
        let mut dt = ssd::softplus(&dt.to_dtype(DType::F32)?.broadcast_add(&c.dt_bias)?)?;
        if h.dt_min > 0.0 || h.dt_max.is_some() {
            dt = dt.clamp(h.dt_min, h.dt_max.unwrap_or(f64::MAX))?;
        }
        if let Some(v) = valid {
            dt = dt.broadcast_mul(&v.to_dtype(DType::F32)?.unsqueeze(2)?)?;
        }
        let scan_in = ScanIn {
            x: &xs,
            dt: &dt,
            a: &c.a,
            b: &ssd::spread_groups(&bm, nh)?,
            c: &ssd::spread_groups(&cm, nh)?,
        };
        let (ys, s) = ssd::scan(&scan_in, h.mamba_chunk_size, state.map(|(_, s)| s), resets)?;
        let ys = (ys + xs.broadcast_mul(&c.d.reshape((1, 1, nh, 1))?)?)?;
        let ys = ssd::gated_rms_norm(
            &ys.reshape((bsz, t, inner))?,
            &z.to_dtype(DType::F32)?,
            &c.norm,
            ng,
            self.spec.norm_eps,
        )?
        .to_dtype(self.dtype)?;
        Ok((self.linear(&m.out_proj, &ys)?, (new_hist, s)))
    }
}
