//! The forward: the transformer blocks, the MLP activation, and the LM head with its loss.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::Result;

use super::arena::Activations;
use super::gemm::Lin;
use super::params::{LayerIdx, G_DOWN, G_GU, G_O, G_QKV, UP};
use super::{Arg, ModelStep};
use crate::engine::dropout;
use crate::engine::kernels::cuda::{flat_cfg, i32_of};
use crate::engine::kernels::lt::Epi;

impl ModelStep {
    /// The MLP's up projection and activation of layer `l`: `fc[l]` (the pre-activation,
    /// which the backward needs) and `gelu[l]` (the activation's output).
    pub(super) fn mlp_act_fwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c, f) = (a.n, self.c, self.hidden);
        if self.swiglu {
            // gate|up = ln2·[Wg; Wu]ᵀ (+ b) as one matmul, then h = silu(gate)·up.
            let gu = Lin::new(n, c, 2 * f, 2 * f);
            self.group_fwd(a, (l, li, G_GU), a.ln2[l], li.up_b, a.fc[l], gu)?;
            self.launch(
                &self.k.swiglu_fwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(a.act[l]),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                    Arg::I(self.geglu as i32),
                ],
            )?;
            // (A hybrid's routed experts beside it: routed, and their gate | up.)
            return self.moe_in_fwd(a, l, li);
        }
        let up = Lin::new(n, c, f, f);
        match li.up_b {
            Some(up_b) if li.lora[UP].is_none() => {
                let gelu = Epi::GeluAuxBias {
                    bias: self.weight_ptr(up_b)?,
                    aux: a.fc[l],
                    ld: f,
                };
                if self.lin_fwd_epi(
                    a.ln2[l],
                    self.matmul_weight(li.up_w)?,
                    a.act[l],
                    up,
                    gelu,
                    0.0,
                )? {
                    return Ok(());
                }
            }
            _ => {}
        }
        // fc = ln2·Wupᵀ + b (+ the adapter): the pre-activation the backward reads, bias
        // included (as the epilogue's aux), then gelu(fc).
        self.group_fwd(a, (l, li, G_GU), a.ln2[l], li.up_b, a.fc[l], up)?;
        self.bias_act(a.fc[l], 0, a.act[l], n, f, 1)
    }

    /// The forward to the loss; with `grad`, the loss's gradient w.r.t. the logits (scaled by
    /// the arena's `g`, [`Activations::gw`]) and the LM head's backward too (they run with the
    /// loss, chunk by chunk: [`Self::head_and_loss`]).
    pub(super) fn forward(&self, a: &Activations, first: bool, grad: bool) -> Result<()> {
        let (b, t, c) = (a.b, self.t, self.c);
        let n = b * t;
        let nc = n * c;
        self.lora_blocks()?;
        let (n_i, c_i) = (i32_of(n, "rows")?, i32_of(c, "n_embd")?);
        self.launch(
            &self.k.embed,
            flat_cfg(nc),
            &[
                Arg::P(a.ids),
                Arg::P(self.weight_ptr(self.wte)?),
                Arg::P(self.weight_ptr_or_null(self.wpe)?),
                Arg::P(a.res[0]),
                Arg::I(n_i),
                Arg::I(i32_of(t, "T")?),
                Arg::I(c_i),
                Arg::I(i32_of(self.vocab, "vocab")?),
            ],
        )?;
        self.embed_scale(a, a.res[0], n)?;
        // Offload (training passes): the blocks' inputs to the host as they are written.
        let offload = grad
            .then(|| self.arena.as_ref().and_then(|a| a.offload.as_ref()))
            .flatten();
        if let Some(o) = offload {
            o.store(0, a.res[0])?;
        }
        // LN1 of layer 0 (no residual add before it).
        let l0 = self.layers[0];
        let ln = (l0.ln1_w, l0.ln1_b, a.stats[0]);
        let ln1 = (a.ln1[0], self.ln_ld(0, G_QKV));
        self.residual_norm(a, (a.res[0], 0, 0, None), 0, ln, ln1, (n, true))?;
        for (l, li) in self.layers.iter().enumerate() {
            if let Some(o) = offload {
                o.before_block(l)?;
            }
            self.attention(a, l, li)?;
            self.mlp_half_fwd(a, l, li)?;
            // The MLP: ·Wdownᵀ (+ b) added to the residual, fused with the next layer's norm
            // (or the final one).
            // (Gemma's sandwich: into its output norm's input, then normed into `tmp`.)
            let out = li.post.map_or(a.tmp, |_| a.post_in[l][1]);
            self.mlp_fwd(a, l, li, out)?;
            self.moe_out_fwd(a, l, li, out)?;
            if let Some((_, pm)) = li.post {
                self.out_norm(a, pm, (out, a.post_stats[l][1]))?;
            }
            let (nw, nb, out) = match self.layers.get(l + 1) {
                Some(next) => (
                    next.ln1_w,
                    next.ln1_b,
                    (a.ln1[l + 1], self.ln_ld(l + 1, G_QKV)),
                ),
                None => (self.lnf.0, self.lnf.1, (a.lnf, c)),
            };
            let ln = (nw, nb, a.stats[2 * l + 2]);
            let y = (
                a.mid[l],
                a.tmp,
                self.weight_ptr_or_null(li.down_b)?,
                Some(dropout::site_mlp_out(l)),
            );
            let pre = l + 1 < self.layers.len();
            self.residual_norm(a, y, a.res[l + 1], ln, out, (n, pre))?;
            if let Some(o) = offload {
                o.store(l + 1, a.res[l + 1])?;
            }
        }
        if grad {
            self.moe_aux_fwd(a, self.moe_g.get())?;
        }
        self.logit_scale(a, a.lnf, n)?;
        self.head_and_loss(a, first, grad)
    }

    /// Recompute (`model.recompute`): block `l`'s attention half again from its kept input
    /// `res[l]` — the norm (the same arithmetic as the forward's fused add + norm: that one
    /// normalises the rounded sum it stores) and [`Self::attention`]. Dropout masks are
    /// functions of the micro-batch's seed: drawn again the same.
    pub(super) fn attn_half_fwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let ln = (li.ln1_w, li.ln1_b, a.stats[2 * l]);
        let ln1 = (a.ln1[l], self.ln_ld(l, G_QKV));
        self.residual_norm(a, (a.res[l], 0, 0, None), 0, ln, ln1, (a.b * self.t, true))?;
        self.attention(a, l, li)
    }

    /// A block's middle: mid = res + dropout(atty·Woᵀ (+ bo)) (atty: the mixer's output, a
    /// Mamba layer's of its inner width; Gemma: the projection's output normed first), then
    /// ln2 = Norm2(mid) (the forward, and the "full" recompute).
    pub(super) fn mlp_half_fwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c) = (a.b * self.t, self.c);
        let o = Lin::new(n, self.mixer_width(li), c, c);
        let out = li.post.map_or(a.tmp, |_| a.post_in[l][0]);
        let beta = self.lora_fwd(a, l, li, G_O, a.atty[l], out, c)?;
        self.lin_fwd_beta(a.atty[l], self.matmul_weight(li.o_w)?, out, o, beta)?;
        if let Some((pa, _)) = li.post {
            self.out_norm(a, pa, (out, a.post_stats[l][0]))?;
        }
        let ln = (li.ln2_w, li.ln2_b, a.stats[2 * l + 1]);
        let y = (
            a.res[l],
            a.tmp,
            self.weight_ptr_or_null(li.o_b)?,
            Some(dropout::site_attention_out(l)),
        );
        let ln2 = (a.ln2[l], self.ln_ld(l, G_GU));
        self.residual_norm(a, y, a.mid[l], ln, ln2, (n, true))
    }

    /// The MLP of layer `l` from its normed input `ln2[l]` into `out` ([N, C]): the
    /// activation ([`Self::mlp_act_fwd`]) and the down projection (+ its adapters), a chunk of
    /// [`Activations::mlp_rows`] rows at a time ([`Self::mlp_chunks`]).
    pub(super) fn mlp_fwd(&self, a: &Activations, l: usize, li: &LayerIdx, out: u64) -> Result<()> {
        let (c, f) = (self.c, self.hidden);
        for (r0, w) in self.mlp_chunks(a, l, li) {
            let (rows, w) = (w.n, &*w);
            self.mlp_act_fwd(w, l, li)?;
            let out = out + 2 * (r0 * c) as u64;
            let beta = self.lora_fwd(w, l, li, G_DOWN, w.act[l], out, c)?;
            // (Its address asked for last: a 4-bit matrix is dequantized into the scratch
            // that the gate|up matmul's weights went through.)
            let wd = self.matmul_weight(li.down_w)?;
            self.lin_fwd_beta(w.act[l], wd, out, Lin::new(rows, f, c, c), beta)?;
        }
        Ok(())
    }

    /// The LM head and its loss, in chunks of rows so that the logits never exist whole:
    /// per chunk, logits = lnf·headᵀ (rows of stride vpad), then per-row CE, whose gradient
    /// (scaled by the arena's g) overwrites the logits in the same pass, then at once the head's backward
    /// for those rows (`da` = dlogits·head, the head's gradient += dlogitsᵀ·lnf).
    pub(super) fn head_and_loss(&self, a: &Activations, first: bool, grad: bool) -> Result<()> {
        let (n, c, v) = (a.b * self.t, self.c, self.vocab);
        let head = self.head.unwrap_or(self.wte);
        // A row in registers where it fits (kernels.cu: 512 threads × CE_REG 16-byte chunks).
        let ce = if v / 8 <= 512 * 13 {
            &self.k.ce_reg
        } else {
            &self.k.ce
        };
        let mut start = 0;
        while start < n {
            let rows = a.head_rows.min(n - start);
            let d = Lin::new(rows, c, v, self.vpad);
            let x = a.lnf + 2 * (start * c) as u64;
            self.lin_fwd(x, self.weight_ptr(head)?, a.logits, d)?;
            self.launch(
                ce,
                LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (512, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.logits),
                    Arg::P(a.targets + 4 * start as u64),
                    Arg::P(a.loss + 4 * start as u64),
                    Arg::P(a.gw),
                    Arg::I(i32_of(rows, "rows")?),
                    Arg::I(i32_of(v, "vocab")?),
                    Arg::I(i32_of(self.vpad, "vocab")?),
                    Arg::F(self.final_cap),
                ],
            )?;
            if !grad {
                start += rows;
                continue;
            }
            self.lin_dx(
                a.logits,
                self.weight_ptr(head)?,
                a.da + 2 * (start * c) as u64,
                d,
            )?;
            if let Some(gh) = self.trained_grad_ptr(head) {
                self.lin_dw(x, a.logits, gh, d, first && start == 0)?;
            }
            start += rows;
        }
        Ok(())
    }
}
