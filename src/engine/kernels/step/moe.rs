//! A Granite 4.0 hybrid layer's routed experts on the whole-model step (moe.cuh's kernels,
//! moe_bufs.rs's buffers): the router's matmul and top-k, the (row, slot) pairs sorted by
//! expert, one cuBLAS matmul per expert that has rows, the weighted sum into the MLP's output;
//! the backward through all of it, the router's included, and the load-balancing loss
//! transformers adds (× `router_aux_loss_coef`).
//!
//! Each layer's expert counts come back to the host after its router (one small read-back):
//! the experts' matmuls take them as their row counts, so the step runs such a model without
//! CUDA graphs.

use candle_core::cuda_backend::cudarc::driver::{result as drv, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::arena::Activations;
use super::gemm::mat;
use super::moe_bufs::{MoeActs, MoeDims, MoeIdx};
use super::moe_mm::{ExpertBufs, ExpertMm};
use super::params::{LayerIdx, G_GU};
use super::{check, Arg, ModelStep};
use crate::engine::kernels::cuda::{err, flat_cfg, i32_of};

/// What the host keeps of the experts' routing: each layer's counts (the experts' matmuls'
/// row counts, read back after its router; the backward reuses them) and router probability
/// sums, and the load-balancing loss summed over the optimizer step's micro-batches.
#[derive(Default)]
pub(super) struct MoeHost {
    pub(super) counts: Vec<Vec<u32>>,
    pub(super) psum: Vec<Vec<f32>>,
    /// Σ over this optimizer step's micro-batches of coef · the load-balancing loss.
    pub(super) aux_sum: f64,
}

/// Rows per warp-per-row launch: enough warps to fill the GPU, a grid-stride loop past that.
fn warp_rows_cfg(rows: usize, sms: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, sms * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl ModelStep {
    fn moe_parts(&self, a: &Activations, li: &LayerIdx) -> Result<(MoeDims, MoeIdx, MoeActs)> {
        match (self.moe, li.moe, a.moe.as_ref()) {
            (Some(d), Some(m), Some(acts)) => Ok((d, m, acts.clone())),
            _ => Err(err(
                "whole-model step: a layer's experts without their buffers",
            )),
        }
    }

    /// The host's copy of the routing state (a step without experts has none).
    fn moe_host(&self) -> Result<std::cell::RefMut<'_, MoeHost>> {
        self.moe_host
            .try_borrow_mut()
            .map_err(|_| err("whole-model step: the experts' routing state is in use"))
    }

    /// Layer `l`'s router and the experts' first half, from the normed MLP input `ln2[l]`:
    /// logits, top-k, counts (read back), the pairs in expert order, gate | up per expert
    /// into the kept `gu[l]`. A recompute of the layer runs it again (the same routing).
    pub(super) fn moe_in_fwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        if li.moe.is_none() {
            return Ok(());
        }
        let (d, m, acts) = self.moe_parts(a, li)?;
        let (n, c) = (a.b * self.t, self.c);
        let (e, k, i) = (d.experts, d.top_k, d.hidden);
        let (x, ldx) = (a.ln2[l], self.ln_ld(l, G_GU));
        check(ldx.is_multiple_of(8), || {
            format!("the experts' input row stride {ldx} is not a multiple of 8")
        })?;
        // logits[n, E] (f32) = ln2 · routerᵀ
        let router = self.weight_ptr(m.router)?;
        let mm = (mat(router, c), mat(x, ldx), mat(acts.logits[l], e));
        self.gemm_ab(
            "moe.router",
            (true, false),
            (e, n, c),
            mm,
            true,
            (1.0, 0.0),
            1,
        )?;
        let counts = acts.counts + (8 * e * l) as u64;
        let psum = counts + 4 * e as u64;
        // SAFETY: layer l's counts and sums: 2E words inside the arena's counts buffer.
        unsafe { drv::memset_d8_async(counts, 0, 8 * e, self.stream.cu_stream()) }.w()?;
        let mk = &self.k.moe;
        self.launch(
            &mk.route,
            warp_rows_cfg(n, self.k.sms),
            &[
                Arg::P(acts.logits[l]),
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(e, "experts")?),
                Arg::I(i32_of(k, "top k")?),
                Arg::P(acts.topi[l]),
                Arg::P(acts.topw[l]),
                Arg::P(counts),
                Arg::P(psum),
                Arg::P(acts.part),
                Arg::P(acts.ticket),
            ],
        )?;
        self.read_counts(l, e, n * k)?;
        let slots = n * k;
        self.launch(
            &mk.sort,
            LaunchConfig {
                grid_dim: (e as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::P(acts.topi[l]),
                Arg::P(counts),
                Arg::I(i32_of(slots, "pairs")?),
                Arg::P(acts.perm[l]),
                Arg::P(acts.pos[l]),
            ],
        )?;
        self.moe_gather((x, ldx), acts.x, acts.perm[l], (k, slots), 1.0)?;
        let bufs = self.expert_bufs(l, m, &acts, (c, i))?;
        self.upload_expert_ptrs(l, &bufs, acts.ptrs, e)?;
        self.experts_mm(l, ExpertMm::GateUp, &bufs)
    }

    /// Layer `l`'s experts' second half: silu(gate)·up, the down matmuls, and the weighted
    /// sum of each row's k outputs added into `out` (`[n, C]`: the shared MLP's output).
    pub(super) fn moe_out_fwd(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        out: u64,
    ) -> Result<()> {
        if li.moe.is_none() {
            return Ok(());
        }
        let (d, m, acts) = self.moe_parts(a, li)?;
        let (n, c, k, i) = (a.b * self.t, self.c, d.top_k, d.hidden);
        let slots = n * k;
        self.launch(
            &self.k.swiglu_fwd,
            flat_cfg(slots * i / 8),
            &[
                Arg::P(acts.gu[l]),
                Arg::P(acts.act),
                Arg::P((slots * i / 8) as u64),
                Arg::I(i32_of(i / 8, "expert width")?),
                Arg::I(0),
            ],
        )?;
        let bufs = self.expert_bufs(l, m, &acts, (c, i))?;
        self.experts_mm(l, ExpertMm::Down, &bufs)?;
        self.moe_combine((out, c), acts.y, acts.pos[l], acts.topw[l], (n, k))
    }

    /// Layer `l`'s experts' backward, from the MLP output's gradient `sc·dy` (`[n, C]`) to
    /// the normed input's, added into `da` (row stride `ldg`, after the shared MLP's share);
    /// the router's and experts' weight gradients where they train.
    pub(super) fn moe_bwd(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        (dy, sc): (u64, f32),
        ldg: usize,
    ) -> Result<()> {
        if li.moe.is_none() {
            return Ok(());
        }
        let (d, m, acts) = self.moe_parts(a, li)?;
        let (n, c) = (a.b * self.t, self.c);
        let (e, k, i) = (d.experts, d.top_k, d.hidden);
        let slots = n * k;
        check(ldg.is_multiple_of(8), || {
            format!("the experts' input gradient row stride {ldg} is not a multiple of 8")
        })?;
        let bufs = self.expert_bufs(l, m, &acts, (c, i))?;
        // each pair's dy row (× sc) in expert order, then u = dy·W_down per expert
        self.moe_gather((dy, c), acts.y, acts.perm[l], (k, slots), sc)?;
        self.experts_mm(l, ExpertMm::DownDx, &bufs)?;
        // the slots' weight gradients; du becomes w·u, the activation's gradient (and with
        // W_down training, y the weighted dy and act the activation: its operands)
        let trains_down = bufs.g_down != 0;
        self.launch(
            &self.k.moe.pair_bwd,
            warp_rows_cfg(slots, self.k.sms),
            &[
                Arg::P(acts.gu[l]),
                Arg::P(acts.du),
                Arg::P(if trains_down { acts.y } else { 0 }),
                Arg::P(if trains_down { acts.act } else { 0 }),
                Arg::P(acts.perm[l]),
                Arg::P(acts.topw[l]),
                Arg::P(acts.dw),
                Arg::I(i32_of(slots, "pairs")?),
                Arg::I(i32_of(i / 8, "expert width")?),
                Arg::I(i32_of(c / 8, "n_embd")?),
            ],
        )?;
        self.experts_mm(l, ExpertMm::DownDw, &bufs)?;
        self.launch(
            &self.k.swiglu_bwd,
            flat_cfg(slots * i / 8),
            &[
                Arg::P(acts.gu[l]),
                Arg::P(acts.du),
                Arg::P(acts.dgu),
                Arg::P((slots * i / 8) as u64),
                Arg::I(i32_of(i / 8, "expert width")?),
                Arg::I(0),
            ],
        )?;
        let (x, ldx) = (a.ln2[l], self.ln_ld(l, G_GU));
        if bufs.g_gate_up != 0 {
            self.moe_gather((x, ldx), acts.x, acts.perm[l], (k, slots), 1.0)?;
            self.experts_mm(l, ExpertMm::GateUpDw, &bufs)?;
        }
        // each pair's input gradient dgu·W_gate_up, summed per row into da
        self.experts_mm(l, ExpertMm::GateUpDx, &bufs)?;
        self.moe_combine((a.da, ldg), acts.x, acts.pos[l], 0, (n, k))?;
        // the router: d logits, then da += dlogits·W_router (and W_router's gradient)
        let aux = if self.moe_aux_on() { acts.aux } else { 0 };
        self.launch(
            &self.k.moe.router_bwd,
            warp_rows_cfg(n, self.k.sms),
            &[
                Arg::P(acts.logits[l]),
                Arg::P(acts.topi[l]),
                Arg::P(acts.topw[l]),
                Arg::P(acts.dw),
                Arg::P(aux),
                Arg::P(acts.dlogits),
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(e, "experts")?),
                Arg::I(i32_of(k, "top k")?),
            ],
        )?;
        let router = self.weight_ptr(m.router)?;
        let mm = (mat(router, c), mat(acts.dlogits, e), mat(a.da, ldg));
        self.gemm_ab(
            "moe.router dx",
            (false, false),
            (c, n, e),
            mm,
            false,
            (1.0, 1.0),
            1,
        )?;
        if let Some(g) = self.trained_grad_ptr(m.router) {
            let mm = (mat(x, ldx), mat(acts.dlogits, e), mat(g, c));
            self.gemm_ab(
                "moe.router dw",
                (false, true),
                (c, e, n),
                mm,
                true,
                (1.0, 1.0),
                1,
            )?;
        }
        Ok(())
    }

    /// Whether the load-balancing loss is part of the training loss (`router_aux_loss_coef`).
    fn moe_aux_on(&self) -> bool {
        self.moe_aux_coef > 0.0
    }

    /// After a training forward: this micro-batch's load-balancing loss (transformers':
    /// E · Σₑ (share of every layer's top-k picks that went to e) · (mean router probability
    /// of e over every layer's rows)), added to the step's loss × coef, and its gradient per
    /// router probability (× the micro-batch's loss gradient scale `g_mean`: 1/accum for a mean
    /// loss) into the arena for the backward.
    pub(super) fn moe_aux_fwd(&self, a: &Activations, g_mean: f32) -> Result<()> {
        let (Some(d), Some(acts)) = (self.moe, a.moe.as_ref()) else {
            return Ok(());
        };
        if !self.moe_aux_on() {
            return Ok(());
        }
        let e = d.experts;
        let mut host = self.moe_host()?;
        let (mut cnt, mut ps) = (vec![0f64; e], vec![0f64; e]);
        for (c, p) in host.counts.iter().zip(&host.psum) {
            for j in 0..e.min(c.len()).min(p.len()) {
                cnt[j] += f64::from(c[j]);
                ps[j] += f64::from(p[j]);
            }
        }
        let rows = (a.b * self.t * host.counts.len()) as f64;
        let scale = e as f64 / (rows * rows);
        let aux: f64 = cnt.iter().zip(&ps).map(|(c, p)| c * p).sum::<f64>() * scale;
        host.aux_sum += self.moe_aux_coef * aux;
        let grad: Vec<f32> = cnt
            .iter()
            .map(|c| (self.moe_aux_coef * scale * c * f64::from(g_mean)) as f32)
            .collect();
        // SAFETY: `aux` holds E f32 in the arena; the copy from pageable memory is staged
        // before this returns.
        unsafe { drv::memcpy_htod_async(acts.aux, &grad, self.stream.cu_stream()) }.w()
    }

    /// Layer `l`'s expert counts from its forward (the experts' matmuls' row counts).
    pub(super) fn moe_counts(&self, l: usize) -> Result<Vec<u32>> {
        let host = self.moe_host()?;
        host.counts.get(l).cloned().ok_or_else(|| {
            err(format!(
                "whole-model step: layer {l}'s expert counts are missing"
            ))
        })
    }

    /// The arena's table of the experts' operand addresses and the expert count.
    #[cfg(cublas_grouped)]
    pub(super) fn moe_ptrs(&self) -> Result<(u64, usize)> {
        match (
            self.arena.as_ref().and_then(|a| a.acts.moe.as_ref()),
            self.moe,
        ) {
            (Some(acts), Some(d)) => Ok((acts.ptrs, d.experts)),
            _ => Err(err("whole-model step: no experts' buffers")),
        }
    }

    /// What layer `l`'s expert products read and write.
    fn expert_bufs(
        &self,
        l: usize,
        m: MoeIdx,
        acts: &MoeActs,
        (c, i): (usize, usize),
    ) -> Result<ExpertBufs> {
        Ok(ExpertBufs {
            gate_up: self.weight_ptr(m.gate_up)?,
            down: self.weight_ptr(m.down)?,
            g_gate_up: self.trained_grad_ptr(m.gate_up).unwrap_or(0),
            g_down: self.trained_grad_ptr(m.down).unwrap_or(0),
            x: acts.x,
            gu: acts.gu[l],
            act: acts.act,
            y: acts.y,
            du: acts.du,
            dgu: acts.dgu,
            c,
            i,
        })
    }

    /// dst row p = scale · src row (perm[p] / k) (`src` rows `lds` apart; `[P, C]` out).
    fn moe_gather(
        &self,
        (src, lds): (u64, usize),
        dst: u64,
        perm: u64,
        (k, slots): (usize, usize),
        scale: f32,
    ) -> Result<()> {
        let c8 = self.c / 8;
        self.launch(
            &self.k.moe.gather,
            flat_cfg(slots * c8),
            &[
                Arg::P(src),
                Arg::I(i32_of(lds, "row stride")?),
                Arg::P(dst),
                Arg::P(perm),
                Arg::I(i32_of(k, "top k")?),
                Arg::I(i32_of(slots, "pairs")?),
                Arg::I(i32_of(c8, "n_embd")?),
                Arg::F(scale),
            ],
        )
    }

    /// out row r (+)= Σ_s w[r, s] · y row pos[r, s] (`w` 0: weight 1).
    fn moe_combine(
        &self,
        (out, ldo): (u64, usize),
        y: u64,
        pos: u64,
        w: u64,
        (n, k): (usize, usize),
    ) -> Result<()> {
        let c8 = self.c / 8;
        self.launch(
            &self.k.moe.combine,
            flat_cfg(n * c8),
            &[
                Arg::P(out),
                Arg::I(i32_of(ldo, "row stride")?),
                Arg::P(y),
                Arg::P(pos),
                Arg::P(w),
                Arg::I(i32_of(k, "top k")?),
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(c8, "n_embd")?),
            ],
        )
    }

    /// Layer `l`'s expert counts and router probability sums back to the host (waits for
    /// the GPU): the counts, which the experts' matmuls take as row counts.
    fn read_counts(&self, l: usize, e: usize, slots: usize) -> Result<()> {
        let a = self
            .arena
            .as_ref()
            .and_then(|a| a.moe.as_ref())
            .ok_or_else(|| err("whole-model step: no experts' buffers"))?;
        let part = a
            .counts
            .try_slice(2 * e * l..2 * e * (l + 1))
            .ok_or_else(|| err("whole-model step: expert counts out of range"))?;
        let v = self.stream.clone_dtoh(&part).w()?;
        let (counts, psum) = v.split_at(e);
        let sum: usize = counts.iter().map(|&c| c as usize).sum();
        check(sum == slots, || {
            format!("layer {l}'s experts counted {sum} of its {slots} pairs")
        })?;
        let mut host = self.moe_host()?;
        if host.counts.len() < self.n_layer {
            host.counts.resize(self.n_layer, Vec::new());
            host.psum.resize(self.n_layer, Vec::new());
        }
        host.counts[l] = counts.to_vec();
        host.psum[l] = psum.iter().map(|&b| f32::from_bits(b)).collect();
        Ok(())
    }
}
