//! The Mamba-2 selective state-space scan in f32, chunked (state-space duality): within a
//! chunk the outputs are a masked, decayed `C·Bᵀ` applied to `dt·x` (matmuls); between chunks
//! the state `[heads, head width, state]` is carried with its decay. Exact: the chunk length
//! changes only the rounding, and a sequence that is not a multiple of it is padded with
//! `dt = 0` (no decay, no input), which leaves the outputs and the final state as they are.

use candle_core::{DType, Result, Tensor, D};

/// The scan's inputs (all f32): `x [B, T, heads, hd]`, `dt [B, T, heads]` (after softplus and
/// the limits), `a [heads]` (negative), `b` and `c` `[B, T, heads, state]` (groups already
/// spread over their heads).
pub(super) struct ScanIn<'a> {
    pub x: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
}

/// `y [B, T, heads, hd]` (without the D skip) and the state after the last position
/// `[B, heads, hd, state]`, starting from `s0` (zeros when None). `resets` (packed rows): the
/// state starts again at zero at each sample's first position — no position reads another
/// sample's inputs (the final state is the last sample's).
pub(super) fn scan(
    i: &ScanIn,
    chunk: usize,
    s0: Option<&Tensor>,
    resets: Option<&SampleResets>,
) -> Result<(Tensor, Tensor)> {
    let (bsz, t, nh, hd) = i.x.dims4()?;
    if t == 1 {
        return step(i, s0);
    }
    let ds = i.b.dim(3)?;
    let l = chunk.min(t).max(1);
    let nc = t.div_ceil(l);
    let pad = nc * l - t;
    let dev = i.x.device();
    let padded = |z: &Tensor| -> Result<Tensor> {
        if pad == 0 {
            Ok(z.clone())
        } else {
            z.pad_with_zeros(1, 0, pad)
        }
    };
    // [B, T', heads, w] → [B, heads, chunks, L, w].
    let heads_major = |z: &Tensor, w: usize| -> Result<Tensor> {
        padded(z)?
            .reshape((bsz, nc, l, nh, w))?
            .permute((0, 3, 1, 2, 4))?
            .contiguous()
    };
    let xc = heads_major(i.x, hd)?;
    let bc = heads_major(i.b, ds)?;
    let cc = heads_major(i.c, ds)?;
    let dtc = padded(i.dt)?
        .reshape((bsz, nc, l, nh))?
        .permute((0, 3, 1, 2))?
        .contiguous()?;
    let acum = dtc.broadcast_mul(&i.a.reshape((1, nh, 1, 1))?)?.cumsum(3)?;
    // Within a chunk: position l reads source s ≤ l with decay exp(acum_l − acum_s).
    let causal: Vec<f32> = (0..l * l)
        .map(|k| {
            if k % l > k / l {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let causal = Tensor::from_vec(causal, (l, l), dev)?;
    if let Some(r) = resets {
        if r.within.dims() != [bsz, 1, nc, l, l] {
            candle_core::bail!("packed rows' scan masks are for another shape than this scan's");
        }
    }
    let mut decay = acum
        .unsqueeze(4)?
        .broadcast_sub(&acum.unsqueeze(3)?)?
        .broadcast_add(&causal)?;
    if let Some(r) = resets {
        decay = decay.broadcast_add(&r.within)?;
    }
    let decay = decay.exp()?;
    let xdt = xc.broadcast_mul(&dtc.unsqueeze(4)?)?;
    let scores = bmm(&cc, &bc.t()?)?;
    let y_diag = bmm(&(scores * decay)?, &xdt)?;
    // Each chunk's own contribution to the state at its end.
    let last = acum.narrow(3, l - 1, 1)?;
    let mut to_end = last.broadcast_sub(&acum)?.exp()?;
    let mut chunk_decay = last.squeeze(3)?.exp()?;
    if let Some(r) = resets {
        to_end = to_end.broadcast_mul(&r.to_end)?;
        chunk_decay = chunk_decay.broadcast_mul(&r.carry)?;
    }
    let states = bmm(&xdt.broadcast_mul(&to_end.unsqueeze(4)?)?.t()?, &bc)?;
    let mut s = match s0 {
        Some(s) => s.to_dtype(DType::F32)?,
        None => Tensor::zeros((bsz, nh, hd, ds), DType::F32, dev)?,
    };
    let mut at_start = Vec::with_capacity(nc);
    for ci in 0..nc {
        at_start.push(s.clone());
        let k = chunk_decay.narrow(2, ci, 1)?.unsqueeze(3)?;
        s = (s.broadcast_mul(&k)? + states.narrow(2, ci, 1)?.squeeze(2)?)?;
    }
    let at_start = Tensor::stack(&at_start, 2)?;
    let mut from_start = acum.exp()?;
    if let Some(r) = resets {
        from_start = from_start.broadcast_mul(&r.from_start)?;
    }
    let y_off = bmm(&cc, &at_start.t()?)?.broadcast_mul(&from_start.unsqueeze(4)?)?;
    let y = (y_diag + y_off)?
        .permute((0, 2, 3, 1, 4))?
        .reshape((bsz, nc * l, nh, hd))?
        .narrow(1, 0, t)?;
    Ok((y, s))
}

/// Where packed samples stop a Mamba layer (built once a batch, [`Model::set_segments`], from
/// each slot's sample start in its row; positions past T continue the last sample). The scan's
/// masks over its chunks (`[B, 1, chunks, ..]`): `within` adds −∞ to the decay from position j
/// to position i of a chunk where they are in different samples; `to_end` keeps position j's
/// input in its chunk's end state only where j is in the sample of the chunk's last position;
/// `carry` keeps the state from before a chunk past its end only where no sample starts inside
/// it; `from_start` keeps that state in position i's output only where no sample starts between
/// the chunk's start and i. The conv's: `taps[b − 1]` `[B, T, 1]` (the compute dtype), 1 where
/// the slot b positions back is in the same sample.
#[derive(Clone, Debug)]
pub struct SampleResets {
    within: Tensor,
    to_end: Tensor,
    carry: Tensor,
    from_start: Tensor,
    taps: Vec<Tensor>,
}

impl SampleResets {
    /// For rows of `t` slots whose sample starts are `starts` (`[B·T]`), a scan in chunks of
    /// `chunk` (as [`scan`] takes it) and a conv of `d_conv` taps.
    pub(super) fn new(
        starts: &[usize],
        bsz: usize,
        t: usize,
        chunk: usize,
        d_conv: usize,
        dtype: DType,
        dev: &candle_core::Device,
    ) -> Result<Self> {
        let l = chunk.min(t).max(1);
        let nc = t.div_ceil(l);
        let tp = nc * l;
        let start = |b: usize, p: usize| starts[b * t + p.min(t - 1)];
        let (mut within, mut to_end) = (vec![0f32; bsz * tp * l], vec![0f32; bsz * tp]);
        let (mut carry, mut from_start) = (vec![0f32; bsz * nc], vec![0f32; bsz * tp]);
        for b in 0..bsz {
            for c in 0..nc {
                let (first, last) = (c * l, c * l + l - 1);
                // (the first chunk's incoming state is s0: zeros for packed rows)
                carry[b * nc + c] = f32::from(u8::from(c == 0 || start(b, last) < first));
                for i in 0..l {
                    let pi = first + i;
                    to_end[b * tp + pi] = f32::from(u8::from(pi >= start(b, last)));
                    from_start[b * tp + pi] = f32::from(u8::from(c == 0 || start(b, pi) < first));
                    for j in 0..l {
                        if first + j < start(b, pi) {
                            within[(b * tp + pi) * l + j] = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        let taps = (1..d_conv)
            .map(|back| {
                let m: Vec<f32> = (0..bsz * t)
                    .map(|i| f32::from(u8::from(i % t >= back && i % t - back >= starts[i])))
                    .collect();
                Tensor::from_vec(m, (bsz, t, 1), dev)?.to_dtype(dtype)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            within: Tensor::from_vec(within, (bsz, 1, nc, l, l), dev)?,
            to_end: Tensor::from_vec(to_end, (bsz, 1, nc, l), dev)?,
            carry: Tensor::from_vec(carry, (bsz, 1, nc), dev)?,
            from_start: Tensor::from_vec(from_start, (bsz, 1, nc, l), dev)?,
            taps,
        })
    }

    /// The conv's mask for the tap `back` slots before each slot (1 ≤ back < d_conv).
    pub(super) fn conv_tap(&self, back: usize) -> Result<&Tensor> {
        self.taps
            .get(back.wrapping_sub(1))
            .ok_or_else(|| candle_core::Error::Msg(format!("no conv mask {back} slots back")))
    }
}

/// One position after the state `s0` (a decode step): the recurrence itself, `s = exp(dt·a)·s0 +
/// dt·x⊗b`, `y = s·c` — what the chunked form computes for T = 1, in a handful of kernels
/// instead of the chunk's masks, cumulative sums and batched products.
fn step(i: &ScanIn, s0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (bsz, _, nh, hd) = i.x.dims4()?;
    let ds = i.b.dim(3)?;
    let dt = i.dt.reshape((bsz, nh, 1, 1))?;
    let input =
        i.x.reshape((bsz, nh, hd, 1))?
            .broadcast_mul(&dt)?
            .broadcast_mul(&i.b.reshape((bsz, nh, 1, ds))?)?;
    let s = match s0 {
        Some(s0) => {
            let decay = dt.broadcast_mul(&i.a.reshape((1, nh, 1, 1))?)?.exp()?;
            (s0.to_dtype(DType::F32)?.broadcast_mul(&decay)? + input)?
        }
        None => input,
    };
    let y = s.matmul(&i.c.reshape((bsz, nh, ds, 1))?.contiguous()?)?;
    Ok((y.reshape((bsz, 1, nh, hd))?, s))
}

/// A matmul over the last two dims of 5-D tensors with the same leading dims (candle's
/// batched matmul takes at most one batch dim beyond the first).
fn bmm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let d = a.dims().to_vec();
    let (m, n) = (d[d.len() - 2], b.dim(D::Minus1)?);
    let lead: usize = d[..d.len() - 2].iter().product();
    let k = d[d.len() - 1];
    let y = a
        .contiguous()?
        .reshape((lead, m, k))?
        .matmul(&b.contiguous()?.reshape((lead, k, n))?)?;
    let mut out = d[..d.len() - 2].to_vec();
    out.extend([m, n]);
    y.reshape(out)
}

/// `log(1 + exp(x))`, written so that neither branch overflows.
pub(super) fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// Each of `groups` rows of `z [B, T, groups, w]` serves `heads / groups` heads:
/// `[B, T, heads, w]`.
pub(super) fn spread_groups(z: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, g, w) = z.dims4()?;
    if g == heads {
        return Ok(z.clone());
    }
    z.unsqueeze(3)?
        .expand((b, t, g, heads / g, w))?
        .reshape((b, t, heads, w))
}

/// The gated RMSNorm of Mamba-2's output: `y·silu(z)`, normalised over each of `groups`
/// equal slices of the last dim, times `w`.
pub(super) fn gated_rms_norm(
    y: &Tensor,
    z: &Tensor,
    w: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    let dims = y.dims().to_vec();
    let width = dims[dims.len() - 1];
    let g = (y * candle_nn::ops::silu(z)?)?;
    let mut gd = dims[..dims.len() - 1].to_vec();
    gd.extend([groups, width / groups]);
    let g = g.reshape(gd)?;
    let var = g.sqr()?.mean_keepdim(D::Minus1)?;
    let g = g.broadcast_div(&(var + eps)?.sqrt()?)?.reshape(dims)?;
    g.broadcast_mul(w)
}
