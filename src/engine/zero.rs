//! ZeRO stage 1 (Rajbhandari et al., 2020): the optimizer state sharded over data-parallel
//! ranks.
//!
//! The trainable weights' gradients lie in one flat fp32 buffer (the whole-model step's own,
//! or a concatenation on the per-op path) of `world · len` elements. Rank r owns the range
//! `[r·len, (r+1)·len)`: after a reduce-scatter it holds the summed gradient of that range
//! only, keeps Adam's moments for it only (`2 · len` floats instead of `2 · world · len`),
//! updates the fp32 weights that fall in it, and an all-gather hands every rank every range.
//!
//! What is gathered depends on who computes with the weights. The whole-model CUDA step
//! computes with bf16 copies laid out as its gradient buffer is: the fused update writes the
//! range's copies, the ranks all-gather that bf16 buffer (reduce-scatter plus all-gather move
//! the bytes of one all-reduce), and the fp32 masters outside a rank's range go stale — the
//! trainer gathers them ([`Shard::masters_into`] and an fp32 all-gather) only before what reads
//! them: checkpoints, evaluation, the end of the run. SCU's Σw² and its gradient come from each
//! rank's own, always exact, range ([`Shard::weight_sumsq`], [`Shard::pieces_of`]). Elsewhere
//! (the per-op path) the updated fp32 weights go into the rank's range of the buffer, are
//! all-gathered, and every rank sets its weights from them.
//!
//! Checkpoints keep the format of a single process: [`Shard::gather_moments`] collects the
//! moments (a collective: every rank calls it, rank 0 writes), so a run may resume at another
//! world size, sharded or not.

use super::optim::AdamW;
use crate::distributed::{Collective, CommError};
use candle_core::{DType, Device, Result, Tensor};

/// The part of one trainable weight inside this rank's range of the flat buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index into the optimizer's slots.
    pub slot: usize,
    /// First element of the piece within the (flattened) weight.
    pub var_off: usize,
    /// First element of the piece within this rank's range.
    pub shard_off: usize,
    pub len: usize,
}

/// Rank `rank`'s pieces, for weights at `places[i] = (offset, elements)` in a flat buffer of
/// `total` elements split into `world` equal ranges. Gaps between weights (alignment) belong
/// to no piece.
pub fn plan(places: &[(usize, usize)], total: usize, rank: usize, world: usize) -> Vec<Piece> {
    let len = total / world.max(1);
    let (lo, hi) = (rank * len, (rank + 1) * len);
    let mut pieces: Vec<Piece> = places
        .iter()
        .enumerate()
        .filter_map(|(slot, &(off, n))| {
            let (a, b) = (off.max(lo), (off + n).min(hi));
            (a < b).then(|| Piece {
                slot,
                var_off: a - off,
                shard_off: a - lo,
                len: b - a,
            })
        })
        .collect();
    pieces.sort_by_key(|p| p.shard_off);
    pieces
}

/// Each weight's place in a flat buffer that concatenates them in order, and the buffer's
/// length rounded up to a multiple of `world` (the per-op path's layout).
pub fn packed_places(sizes: &[usize], world: usize) -> (Vec<(usize, usize)>, usize) {
    let mut off = 0;
    let places = sizes
        .iter()
        .map(|&n| {
            let p = (off, n);
            off += n;
            p
        })
        .collect();
    (places, off.div_ceil(world.max(1)) * world.max(1))
}

/// This rank's share of the optimizer state.
pub struct Shard {
    rank: usize,
    world: usize,
    /// Elements in each rank's range.
    len: usize,
    /// Every slot's (offset, elements) in the flat buffer.
    places: Vec<(usize, usize)>,
    pieces: Vec<Piece>,
    /// Adam's moments for this rank's range (gaps included, never read).
    m: Tensor,
    v: Tensor,
    /// The last update wrote this rank's pieces into the weights themselves (the fused
    /// kernel), not only into the buffer.
    in_place: bool,
}

/// Σx² over f32 tensors: one fused launch on the GPU, the plain composition otherwise.
fn sumsq(views: &[Tensor]) -> Result<f64> {
    if views.is_empty() {
        return Ok(0.0);
    }
    if views
        .iter()
        .all(|v| super::kernels::usable(v) && v.dtype() == DType::F32)
    {
        return super::kernels::sumsq(views);
    }
    let mut s = 0.0;
    for v in views {
        s += v
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(s)
}

fn comm(e: CommError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl Shard {
    /// The shard of `opt`'s state for a flat buffer of `total` elements holding the slots at
    /// `places`. Moments already in `opt` (a resumed checkpoint) are taken over; `opt`'s
    /// own moments are released either way.
    pub fn new(
        opt: &mut AdamW,
        places: Vec<(usize, usize)>,
        total: usize,
        rank: usize,
        world: usize,
        device: &Device,
    ) -> Result<Self> {
        if world == 0 || !total.is_multiple_of(world) || places.len() != opt.slots.len() {
            candle_core::bail!(
                "optimizer sharding: {total} elements over {world} ranks for {} weights ({} places)",
                opt.slots.len(),
                places.len()
            );
        }
        let len = total / world;
        let pieces = plan(&places, total, rank, world);
        let mut s = Self {
            rank,
            world,
            len,
            places,
            pieces,
            m: Tensor::zeros(len, DType::F32, device)?,
            v: Tensor::zeros(len, DType::F32, device)?,
            in_place: false,
        };
        s.absorb(opt)?;
        Ok(s)
    }

    /// Take over the moments `opt` holds in full (after a checkpoint was loaded into it) and
    /// release them there. Slots without full moments leave the shard's as they are.
    pub fn absorb(&mut self, opt: &mut AdamW) -> Result<()> {
        for p in &self.pieces {
            let slot = &opt.slots[p.slot];
            if slot.m.elem_count() != slot.var.elem_count() {
                continue;
            }
            for (full, mine) in [(&slot.m, &self.m), (&slot.v, &self.v)] {
                let part = full.flatten_all()?.narrow(0, p.var_off, p.len)?;
                let part = part.to_dtype(DType::F32)?.to_device(mine.device())?;
                mine.slice_set(&part, 0, p.shard_off)?;
            }
        }
        opt.release_moments()
    }

    /// Elements in the flat buffer (every rank's range).
    pub fn total(&self) -> usize {
        self.len * self.world
    }

    /// Bytes of optimizer state this rank keeps (the two moments of its range).
    pub fn state_bytes(&self) -> usize {
        2 * 4 * self.len
    }

    /// The per-op path's flat buffer: the gradients in slot order, zero-padded to the
    /// sharded length.
    pub fn pack(&self, grads: &[Tensor]) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(grads.len() + 1);
        let mut n = 0;
        for g in grads {
            n += g.elem_count();
            parts.push(g.flatten_all()?.to_dtype(DType::F32)?);
        }
        if let Some(g) = grads.first() {
            if n < self.total() {
                parts.push(Tensor::zeros(self.total() - n, DType::F32, g.device())?);
            }
        }
        Tensor::cat(&parts, 0)
    }

    /// This rank's range of the flat buffer, in elements.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.rank * self.len..(self.rank + 1) * self.len
    }

    /// This rank's pieces of the weights in `opt` (a view of each, in piece order).
    fn weight_views(&self, opt: &AdamW) -> Result<Vec<Tensor>> {
        self.pieces
            .iter()
            .map(|p| {
                let var = opt.slots[p.slot].var.as_tensor();
                var.flatten_all()?.narrow(0, p.var_off, p.len)
            })
            .collect()
    }

    /// This rank's pieces of `flat` (a view of each).
    fn views(&self, flat: &Tensor) -> Result<Vec<Tensor>> {
        let lo = self.rank * self.len;
        self.pieces
            .iter()
            .map(|p| flat.narrow(0, lo + p.shard_off, p.len))
            .collect()
    }

    /// Σg² over this rank's pieces of the (reduce-scattered) gradient buffer; the ranks'
    /// values sum to the square of the global gradient norm.
    pub fn grad_sumsq(&self, flat: &Tensor) -> Result<f64> {
        sumsq(&self.views(flat)?)
    }

    /// One AdamW step over this rank's range: the summed gradient in `flat` (times
    /// `grad_scale`) updates the weights' pieces and the moments. Given the whole-model
    /// step (`copies`), the fused update writes the updated pieces' bf16 compute copies into
    /// the step's weight buffer and returns true: the caller all-gathers that buffer, and the
    /// fp32 weights outside this rank's range are then stale until [`Self::masters_into`]
    /// and an all-gather of `flat` bring them back. Otherwise (false) the updated weights are
    /// written into this rank's range of `flat` for an all-gather of the fp32 weights.
    pub fn update(
        &mut self,
        opt: &mut AdamW,
        flat: &Tensor,
        lr: f64,
        grad_scale: f64,
        copies: Option<&super::kernels::ModelStep>,
    ) -> Result<bool> {
        opt.t += 1;
        let bc1 = 1.0 - opt.beta1.powi(opt.t as i32);
        let bc2 = 1.0 - opt.beta2.powi(opt.t as i32);
        let lo = self.rank * self.len;
        let (ws, gs) = (self.weight_views(opt)?, self.views(flat)?);
        let ms: Vec<Tensor> = self
            .pieces
            .iter()
            .map(|p| self.m.narrow(0, p.shard_off, p.len))
            .collect::<Result<_>>()?;
        let vs: Vec<Tensor> = self
            .pieces
            .iter()
            .map(|p| self.v.narrow(0, p.shard_off, p.len))
            .collect::<Result<_>>()?;
        // (Both decided from every weight, not from this rank's pieces — a rank may have none
        // — so that every rank takes the same path and gathers the same buffer.)
        let fused = opt.fused
            && opt.slots.iter().all(|s| {
                let t = s.var.as_tensor();
                super::kernels::usable(t) && t.dtype() == DType::F32
            });
        let copied = copies.is_some_and(|s| {
            opt.slots
                .iter()
                .all(|slot| s.weight_copy(&slot.var).is_some())
        });
        if fused {
            // In place: the weights' pieces (views of the weights) and the moments, and the
            // pieces' bf16 copies where every weight has its place in the step.
            let copy_of = |p: &Piece| {
                copies.and_then(|s| s.weight_copy_at(&opt.slots[p.slot].var, p.var_off))
            };
            let items: Vec<super::kernels::AdamItem> = self
                .pieces
                .iter()
                .enumerate()
                .map(|(i, p)| super::kernels::AdamItem {
                    w: &ws[i],
                    g: &gs[i],
                    m: &ms[i],
                    v: &vs[i],
                    decay: opt.slots[p.slot].decay && opt.weight_decay > 0.0,
                    copy: if copied { copy_of(p) } else { None },
                })
                .collect();
            super::kernels::adamw_multi(
                &items,
                &super::kernels::AdamWArgs {
                    lr,
                    beta1: opt.beta1,
                    beta2: opt.beta2,
                    eps: opt.eps,
                    decay: 1.0 - lr * opt.weight_decay,
                    bc1,
                    bc2,
                    grad_scale,
                },
            )?;
            self.in_place = true;
            if copied {
                return Ok(true);
            }
            // The updated pieces into this rank's range of the buffer: one launch.
            self.masters_into(opt, flat)?;
            return Ok(false);
        }
        self.in_place = false;
        // The composition AdamW's plain path computes, piece by piece.
        for (i, p) in self.pieces.iter().enumerate() {
            let g = (&gs[i] * grad_scale)?;
            let m = ((&ms[i] * opt.beta1)? + (&g * (1.0 - opt.beta1))?)?;
            let v = ((&vs[i] * opt.beta2)? + (g.sqr()? * (1.0 - opt.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + opt.eps)?)?;
            let w = if opt.slots[p.slot].decay && opt.weight_decay > 0.0 {
                (&ws[i] * (1.0 - lr * opt.weight_decay))?
            } else {
                ws[i].clone()
            };
            let w = (w - (update * lr)?)?;
            self.m.slice_set(&m, 0, p.shard_off)?;
            self.v.slice_set(&v, 0, p.shard_off)?;
            flat.slice_set(&w.to_dtype(DType::F32)?, 0, lo + p.shard_off)?;
        }
        Ok(false)
    }

    /// This rank's pieces of the fp32 weights into its range of `flat` (one launch where the
    /// fused kernels serve), for an all-gather that hands every rank every weight.
    pub fn masters_into(&self, opt: &AdamW, flat: &Tensor) -> Result<()> {
        let lo = self.rank * self.len;
        let (srcs, dsts) = (self.weight_views(opt)?, self.views(flat)?);
        let fused = srcs
            .iter()
            .chain(&dsts)
            .all(|t| super::kernels::usable(t) && t.dtype() == DType::F32);
        if fused && !srcs.is_empty() {
            let pairs: Vec<(&Tensor, &Tensor)> = srcs.iter().zip(&dsts).collect();
            return super::kernels::copy_multi(&pairs);
        }
        for (p, src) in self.pieces.iter().zip(&srcs) {
            flat.slice_set(&src.to_dtype(DType::F32)?, 0, lo + p.shard_off)?;
        }
        Ok(())
    }

    /// `(slot, first element, elements)` of this rank's pieces of the slots in `slots`.
    pub fn pieces_of(&self, slots: &[usize]) -> Vec<(usize, usize, usize)> {
        self.pieces
            .iter()
            .filter(|p| slots.contains(&p.slot))
            .map(|p| (p.slot, p.var_off, p.len))
            .collect()
    }

    /// Σw² over this rank's pieces of the slots in `slots` (the ranks' values sum to the
    /// whole weights' Σw²; each rank's own range is exact even while the rest is stale).
    pub fn weight_sumsq(&self, opt: &AdamW, slots: &[usize]) -> Result<f64> {
        let views: Vec<Tensor> = self
            .pieces_of(slots)
            .into_iter()
            .map(|(slot, at, n)| {
                opt.slots[slot]
                    .var
                    .as_tensor()
                    .flatten_all()?
                    .narrow(0, at, n)
            })
            .collect::<Result<_>>()?;
        sumsq(&views)
    }

    /// After the all-gather: every weight from its place in `flat` (but those the update
    /// wrote in place whole: they lie in this rank's range and hold their values already).
    pub fn scatter_weights(&self, opt: &AdamW, flat: &Tensor) -> Result<()> {
        let (lo, hi) = (self.rank * self.len, (self.rank + 1) * self.len);
        let todo: Vec<(&super::optim::Slot, usize, usize)> = opt
            .slots
            .iter()
            .zip(&self.places)
            .filter(|(_, &(off, n))| !(self.in_place && off >= lo && off + n <= hi))
            .map(|(slot, &(off, n))| (slot, off, n))
            .collect();
        let fused = super::kernels::usable(flat)
            && todo.iter().all(|(s, _, _)| {
                let t = s.var.as_tensor();
                super::kernels::usable(t) && t.dtype() == DType::F32 && t.is_contiguous()
            });
        if fused {
            // One launch for every weight (a candle copy each would be a launch each).
            let srcs: Vec<Tensor> = todo
                .iter()
                .map(|&(_, off, n)| flat.narrow(0, off, n))
                .collect::<Result<_>>()?;
            let pairs: Vec<(&Tensor, &Tensor)> = srcs
                .iter()
                .zip(&todo)
                .map(|(src, (slot, _, _))| (src, slot.var.as_tensor()))
                .collect();
            return super::kernels::copy_multi(&pairs);
        }
        for (slot, off, n) in todo {
            let w = flat.narrow(0, off, n)?.reshape(slot.var.shape())?;
            slot.var.set(&w.to_dtype(slot.var.dtype())?)?;
        }
        Ok(())
    }

    /// Σ w²/(√v̂+ε) over this rank's pieces of the slots in `slots` (SCU's plant reading;
    /// the ranks' values sum to [`AdamW::penalty_stats`]' second figure).
    pub fn penalty_weighted(&self, opt: &AdamW, slots: &[usize]) -> Result<f64> {
        let bc2 = 1.0 - opt.beta2.powi(opt.t.max(1) as i32);
        let mut weighted = 0.0;
        for p in self.pieces.iter().filter(|p| slots.contains(&p.slot)) {
            let w = opt.slots[p.slot]
                .var
                .as_tensor()
                .flatten_all()?
                .narrow(0, p.var_off, p.len)?
                .to_dtype(DType::F32)?;
            let v = self.v.narrow(0, p.shard_off, p.len)?;
            let denom = ((v / bc2)?.sqrt()? + opt.eps)?;
            weighted += (w.sqr()? / denom)?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        Ok(weighted)
    }

    /// Every slot's full moments, on the host, named as a checkpoint names them
    /// (`<name>.m`, `<name>.v`). A collective: every rank calls it; `scratch` is any f32
    /// buffer of [`Self::total`] elements nothing else reads now.
    pub fn gather_moments(
        &self,
        opt: &AdamW,
        d: &mut dyn Collective,
        scratch: &Tensor,
    ) -> Result<Vec<(String, Tensor)>> {
        let lo = self.rank * self.len;
        let mut gathered = Vec::with_capacity(2);
        for (which, mine) in [("m", &self.m), ("v", &self.v)] {
            scratch.slice_set(mine, 0, lo)?;
            d.all_gather_in_place(scratch).map_err(comm)?;
            // One read-back of the buffer, then each slot's own host tensor (a view moved
            // to the host would take the whole buffer's storage along).
            let host = scratch.to_vec1::<f32>()?;
            let mut named = Vec::with_capacity(opt.slots.len());
            for (slot, &(off, n)) in opt.slots.iter().zip(&self.places) {
                let part = host.get(off..off + n).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "optimizer sharding: {} outside the buffer",
                        slot.name
                    ))
                })?;
                let t = Tensor::from_slice(part, slot.var.shape(), &Device::Cpu)?;
                named.push((format!("{}.{which}", slot.name), t));
            }
            gathered.push(named);
        }
        // Interleaved as AdamW's own list is: m then v per slot.
        let v = gathered.pop().unwrap_or_default();
        let m = gathered.pop().unwrap_or_default();
        Ok(m.into_iter().zip(v).flat_map(|(a, b)| [a, b]).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_weight_once_over_the_ranks() {
        // Three weights with an alignment gap, over 3 ranks of 6 elements.
        let places = [(0, 5), (6, 7), (13, 4)];
        let total = 18;
        let mut seen = [vec![0; 5], vec![0; 7], vec![0; 4]];
        for r in 0..3 {
            let mut last_end = 0;
            for p in plan(&places, total, r, 3) {
                assert!(p.shard_off >= last_end && p.shard_off + p.len <= 6, "{p:?}");
                last_end = p.shard_off + p.len;
                // The piece's place in the buffer is the weight's place plus its offset.
                assert_eq!(r * 6 + p.shard_off, places[p.slot].0 + p.var_off);
                for e in &mut seen[p.slot][p.var_off..p.var_off + p.len] {
                    *e += 1;
                }
            }
        }
        assert!(seen.iter().flatten().all(|&c| c == 1), "{seen:?}");
    }

    /// Two ranks' shards, each updating its range and then taking the other's (the all-gather,
    /// done by hand), leave every weight where one unsharded AdamW leaves it — bit for bit
    /// (the same element-wise arithmetic, piece by piece), and the moments split between them.
    #[test]
    fn two_shards_update_like_one_optimizer() -> Result<()> {
        let dev = Device::Cpu;
        let shapes: [&[usize]; 3] = [&[5], &[3, 4], &[7]];
        let init: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(0f32, 1.0, *s, &dev))
            .collect::<Result<_>>()?;
        let opt_of = |decay: bool| -> Result<AdamW> {
            let params = init
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    Ok((
                        format!("w{i}"),
                        candle_core::Var::from_tensor(t)?,
                        decay || i != 1,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let mut o = AdamW::new(params, 0.9, 0.95, 1e-8, 0.1)?;
            o.fused = false;
            Ok(o)
        };
        let mut reference = opt_of(false)?;
        let sizes: Vec<usize> = init.iter().map(Tensor::elem_count).collect();
        let (places, total) = packed_places(&sizes, 2);
        let mut ranks = Vec::new();
        for r in 0..2 {
            let mut o = opt_of(false)?;
            let s = Shard::new(&mut o, places.clone(), total, r, 2, &dev)?;
            ranks.push((o, s));
        }
        for step in 0..3 {
            let grads: Vec<Tensor> = shapes
                .iter()
                .map(|s| Tensor::randn(0f32, 1.0 + step as f32, *s, &dev))
                .collect::<Result<_>>()?;
            reference.step_scaled(&grads, 1e-2, 0.5)?;
            let mut flats = Vec::new();
            for (o, s) in ranks.iter_mut() {
                let flat = s.pack(&grads)?;
                s.update(o, &flat, 1e-2, 0.5, None)?;
                flats.push(flat);
            }
            let half = total / 2;
            let gathered = Tensor::cat(
                &[
                    flats[0].narrow(0, 0, half)?,
                    flats[1].narrow(0, half, half)?,
                ],
                0,
            )?;
            for (o, s) in &ranks {
                s.scatter_weights(o, &gathered)?;
            }
        }
        for (o, _) in &ranks {
            for (a, b) in o.slots.iter().zip(&reference.slots) {
                let diff = (a.var.as_tensor() - b.var.as_tensor())?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{}", a.name);
            }
            assert!(!o.holds_moments(), "the moments live in the shard");
        }
        // Each rank keeps the moments of its half only.
        assert_eq!(ranks[0].1.state_bytes(), 2 * 4 * total / 2);
        Ok(())
    }

    #[test]
    fn packed_places_pad_to_the_world() {
        let (places, total) = packed_places(&[3, 4, 2], 4);
        assert_eq!(places, vec![(0, 3), (3, 4), (7, 2)]);
        assert_eq!(total, 12);
        assert_eq!(packed_places(&[4, 4], 2).1, 8);
    }
}
