//! Attention: RoPE, flash attention or materialised softmax, and head layout changes.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::Result;

use super::arena::Activations;
use super::gemm::{bmat, Lin};
use super::kernels::Kern;
use super::params::{LayerIdx, G_QKV};
use super::{check, ptr, Arg, ModelStep};
use crate::engine::dropout;
use crate::engine::kernels::cuda::{err, flat_cfg, i32_of, row_cfg};
use crate::engine::spec::RopeFreqs;

/// RoPE's rotations for positions 0..t: `[t][inv_freq.len()]` pairs (cos, sin) of
/// position·inv_freq[j], × the table's factor (LongRoPE's attention factor, else 1), as
/// interleaved f32, the angles taken in double (their sines at hundreds of radians need it).
pub(super) fn rope_table(freqs: &RopeFreqs, t: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(2 * t * freqs.inv_freq.len());
    for p in 0..t {
        for &f in &freqs.inv_freq {
            let (sin, cos) = (p as f64 * f).sin_cos();
            out.extend([(cos * freqs.scale) as f32, (sin * freqs.scale) as f32]);
        }
    }
    out
}

impl ModelStep {
    /// A block's mixer from its normed input `ln1[l]`: qkv = ln1·Wqkvᵀ (+ b) (+ the
    /// adapters), QK-norm, RoPE, attention into `atty[l]` — or, on a hybrid's Mamba layer,
    /// in_proj's output `z | x B C | dt` into `qkv[l]` and the Mamba mixer into `atty[l]`.
    pub(super) fn attention(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let (n, c) = (a.b * self.t, self.c);
        let width = self.in_width(li);
        let qkv = Lin::new(n, c, width, width);
        self.group_fwd(a, (l, li, G_QKV), a.ln1[l], li.qkv_b, a.qkv[l], qkv)?;
        if li.mamba.is_some() {
            return self.mamba_fwd(a, l, li);
        }
        self.qk_norm(a, l, li, false)?;
        self.rope(a, (a.qkv[l], l), n, false)?;
        self.attn_fwd(a, l)
    }

    /// The mixer's backward of layer `l`, from `da` (d atty) to `dqkv` (the packed input
    /// projection's output gradient): the attention's, RoPE's inverse and the QK-norm's —
    /// or a Mamba layer's.
    pub(super) fn mixer_bwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        if li.mamba.is_some() {
            return self.mamba_bwd(a, l, li);
        }
        self.attn_bwd(a, l)?;
        self.rope(a, (a.dqkv, l), a.b * self.t, true)?;
        self.qk_norm(a, l, li, true)
    }

    /// The output width of layer `li`'s packed input projection: q|k|v's (H + 2·KV)·hd, or a
    /// Mamba layer's in_proj `inner + conv channels + heads`.
    pub(super) fn in_width(&self, li: &LayerIdx) -> usize {
        match (li.mamba, &self.mamba) {
            (Some(_), Some(m)) => m.in_w(),
            _ => self.qkv_out,
        }
    }

    /// The width of layer `li`'s mixer output (its output projection's input): the
    /// attention's n_head·head_dim, or a Mamba layer's inner width.
    pub(super) fn mixer_width(&self, li: &LayerIdx) -> usize {
        match (li.mamba, &self.mamba) {
            (Some(_), Some(m)) => m.inner(),
            _ => self.att_c,
        }
    }

    /// Causal self-attention of layer `l`: packed `qkv[l]` → `atty[l]` `[B·T, C]`.
    pub(super) fn attn_fwd(&self, a: &Activations, l: usize) -> Result<()> {
        let (b, t, h) = (a.b, self.t, self.n_head);
        let hd = self.hd;
        let bh = b * h;
        let scale = self.att_scale;
        if self.flash {
            let fk = self.flash_kernels()?;
            let kern = if self.drop_thr > 0 {
                &fk.fwd_drop
            } else {
                &fk.fwd
            };
            return self.launch(
                kern,
                self.flash_grid(b, h, fk.fwd_smem, fk.fwd_block),
                &[
                    Arg::P(a.qkv[l]),
                    Arg::P(a.atty[l]),
                    Arg::P(a.lse_att[l]),
                    Arg::I(i32_of(b, "B")?),
                    Arg::I(i32_of(t, "T")?),
                    Arg::I(i32_of(h, "H")?),
                    Arg::I(i32_of(self.n_kv_head, "KV heads")?),
                    Arg::F(scale),
                    Arg::P(a.seed),
                    Arg::U(dropout::site_attention(l)),
                    Arg::U(self.drop_thr),
                    Arg::F(self.drop_scale),
                    Arg::P(a.mbits.get(l).copied().unwrap_or(0)),
                    Arg::P(self.lows_ptr(a, l)),
                    Arg::F(self.flash_cap()?),
                ],
            );
        }
        // attention: split heads (key/value heads repeated for their query heads), S = Q·Kᵀ,
        // P = causal softmax(scale·S) (within the window on a sliding layer), Y = P·V, merge
        let (q, k, v) = self.split_heads(a, a.qkv[l])?;
        self.gemm(
            "attention matmul",
            (true, false),
            (t, t, hd),
            bmat(k, hd, t * hd),
            bmat(q, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            false,
            0.0,
            bh,
        )?;
        self.softmax(
            &self.k.softmax_fwd,
            &[a.prob[l], a.prob[l]],
            (bh * t, l, a.lse_att.get(l).copied()),
            scale,
        )?;
        self.gemm(
            "attention matmul",
            (false, false),
            (hd, t, t),
            bmat(v, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            bmat(a.yh, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        self.heads(&self.k.heads_merge, a.yh, a.atty[l], b, self.att_c, 0)?;
        Ok(())
    }

    /// The attention backward of layer `l`: `da` (d atty) → `dqkv`.
    pub(super) fn attn_bwd(&self, a: &Activations, l: usize) -> Result<()> {
        let (b, t, h) = (a.b, self.t, self.n_head);
        let hd = self.hd;
        let nc = b * t * self.att_c;
        let bh = b * h;
        let scale = self.att_scale;
        if self.flash {
            // (the dq accumulator at the scratch's start: [B·T, n_head·head_dim] with T rounded
            // up to 16, then delta)
            let nc = self.dq_acc_len(b);
            let (bi, ti, hi) = (i32_of(b, "B")?, i32_of(t, "T")?, i32_of(h, "H")?);
            let kvi = i32_of(self.n_kv_head, "KV heads")?;
            let delta = a.fa_scratch + 4 * nc as u64;
            let rows = b * t * h;
            let fk = self.flash_kernels()?;
            self.launch(
                &fk.pre,
                LaunchConfig {
                    // (it zeroes the padded accumulator: nc / head_dim rows)
                    grid_dim: ((nc / hd).div_ceil(32) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.atty[l]),
                    Arg::P(a.da),
                    Arg::P(delta),
                    Arg::P(a.fa_scratch),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                ],
            )?;
            // (one query head a block, or one key/value head's group)
            let heads = if fk.per_head { h } else { self.n_kv_head };
            self.launch(
                &fk.bwd,
                self.flash_grid(b, heads, fk.bwd_smem, fk.bwd_block),
                &[
                    Arg::P(a.qkv[l]),
                    Arg::P(a.da),
                    Arg::P(a.lse_att[l]),
                    Arg::P(delta),
                    Arg::P(a.fa_scratch),
                    Arg::P(a.dqkv),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                    Arg::I(kvi),
                    Arg::F(scale),
                    Arg::U(self.drop_thr),
                    Arg::F(self.drop_scale),
                    Arg::P(a.mbits.get(l).copied().unwrap_or(0)),
                    Arg::P(self.lows_ptr(a, l)),
                    Arg::F(self.flash_cap()?),
                    Arg::P(a.fa_kv_part),
                ],
            )?;
            if let (Some(sum), true) = (&fk.kv_sum, fk.per_head && self.fa_per_head_kv()) {
                // each key/value head's dK, dV: the sum of its query heads' shares
                let threads = b * t * self.n_kv_head * 2 * hd / 8;
                self.launch(
                    sum,
                    LaunchConfig {
                        grid_dim: (threads.div_ceil(256) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    },
                    &[
                        Arg::P(a.fa_kv_part),
                        Arg::P(a.dqkv),
                        Arg::I(bi),
                        Arg::I(ti),
                        Arg::I(hi),
                        Arg::I(kvi),
                    ],
                )?;
            }
            // (slabs: a block each, nc / 1024 of them; rows: a float4 a thread)
            let dq_blocks = if fk.dq_slabs {
                nc / 1024
            } else {
                (rows * hd / 4).div_ceil(256)
            };
            return self.launch(
                &fk.dq,
                LaunchConfig {
                    grid_dim: (dq_blocks as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::P(a.fa_scratch),
                    Arg::P(a.dqkv),
                    Arg::I(bi),
                    Arg::I(ti),
                    Arg::I(hi),
                    Arg::I(kvi),
                    Arg::F(scale),
                ],
            );
        }
        // attention core, from the saved probabilities
        let (q, k, vv) = self.split_heads(a, a.qkv[l])?;
        let (dq, dk, dv) = (a.dheads, a.dheads + 2 * nc as u64, a.dheads + 4 * nc as u64);
        self.heads(&self.k.heads_split, a.da, a.dyh, b, self.att_c, 0)?;
        // dP = dY·Vᵀ
        self.gemm(
            "attention matmul",
            (true, false),
            (t, t, hd),
            bmat(vv, hd, t * hd),
            bmat(a.dyh, hd, t * hd),
            bmat(a.dprob, t, t * t),
            false,
            0.0,
            bh,
        )?;
        // dV = Pᵀ·dY
        self.gemm(
            "attention matmul",
            (false, true),
            (hd, t, t),
            bmat(a.dyh, hd, t * hd),
            bmat(a.prob[l], t, t * t),
            bmat(dv, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        // dS = softmax backward (scale folded in), in place
        self.softmax(
            &self.k.softmax_bwd,
            &[a.prob[l], a.dprob, a.dprob],
            (bh * t, l, a.lse_att.get(l).copied()),
            scale,
        )?;
        // dQ = dS·K, dK = dSᵀ·Q
        self.gemm(
            "attention matmul",
            (false, false),
            (hd, t, t),
            bmat(k, hd, t * hd),
            bmat(a.dprob, t, t * t),
            bmat(dq, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        self.gemm(
            "attention matmul",
            (false, true),
            (hd, t, t),
            bmat(q, hd, t * hd),
            bmat(a.dprob, t, t * t),
            bmat(dk, hd, t * hd),
            false,
            0.0,
            bh,
        )?;
        self.heads(&self.k.heads_merge, dq, a.dqkv, b, self.qkv_out, 0)?;
        // dk, dv per query head, summed per key/value head
        self.launch(
            &self.k.kv_grads_merge,
            flat_cfg(b * t * self.n_kv_head * hd),
            &[
                Arg::P(dk),
                Arg::P(dv),
                Arg::P(a.dqkv),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(self.n_kv_head, "KV heads")?),
                Arg::I(i32_of(hd, "hd")?),
            ],
        )
    }

    /// Materialised attention: packed `qkv` → q, k, v heads `[B, H, T, hd]` in the arena's
    /// `heads` (key/value heads repeated for their query heads).
    fn split_heads(&self, a: &Activations, qkv: u64) -> Result<(u64, u64, u64)> {
        let (b, t, h, hd) = (a.b, self.t, self.n_head, self.hd);
        let nh = (b * t * self.att_c) as u64;
        let (q, k, v) = (a.heads, a.heads + 2 * nh, a.heads + 4 * nh);
        self.launch(
            &self.k.qkv_split,
            flat_cfg(b * t * self.att_c),
            &[
                Arg::P(qkv),
                Arg::P(q),
                Arg::P(k),
                Arg::P(v),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(self.n_kv_head, "KV heads")?),
                Arg::I(i32_of(hd, "hd")?),
            ],
        )?;
        Ok((q, k, v))
    }

    /// Flash attention's grid: (B·heads, blocks of `rows` queries or keys), `threads` a block;
    /// the forward runs a block per query head, the backward per key/value head.
    pub(super) fn flash_grid(
        &self,
        b: usize,
        heads: usize,
        smem: u32,
        (threads, rows): (u32, usize),
    ) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((b * heads) as u32, self.t.div_ceil(rows) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        }
    }

    /// RoPE in place on the q and k heads of packed projections `[rows, (H + 2·KV)·hd]` of
    /// layer `l` (its table: the model's, or a sliding layer's own) (`inverse`: rotate back,
    /// for their gradients); packed rows' positions restart at each sample.
    pub(super) fn rope(
        &self,
        a: &Activations,
        (qkv, l): (u64, usize),
        rows: usize,
        inverse: bool,
    ) -> Result<()> {
        let local = self.local_rope.get(l).copied().unwrap_or(false);
        let Some(table) = (if local { &self.rope_local } else { &self.rope }) else {
            return Ok(());
        };
        let nh = self.n_head + self.n_kv_head;
        // (kernels.cu: four pairs a thread where rd/2 is a multiple of 4; rd: the rotary dims)
        let half = self.rotary_dim / 2;
        let per = if half.is_multiple_of(4) {
            half / 4
        } else {
            half
        };
        self.launch(
            &self.k.rope,
            flat_cfg(rows * nh * per),
            &[
                Arg::P(qkv),
                Arg::I(i32_of(rows, "rows")?),
                Arg::I(i32_of(self.t, "T")?),
                Arg::I(i32_of(nh, "heads")?),
                Arg::I(i32_of(self.hd, "hd")?),
                Arg::I(i32_of(self.qkv_out, "ld")?),
                Arg::P(ptr(table, &self.stream)),
                Arg::F(if inverse { -1.0 } else { 1.0 }),
                Arg::P(self.starts_ptr(a)),
                Arg::I(i32_of(self.rotary_dim, "rotary dims")?),
            ],
        )
    }

    /// QK-norm per head of layer `l` in place on `qkv[l]` (forward, before RoPE), or on
    /// `dqkv` (`backward`, after RoPE's inverse; the weights' gradients added), where the
    /// layer has it.
    pub(super) fn qk_norm(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        backward: bool,
    ) -> Result<()> {
        let Some((qn, kn)) = li.qk_norm else {
            return Ok(());
        };
        let n = a.b * self.t;
        if self.qk_whole {
            return self.qk_norm_whole(a, l, (qn, kn), backward);
        }
        let groups = n * (self.n_head + self.n_kv_head);
        // A warp a (row, head), 8 warps a block; the backward's blocks each reduce their
        // weight gradients once, so no more of them than the GPU holds at a time.
        let blocks = groups
            .div_ceil(8)
            .min(if backward { 4 * self.k.sms } else { usize::MAX });
        let cfg = LaunchConfig {
            grid_dim: (blocks.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [
            Arg::I(i32_of(n, "rows")?),
            Arg::I(i32_of(self.n_head, "H")?),
            Arg::I(i32_of(self.n_kv_head, "KV heads")?),
            Arg::I(i32_of(self.hd, "hd")?),
            Arg::I(i32_of(self.qkv_out, "ld")?),
        ];
        let (w, raw, rstd) = (
            [Arg::P(self.weight_ptr(qn)?), Arg::P(self.weight_ptr(kn)?)],
            Arg::P(a.qk_raw[l]),
            Arg::P(a.qk_rstd[l]),
        );
        if backward {
            let mut args = vec![Arg::P(a.dqkv), raw, rstd];
            args.extend(w);
            args.extend([
                Arg::P(self.grad_ptr_or_null(Some(qn))),
                Arg::P(self.grad_ptr_or_null(Some(kn))),
            ]);
            args.extend(dims);
            args.push(Arg::F(self.woff()));
            self.launch(&self.k.qk_norm_bwd, cfg, &args)
        } else {
            let mut args = vec![Arg::P(a.qkv[l]), raw, rstd];
            args.extend(w);
            args.extend(dims);
            args.extend([Arg::F(self.eps), Arg::F(self.woff())]);
            self.launch(&self.k.qk_norm_fwd, cfg, &args)
        }
    }

    /// QK-norm over the whole q and k projections of layer `l` (OLMo 2; weights `qn`
    /// `[H·hd]`, `kn` `[KV·hd]`), in place as [`Self::qk_norm`]: one launch for q's columns,
    /// one for k's.
    fn qk_norm_whole(
        &self,
        a: &Activations,
        l: usize,
        (qn, kn): (usize, usize),
        backward: bool,
    ) -> Result<()> {
        let n = a.b * self.t;
        let hq = self.n_head * self.hd;
        let raw_ld = (self.n_head + self.n_kv_head) * self.hd;
        let cfg = LaunchConfig {
            grid_dim: (n.min(8 * self.k.sms).max(1) as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        for (part, (w, off, width)) in [(qn, 0, hq), (kn, hq, self.n_kv_head * self.hd)]
            .into_iter()
            .enumerate()
        {
            check(width <= 512 * 16, || {
                format!("QK-norm over {width} columns (the kernels take 8192)")
            })?;
            let dims = [
                Arg::I(i32_of(n, "rows")?),
                Arg::I(i32_of(off, "offset")?),
                Arg::I(i32_of(width, "width")?),
                Arg::I(i32_of(self.qkv_out, "ld")?),
                Arg::I(i32_of(raw_ld, "raw ld")?),
                Arg::I(part as i32),
            ];
            let mut args = if backward {
                vec![
                    Arg::P(a.dqkv),
                    Arg::P(a.qk_raw[l]),
                    Arg::P(a.qk_rstd[l]),
                    Arg::P(self.weight_ptr(w)?),
                    Arg::P(self.grad_ptr_or_null(Some(w))),
                ]
            } else {
                vec![
                    Arg::P(a.qkv[l]),
                    Arg::P(a.qk_raw[l]),
                    Arg::P(a.qk_rstd[l]),
                    Arg::P(self.weight_ptr(w)?),
                ]
            };
            args.extend(dims);
            if !backward {
                args.push(Arg::F(self.eps));
            }
            args.push(Arg::F(self.woff()));
            let k = if backward {
                &self.k.qk_whole_bwd
            } else {
                &self.k.qk_whole_fwd
            };
            self.launch(k, cfg, &args)?;
        }
        Ok(())
    }

    /// Causal softmax forward (`ptrs` = x, y) or backward (`ptrs` = y, dy, dx) over
    /// `rows` rows of T of layer `l` (a sliding layer's: within its window; Gemma 2's
    /// soft-cap, with the rows' log-sum-exp in `a_lse`).
    pub(super) fn softmax(
        &self,
        f: &Kern,
        ptrs: &[u64],
        (rows, l, a_lse): (usize, usize, Option<u64>),
        scale: f32,
    ) -> Result<()> {
        let t = i32_of(self.t, "T")?;
        let window = if self.sliding.get(l).copied().unwrap_or(false) {
            self.window
        } else {
            0
        };
        // (Soft-capped: each row's log-sum-exp, written by the forward, read by the backward.)
        let lse = if self.attn_cap > 0.0 {
            a_lse.ok_or_else(|| err("a soft-capped softmax without its log-sum-exp buffer"))?
        } else {
            0
        };
        let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::P(p)).collect();
        args.extend([
            Arg::I(i32_of(rows, "rows")?),
            Arg::I(t),
            Arg::I(t),
            Arg::F(scale),
            Arg::I(i32_of(window, "window")?),
            Arg::F(self.attn_cap),
            Arg::P(lse),
        ]);
        self.launch(f, row_cfg(rows), &args)
    }

    /// Heads `[B, H, T, hd]` ↔ columns `part·H·hd ..` of a `[B, T, ld]` buffer (merge: src
    /// heads → dst buffer; split: src buffer → dst heads).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn heads(
        &self,
        f: &Kern,
        src: u64,
        dst: u64,
        b: usize,
        ld: usize,
        part: usize,
    ) -> Result<()> {
        let h = self.n_head;
        self.launch(
            f,
            flat_cfg(b * self.t * self.att_c),
            &[
                Arg::P(src),
                Arg::P(dst),
                Arg::I(i32_of(b, "B")?),
                Arg::I(i32_of(self.t, "T")?),
                Arg::I(i32_of(h, "H")?),
                Arg::I(i32_of(self.hd, "hd")?),
                Arg::I(i32_of(ld, "ld")?),
                Arg::I(i32_of(part * self.att_c, "offset")?),
            ],
        )
    }
}
