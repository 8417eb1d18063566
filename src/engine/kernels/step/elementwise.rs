//! Row and element kernels: norms (with the residual add), dropout, bias and activation,
//! column sums.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, LaunchConfig};
use candle_core::Result;

use super::arena::Activations;
use super::{Arg, ModelStep};
use crate::engine::dropout;
use crate::engine::kernels::cuda::{err, flat_cfg, i32_of, row_cfg};
use crate::engine::kernels::side::Buf;

impl ModelStep {
    /// The grid of the column-sum kernels over `[n, c]` (blocks of 32 × 8 threads, 256
    /// columns each): about two blocks per multiprocessor in all, enough loads in flight (a
    /// few rows per thread) and few atomics per column.
    pub(super) fn col_grid(&self, n: usize, c: usize) -> LaunchConfig {
        let col_blocks = c.div_ceil(256);
        let row_blocks = (2 * self.k.sms / col_blocks)
            .clamp(1, n.div_ceil(8).max(1))
            .min(65535);
        LaunchConfig {
            grid_dim: (col_blocks as u32, row_blocks as u32, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out[c] += Σ_rows x[r, c]` (fp32; c a multiple of 8).
    pub(super) fn col_sum(&self, x: u64, out: u64, n: usize, c: usize) -> Result<()> {
        self.col_sum_on(&self.stream, x, out, n, c)
    }

    /// [`Self::col_sum`] on `stream` (the step's, or the side stream).
    pub(super) fn col_sum_on(
        &self,
        stream: &Arc<CudaStream>,
        x: u64,
        out: u64,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let cfg = self.col_grid(n, c);
        self.launch_on(
            stream,
            &self.k.col_sum,
            cfg,
            &[
                Arg::P(x),
                Arg::P(out),
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(c, "cols")?),
            ],
        )
    }

    /// The norm backward (LayerNorm or RMSNorm) of rows `x` with the weight and bias entries
    /// `(w, b)`, from the forward's row statistics `stats` (which the v8 kernels need):
    /// dx (+)= …, the weight (and bias) gradients accumulate. Where `bias_grad` is non-zero
    /// and the v8 kernels run, `bias_grad += Σ_rows dx` too (the residual stream's gradient
    /// is the bias gradient of the linear layer that wrote into it): Ok(true) says so. `pre`:
    /// a block's input norm (none in OLMo 2's post-norm blocks: dx (+)= dy).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_bwd(
        &self,
        x: u64,
        (w, b): (usize, Option<usize>),
        (dy, ldg): (u64, usize),
        dx: u64,
        stats: u64,
        n: usize,
        (add, pre): (bool, bool),
        bias_grad: u64,
    ) -> Result<bool> {
        let d = self.c;
        let (n_i, d_i) = (i32_of(n, "rows")?, i32_of(d, "dim")?);
        let ldg_i = i32_of(ldg, "row stride")?;
        // (OLMo 2's blocks have no norm before attention and MLP: no weight either.)
        let ident = pre && self.post_norm;
        let (dw, db) = if ident {
            (0, 0)
        } else {
            (
                self.trained_grad_ptr(w).unwrap_or(0),
                self.grad_ptr_or_null(b),
            )
        };
        let rms = Arg::I(self.flags(pre));
        if let Some(v8) = &self.k.norm_v8 {
            // Two passes: dx with 16-byte accesses and rows in registers, then the column
            // sums (the forward's statistics in both).
            let cfg = LaunchConfig {
                grid_dim: (v8.bwd_grid.min(n.div_ceil(8).max(1) as u32), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [
                Arg::P(x),
                Arg::P(self.weight_ptr(w)?),
                Arg::P(dy),
                Arg::P(dx),
                Arg::P(stats),
                Arg::I(n_i),
                Arg::I(d_i),
                Arg::F(self.eps),
                Arg::I(add as i32),
                rms,
                Arg::I(ldg_i),
            ];
            self.launch(&v8.bwd, cfg, &args)?;
            let args = [
                Arg::P(x),
                Arg::P(dy),
                Arg::P(dx),
                Arg::P(stats),
                Arg::P(dw),
                Arg::P(db),
                Arg::P(bias_grad),
                Arg::I(n_i),
                Arg::I(d_i),
                Arg::I(ldg_i),
            ];
            if dw != 0 || db != 0 || bias_grad != 0 {
                self.launch(&v8.bwd_wb, self.col_grid(n, d), &args)?;
            }
            return Ok(bias_grad != 0);
        }
        // (Strided rows only come with the rows-in-registers kernels: [`Self::concat_ok`].)
        if ldg != d {
            return Err(err(
                "whole-model step: a strided norm gradient without the v8 kernels",
            ));
        }
        let args = [
            Arg::P(x),
            Arg::P(self.weight_ptr(w)?),
            Arg::P(dy),
            Arg::P(dx),
            Arg::P(dw),
            Arg::P(db),
            Arg::I(n_i),
            Arg::I(d_i),
            Arg::F(self.eps),
            rms,
        ];
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(8).clamp(1, 264) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (2 * d * 4) as u32,
        };
        let k = if add {
            &self.k.norm_bwd_add
        } else {
            &self.k.norm_bwd
        };
        self.launch(k, cfg, &args)?;
        Ok(false)
    }

    /// The norm kernels' `rms` flag for a block's input norm (`pre`) or another one: bit 0
    /// RMSNorm, bit 1 the weights scale as 1 + w (Gemma), bit 2 no norm (a block's input in
    /// OLMo 2's post-norm blocks: the residual stream as it is).
    pub(super) fn flags(&self, pre: bool) -> i32 {
        i32::from(self.rms)
            | (i32::from(self.plus_one) << 1)
            | (i32::from(pre && self.post_norm) << 2)
    }

    /// What the QK-norm kernels add to each weight: 1 for Gemma's 1 + w, else 0.
    pub(super) fn woff(&self) -> f32 {
        if self.plus_one {
            1.0
        } else {
            0.0
        }
    }

    /// Gemma's sandwich, forward: `tmp = Norm(x)` with the output norm's weight `w`, the rows'
    /// statistics into `stats` (what the residual add then reads as its `y`).
    pub(super) fn out_norm(&self, a: &Activations, w: usize, (x, stats): (u64, u64)) -> Result<()> {
        let n = a.b * self.t;
        let ln = (w, None, stats);
        self.residual_norm(a, (x, 0, 0, None), 0, ln, (a.tmp, self.c), (n, false))
    }

    /// Gemma's sandwich, backward: the gradient `dy` of an output norm's output (in the scratch
    /// `buf`) through that norm (weight `post`, input `x`, statistics `stats`) into `dpost`, its
    /// weight's gradient added; without a norm there, `dy` itself.
    pub(super) fn out_norm_bwd(
        &self,
        a: &Activations,
        post: Option<usize>,
        (x, stats): (u64, u64),
        (dy, buf): (u64, Buf),
    ) -> Result<(u64, Buf)> {
        let Some(w) = post else {
            return Ok((dy, buf));
        };
        self.reclaim(Buf::Dpost)?;
        let n = a.b * self.t;
        self.norm_bwd(
            x,
            (w, None),
            (dy, self.c),
            a.dpost,
            stats,
            n,
            (false, false),
            0,
        )?;
        Ok((a.dpost, Buf::Dpost))
    }

    /// The output gradient of a projection whose output went through dropout at `site` into
    /// the residual stream: `dres` through the mask (into `dmask`), or `dres` itself without
    /// dropout; the scratch buffer that is ([`Buf`], for the side stream's reads); and the
    /// scale still owed to it. Where no mask sits there but Granite's residual multiplier
    /// does, and `fold` (its readers are matmuls that take the scale as their alpha), that is
    /// `dres` itself with the multiplier owed: no pass of its own over the gradient.
    pub(super) fn drop_grad(
        &self,
        a: &Activations,
        site: u32,
        fold: bool,
    ) -> Result<((u64, Buf), f32)> {
        if !self.res_scaled() {
            return Ok(((a.dres, Buf::Dres), 1.0));
        }
        if fold && self.drop_thr == 0 {
            return Ok(((a.dres, Buf::Dres), self.res_mult));
        }
        self.reclaim(Buf::Dmask)?;
        let (rows, scale) = (a.b * self.t, self.keep_scale() * self.res_mult);
        let drop = (self.drop_thr, scale);
        self.drop_scaled(a, (a.dres, a.dmask), (rows, self.c), site, drop, false)?;
        Ok(((a.dmask, Buf::Dmask), 1.0))
    }

    /// A kept element's dropout scale: 1 while dropout is off (an evaluation's forward).
    pub(super) fn keep_scale(&self) -> f32 {
        if self.drop_thr > 0 {
            self.drop_scale
        } else {
            1.0
        }
    }

    /// Whether a mask or a scale sits between a block's output projections and the residual
    /// stream (dropout, Granite's residual multiplier).
    pub(super) fn res_scaled(&self) -> bool {
        self.drop_thr > 0 || self.res_mult != 1.0
    }

    /// The embedding's dropout and Granite's multiplier, in place on `x` (`[n, C]`), in the
    /// forward and on its gradient in the backward.
    pub(super) fn embed_scale(&self, a: &Activations, x: u64, n: usize) -> Result<()> {
        if self.drop_thr == 0 && self.emb_mult == 1.0 {
            return Ok(());
        }
        let (site, scale) = (dropout::site_embedding(), self.keep_scale() * self.emb_mult);
        self.drop_scaled(a, (x, x), (n, self.c), site, (self.drop_thr, scale), false)
    }

    /// Granite's 1/logits_scaling, in place on the final norm's output `[n, C]` (forward) and
    /// on its gradient (backward): the logits and the head's gradients scale with it.
    pub(super) fn logit_scale(&self, a: &Activations, x: u64, n: usize) -> Result<()> {
        if self.logit_mult == 1.0 {
            return Ok(());
        }
        self.drop_scaled(a, (x, x), (n, self.c), 0, (0, self.logit_mult), false)
    }

    /// `y = scale·mask(x)` over `[rows, cols]` at `site` (`thr` 0: no mask, only the scale),
    /// or `y += scale·mask(x)` with `acc`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn drop_scaled(
        &self,
        a: &Activations,
        (x, y): (u64, u64),
        (rows, cols): (usize, usize),
        site: u32,
        drop: (u32, f32),
        acc: bool,
    ) -> Result<()> {
        self.drop_scaled_ld(a, ((x, cols), (y, cols)), (rows, cols), site, drop, acc)
    }

    /// [`Self::drop_scaled`] between matrices whose rows lie `ldx` and `ldy` apart (multiples
    /// of 8; the columns of a LoRA group's `[x | u]` or `[dx | du]`: [`Cat`](super::lora::Cat)).
    pub(super) fn drop_scaled_ld(
        &self,
        a: &Activations,
        ((x, ldx), (y, ldy)): ((u64, usize), (u64, usize)),
        (rows, cols): (usize, usize),
        site: u32,
        (thr, scale): (u32, f32),
        acc: bool,
    ) -> Result<()> {
        let total8 = rows * cols / 8;
        self.launch(
            &self.k.dropout_rows,
            flat_cfg(total8),
            &[
                Arg::P(x),
                Arg::P(y),
                Arg::P(total8 as u64),
                Arg::I(i32_of(cols / 8, "cols")?),
                Arg::P(a.seed),
                Arg::U(site),
                Arg::U(thr),
                Arg::F(scale),
                Arg::I(acc as i32),
                Arg::I(i32_of(ldx / 8, "row stride")?),
                Arg::I(i32_of(ldy / 8, "row stride")?),
                Arg::L(a.row0 as i64),
            ],
        )
    }

    /// `res = x + dropout(y (+ bias))` (y = 0: res is x; the dropout at `site` where the model
    /// has one), `out = Norm(res)` with the weight and bias entries of `ln`, whose third part
    /// receives the rows' statistics for the backward (`pre`: a block's input norm, none in
    /// OLMo 2's post-norm blocks: out = res).
    pub(super) fn residual_norm(
        &self,
        a: &Activations,
        (x, y, bias, site): (u64, u64, u64, Option<u32>),
        res: u64,
        (w, bn, stats): (usize, Option<usize>, u64),
        (out, ldo): (u64, usize),
        (n, pre): (usize, bool),
    ) -> Result<()> {
        let (thr, scale) = site.map_or((0, 1.0), |_| {
            (self.drop_thr, self.keep_scale() * self.res_mult)
        });
        let mut args = vec![
            Arg::P(x),
            Arg::P(y),
            Arg::P(bias),
            Arg::P(res),
            Arg::P(self.weight_ptr(w)?),
            Arg::P(self.weight_ptr_or_null(bn)?),
            Arg::P(out),
        ];
        let tail = [
            Arg::I(i32_of(n, "rows")?),
            Arg::I(i32_of(self.c, "n_embd")?),
            Arg::F(self.eps),
            Arg::I(self.flags(pre)),
            Arg::P(a.seed),
            Arg::U(site.unwrap_or(0)),
            Arg::U(thr),
            Arg::F(scale),
            Arg::I(i32_of(ldo, "row stride")?),
        ];
        match &self.k.norm_v8 {
            Some(v8) => {
                let cfg = LaunchConfig {
                    grid_dim: (v8.grid.min(n.div_ceil(8).max(1) as u32), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                args.push(Arg::P(stats));
                args.extend(tail);
                self.launch(&v8.fwd, cfg, &args)
            }
            None => {
                args.extend(tail);
                self.launch(&self.k.residual_norm, row_cfg(n), &args)
            }
        }
    }

    /// `y[n, c] = x + b` (`mode` 0) or `gelu(x + b)` (`mode` 1); c a multiple of 8, y may
    /// be x.
    pub(super) fn bias_act(
        &self,
        x: u64,
        b: u64,
        y: u64,
        n: usize,
        c: usize,
        mode: i32,
    ) -> Result<()> {
        self.launch(
            &self.k.bias_act,
            flat_cfg(n * c / 8),
            &[
                Arg::P(x),
                Arg::P(b),
                Arg::P(y),
                Arg::P((n * c / 8) as u64),
                Arg::I(i32_of(c / 8, "cols")?),
                Arg::I(mode),
            ],
        )
    }
}
