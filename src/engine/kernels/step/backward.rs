//! The backward: the blocks in reverse, with weight gradients on the side stream.

use candle_core::Result;

use super::arena::Activations;
use super::gemm::Lin;
use super::params::{LayerIdx, DOWN, GATE, G_DOWN, G_GU, G_O, G_QKV, UP};
use super::{check, Arg, ModelStep};
use crate::config::Recompute;
use crate::engine::dropout;
use crate::engine::kernels::cuda::{flat_cfg, i32_of};
use crate::engine::kernels::lt::Epi;
use crate::engine::kernels::side::{Buf, Side};

impl ModelStep {
    /// The backward from the logits' gradient (written by the forward's CE kernel).
    /// The bias gradients of the attention-out and MLP-down projections are column sums of
    /// the residual stream's gradient, which the LayerNorm backward that writes it adds up
    /// as it goes (where its v8 kernels run; else a column-sum kernel). `first`: the step's
    /// first micro-batch, whose weight-gradient matmuls overwrite the (unzeroed) matrices'
    /// gradients; later ones add.
    pub(super) fn backward(&self, a: &Activations, first: bool) -> Result<()> {
        let run = self.backward_streams(a, first);
        if run.is_err() {
            // A pass that failed midway still leaves nothing running on the side stream
            // behind the main stream's back (the caller may free or resize the buffers).
            if let Some(s) = self.side() {
                let _ = s.join();
            }
        }
        run
    }

    /// The MLP activation's backward of layer `l`: from the residual gradient `sc·dy` (in the
    /// scratch `dy_buf`: `dres`, or its dropout-masked copy; `sc` a scale still owed to it,
    /// which only the SwiGLU path's matmuls take) through the down projection (`down`) to the
    /// pre-activation's gradient in `dh`; its width (the up projection's output: F, or 2F for
    /// SwiGLU's packed gate|up).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp_act_bwd(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        (dy, dy_buf, sc): (u64, Buf, f32),
        down: Lin,
        first: bool,
    ) -> Result<usize> {
        let (n, f) = (a.n, self.hidden);
        let dact = if self.swiglu { a.dact } else { a.dh };
        // The down projection's adapter adds into its input's gradient, before the
        // activation's backward (so no fused GELU backward with one).
        let adapted = li.lora[DOWN].is_some();
        if self.swiglu {
            let beta = self.lora_bwd(
                a,
                (l, li, G_DOWN),
                a.act[l],
                (dy, dy_buf, sc),
                self.c,
                dact,
                first,
            )?;
            self.lin_dx_ab(dy, self.matmul_weight(li.down_w)?, dact, down, (sc, beta))?;
            self.launch(
                &self.k.swiglu_bwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(dact),
                    Arg::P(a.dh),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                    Arg::I(self.geglu as i32),
                ],
            )?;
            return Ok(2 * f);
        }
        // The GELU backward fused into the down projection's data gradient (its variant with
        // the bias gradient, DGELU_BGRAD, has no fp32 bias output and ran 3× slower in bf16:
        // the column sum stays).
        let dgelu = Epi::DGelu {
            aux: a.fc[l],
            ld: f,
        };
        check(sc == 1.0, || {
            "the GELU MLP's backward was handed a residual gradient with a scale owed".into()
        })?;
        let wd = self.matmul_weight(li.down_w)?;
        let mm = down.dx(dy, wd, a.dh);
        if adapted || !self.lin_lt("matmul dgrad+dgelu", mm, false, 0.0, dgelu)? {
            let dyb = (dy, dy_buf, 1.0);
            let beta = self.lora_bwd(a, (l, li, G_DOWN), a.act[l], dyb, self.c, a.dh, first)?;
            self.lin_dx_beta(dy, wd, a.dh, down, beta)?;
            // (fc holds the pre-activation with its bias: no bias here)
            self.launch(
                &self.k.gelu_bwd,
                flat_cfg(n * f / 8),
                &[
                    Arg::P(a.fc[l]),
                    Arg::P(0),
                    Arg::P(a.dh),
                    Arg::P(a.dh),
                    Arg::P((n * f / 8) as u64),
                    Arg::I(i32_of(f / 8, "hidden")?),
                ],
            )?;
        }
        Ok(f)
    }

    /// Whether neither the weight `w` nor the bias `b` of a projection takes a gradient
    /// ([`Self::proj_grads`] has nothing to do).
    pub(super) fn proj_frozen(&self, w: usize, b: Option<usize>) -> bool {
        self.trained_grad_ptr(w).is_none() && self.grad_ptr_or_null(b) == 0
    }

    /// A projection's weight and bias gradients from its output gradient `dy` (in the
    /// scratch buffer `buf`, row stride `d.out`): the bias's column sum (unless `bias_done`:
    /// the norm backward summed it) and the weight-gradient matmul, on the side stream where
    /// there is one (which then releases `buf`); nothing for a frozen weight and bias.
    pub(super) fn proj_grads(
        &self,
        (x, dy, buf): (u64, u64, Buf),
        (w, b, bias_done): (usize, Option<usize>, bool),
        d: Lin,
        first: bool,
    ) -> Result<()> {
        let gw = self.trained_grad_ptr(w);
        let gbias = if bias_done {
            0
        } else {
            self.grad_ptr_or_null(b)
        };
        if gw.is_none() && gbias == 0 {
            return Ok(());
        }
        let side = self.fork()?;
        if gbias != 0 {
            self.col_sum_on(side.unwrap_or(&self.stream), dy, gbias, d.rows, d.out)?;
        }
        if let Some(gw) = gw {
            self.lin_dw_on(side, x, dy, gw, d, first)?;
        }
        self.release(buf)
    }

    /// [`Self::backward`]'s launches.
    pub(super) fn backward_streams(&self, a: &Activations, first: bool) -> Result<()> {
        let (b, t, c, f) = (a.b, self.t, self.c, self.hidden);
        let n = b * t;
        let nc = n * c;
        let n_i = i32_of(n, "rows")?;
        // (The head's backward ran with the loss: `da` holds d(lnf).)
        self.logit_scale(a, a.da, n)?;
        // d(final residual) = the final norm's backward
        let last = self.n_layer;
        // The norm backward sums the residual gradient's columns into the projection bias
        // below it as it goes — unless dropout sits between them.
        let fuse = |g: u64| if self.res_scaled() { 0 } else { g };
        let down_b = |l: usize| {
            fuse(
                self.layers
                    .get(l)
                    .map_or(0, |li| self.grad_ptr_or_null(li.down_b)),
            )
        };
        let mut down_b_done = self.norm_bwd(
            a.res[last],
            self.lnf,
            (a.da, c),
            a.dres,
            a.stats[2 * last],
            n,
            (false, false),
            down_b(last - 1),
        )?;
        // Weight gradients and bias sums go to the side stream when there is one (`fork`),
        // which marks its reads of each scratch gradient done (`release`) for the main stream
        // to wait on before it rewrites that buffer (`reclaim`); the main stream keeps the
        // chain of data gradients (and the LoRA adapters' small matmuls).
        let offload = self.arena.as_ref().and_then(|a| a.offload.as_ref());
        for (l, li) in self.layers.iter().enumerate().rev() {
            if let Some(o) = offload {
                // (block l + 1's slot, which block l − 1's input refills)
                o.backward_block(l, a.res[l.saturating_sub(1)])?;
            }
            if self.recompute.whole_block() {
                self.attn_half_fwd(a, l, li)?;
                self.mlp_half_fwd(a, l, li)?;
            }
            // MLP down projection: res[l+1] = mid + act·Wdownᵀ (+ b)
            let post_m = li.post.map(|p| p.1);
            // (Granite's residual multiplier goes into the matmuls' alpha where only they
            // read the gradient: no post-norm, SwiGLU, no weight or bias gradient here.)
            let fold = post_m.is_none() && self.swiglu && self.proj_frozen(li.down_w, li.down_b);
            let (dyb, sc) = self.drop_grad(a, dropout::site_mlp_out(l), fold)?;
            let post_x = (
                a.post_in.get(l).map_or(0, |p| p[1]),
                a.post_stats.get(l).map_or(0, |p| p[1]),
            );
            let (dy, dy_buf) = self.out_norm_bwd(a, post_m, post_x, dyb)?;
            let (gate_col, up_col) = (0, if self.gate_apart() { f } else { 0 });
            check(
                li.lora[GATE].is_none_or(|g| g.col == gate_col)
                    && li.lora[UP].is_none_or(|u| u.col == up_col),
                || {
                    format!(
                        "layer {l}'s gate/up adapters do not start at columns {gate_col}/{up_col}"
                    )
                },
            )?;
            // The MLP's backward, a chunk of rows at a time where its activations are
            // recomputed ([`Self::mlp_rows`]; each chunk's recomputed first): the weights'
            // gradients add up over the chunks, the normed input's gradient goes to its rows.
            let mut ldg = c;
            for (k, (r0, w)) in self.mlp_chunks(a, l, li).enumerate() {
                let (rows, w) = (w.n, &*w);
                let first = first && k == 0;
                if self.recompute.whole_block() {
                    self.mlp_act_fwd(w, l, li)?;
                }
                let dy = dy + 2 * (r0 * c) as u64;
                let down = Lin::new(rows, f, c, c);
                let bias = (li.down_w, li.down_b, down_b_done);
                self.proj_grads((w.act[l], dy, dy_buf), bias, down, first)?;
                self.reclaim(Buf::Dh)?;
                let up_out = self.mlp_act_bwd(w, l, li, (dy, dy_buf, sc), down, first)?;
                let up = Lin::new(rows, c, up_out, up_out);
                let bias = (li.up_w, li.up_b, false);
                self.proj_grads((w.ln2[l], w.dh, Buf::Dh), bias, up, first)?;
                let dh = (w.dh, Buf::Dh);
                ldg = self.group_bwd(w, (l, li, G_GU), w.ln2[l], dh, up, first)?;
            }
            // (A hybrid's routed experts read the same output gradient: their share of the
            // normed input's gradient adds to the shared MLP's; their MLP is one chunk.)
            let moe_dy = (dy, sc);
            self.moe_bwd(a, l, li, moe_dy, ldg)?;
            self.reclaim(Buf::Dres)?;
            let o_b_done = self.norm_bwd(
                a.mid[l],
                (li.ln2_w, li.ln2_b),
                (a.da, ldg),
                a.dres,
                a.stats[2 * l + 1],
                n,
                (true, true),
                fuse(self.grad_ptr_or_null(li.o_b)),
            )?;
            if self.recompute == Recompute::Attention {
                self.attn_half_fwd(a, l, li)?;
            }
            // the mixer's output projection: mid = res + dropout(atty·Woᵀ (+ bo))
            let o = Lin::new(n, self.mixer_width(li), c, c);
            let post_a = li.post.map(|p| p.0);
            let fold = post_a.is_none() && self.proj_frozen(li.o_w, li.o_b);
            let (dyb, sc) = self.drop_grad(a, dropout::site_attention_out(l), fold)?;
            let post_x = (
                a.post_in.get(l).map_or(0, |p| p[0]),
                a.post_stats.get(l).map_or(0, |p| p[0]),
            );
            let (dy, dy_buf) = self.out_norm_bwd(a, post_a, post_x, dyb)?;
            self.proj_grads(
                (a.atty[l], dy, dy_buf),
                (li.o_w, li.o_b, o_b_done),
                o,
                first,
            )?;
            let dyb = (dy, dy_buf, sc);
            let beta = self.lora_bwd(a, (l, li, G_O), a.atty[l], dyb, c, a.da, first)?;
            self.lin_dx_ab(dy, self.matmul_weight(li.o_w)?, a.da, o, (sc, beta))?;
            self.reclaim(Buf::Dqkv)?;
            self.mixer_bwd(a, l, li)?;
            // qkv projection (a Mamba layer's in_proj)
            let width = self.in_width(li);
            let qkv = Lin::new(n, c, width, width);
            let bias = (li.qkv_w, li.qkv_b, false);
            self.proj_grads((a.ln1[l], a.dqkv, Buf::Dqkv), bias, qkv, first)?;
            let dqkv = (a.dqkv, Buf::Dqkv);
            let ldg = self.group_bwd(a, (l, li, G_QKV), a.ln1[l], dqkv, qkv, first)?;
            self.reclaim(Buf::Dres)?;
            // The residual stream's gradient below this layer: the down projection bias's
            // gradient of the layer below (none under layer 0).
            let below = l.checked_sub(1).map_or(0, down_b);
            down_b_done = self.norm_bwd(
                a.res[l],
                (li.ln1_w, li.ln1_b),
                (a.da, ldg),
                a.dres,
                a.stats[2 * l],
                n,
                (true, true),
                below,
            )?;
            self.send_sums(Some(l))?;
        }
        self.embed_scale(a, a.dres, n)?;
        // embeddings: token rows by an atomic scatter, positions summed over the batch
        if let Some(gw) = self.trained_grad_ptr(self.wte) {
            self.launch(
                &self.k.embedding_bwd,
                flat_cfg(nc),
                &[
                    Arg::P(a.ids),
                    Arg::P(a.dres),
                    Arg::P(gw),
                    Arg::I(n_i),
                    Arg::I(i32_of(c, "n_embd")?),
                    Arg::I(i32_of(self.vocab, "vocab")?),
                ],
            )?;
        }
        if let Some(gp) = self.wpe.and_then(|i| self.trained_grad_ptr(i)) {
            self.col_sum(a.dres, gp, b, t * c)?;
        }
        self.send_sums(None)?;
        // The optimizer reads every gradient, and a capture must end joined.
        self.side().map_or(Ok(()), Side::join)
    }
}
