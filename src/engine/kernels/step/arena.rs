//! The activation arena: every activation's device address for one micro-batch size.

use std::borrow::Cow;

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::Result;
use half::bf16;

use super::graphs::Graphs;
use super::mamba_bufs::{MambaActs, MambaArena};
use super::moe_bufs::{MoeActs, MoeArena};
use super::offload::Offload;
use super::params::{lora_width, LayerIdx, DOWN, GATE, G_DOWN, G_GU, G_QKV, K, Q, UP, V};
use super::{align, ptr, ModelStep};
use crate::config::Recompute;

/// Device addresses of one micro-batch size's activations (bf16 unless noted).
#[derive(Clone)]
pub(super) struct Activations {
    pub(super) b: usize,
    /// Rows: B·T, or a chunk's ([`ModelStep::mlp_chunks`]: the MLP functions work on `n`
    /// rows from the row-indexed buffers' addresses).
    pub(super) n: usize,
    /// The first row's index in the whole rows (0; a row window's first: dropout masks are
    /// drawn by row).
    pub(super) row0: usize,
    /// Rows per pass of the MLP ([`ModelStep::mlp_rows`]: `n`, or a chunk of it whose
    /// pre-activation, activation and their gradients are all `fc`, `act`, `dh` and `dact`
    /// hold).
    pub(super) mlp_rows: usize,
    /// Per layer: residual input, LN1 out, qkv, attention probabilities [B·H, T, T],
    /// merged attention output, residual after attention, LN2 out, the MLP's pre-activation and
    /// its activation (GELU or SwiGLU) output. (A Mamba layer's qkv is its in_proj's output
    /// `[N, z | x B C | dt]`, its atty the gated norm's output `[N, inner]`; it has no
    /// probabilities.)
    /// (The LN outputs under a concatenated LoRA group are its `[x | u]`: [`Cat`](super::lora::Cat).)
    /// (With offload the blocks' inputs alternate between two slots: [`Offload`].)
    pub(super) res: Vec<u64>,
    pub(super) ln1: Vec<u64>,
    pub(super) qkv: Vec<u64>,
    pub(super) prob: Vec<u64>,
    pub(super) atty: Vec<u64>,
    pub(super) mid: Vec<u64>,
    pub(super) ln2: Vec<u64>,
    /// The MLP's pre-activation ([N, F], or SwiGLU's packed gate|up [N, 2F]; N = `mlp_rows`
    /// for it, `act`, `dh` and `dact`).
    pub(super) fc: Vec<u64>,
    /// The MLP's activation output [N, F]: GELU(fc), or SwiGLU's silu(gate)·up.
    pub(super) act: Vec<u64>,
    pub(super) lnf: u64,
    /// One chunk of the logits: [head_rows, vpad] ([`ModelStep::head_and_loss`]).
    pub(super) logits: u64,
    pub(super) head_rows: usize,
    // scratch, reused by every layer
    pub(super) tmp: u64,
    pub(super) da: u64,
    pub(super) dres: u64,
    /// The MLP pre-activation's gradient (the side stream reads it; SwiGLU: [N, 2F]).
    pub(super) dh: u64,
    /// SwiGLU: the activation output's gradient [N, F] (before the SwiGLU backward).
    pub(super) dact: u64,
    pub(super) dqkv: u64,
    pub(super) heads: u64,
    pub(super) yh: u64,
    pub(super) dheads: u64,
    pub(super) dyh: u64,
    pub(super) dprob: u64,
    /// With dropout: the residual gradient through a mask [N, C] (bf16), flash attention's
    /// kept-flags per layer (u64 [B·H·T, ⌈T/64⌉]) and the micro-batch's seed (one u64).
    pub(super) dmask: u64,
    pub(super) mbits: Vec<u64>,
    pub(super) seed: u64,
    /// The loss gradient's scale g and the loss accumulator's weight lw of the micro-batch
    /// (two f32, read by the cross-entropy kernel: a replayed graph takes each micro-batch's).
    pub(super) gw: u64,
    /// Packed rows: each slot's sample start within its row (i32 [B·T]; read only where the
    /// micro-batch is packed, [`ModelStep::starts_ptr`]).
    pub(super) starts: u64,
    /// LoRA: per layer and group, the adapters' `x·Aᵀ` [N, Σ r] (0: no adapter), and its
    /// gradient `du`.
    pub(super) lora_u: Vec<[u64; 4]>,
    pub(super) lora_du: Vec<[u64; 4]>,
    /// LoRA dropout: the adapters' dropped input (forward) and their data gradient before its
    /// mask (backward), `[N, widest adapted input]`; 0 without LoRA dropout.
    pub(super) lora_x: u64,
    // f32: flash attention's per-layer log-sum-exp [B, H, T] and its backward scratch
    pub(super) lse_att: Vec<u64>,
    pub(super) fa_scratch: u64,
    /// Head dim 256 with grouped-query attention: each query head's share of dK, dV (bf16
    /// [B, T, H, 2, hd], summed per key/value head after the backward); 0 otherwise.
    pub(super) fa_kv_part: u64,
    /// QK-norm per head: each layer's q and k heads before the norm (bf16 [N, H + KV, hd]) and
    /// their 1/rms (f32 [N·(H + KV)]); empty without QK-norm.
    pub(super) qk_raw: Vec<u64>,
    pub(super) qk_rstd: Vec<u64>,
    /// f32 (mean, rstd) per row of every LayerNorm, kept from the forward for the backward:
    /// LN1 of layer l at 2l, LN2 at 2l + 1, the final LN at 2L.
    pub(super) stats: Vec<u64>,
    /// Gemma's sandwich, per layer: the attention output's and the MLP output's values before
    /// their norms ([N, C]; the attention's shared where the MLP half is recomputed) and those
    /// norms' f32 row statistics; empty without it. `dpost`: the scratch their backward writes
    /// the projections' output gradient into ([`Buf::Dpost`](crate::engine::kernels::side::Buf)).
    pub(super) post_in: Vec<[u64; 2]>,
    pub(super) post_stats: Vec<[u64; 2]>,
    pub(super) dpost: u64,
    /// Sliding layers: each slot's lowest key, its window's start or its packed sample's,
    /// whichever is later (i32 [B·T]; [`ModelStep::lows_ptr`]).
    pub(super) lows: u64,
    pub(super) loss: u64,
    // u32
    pub(super) ids: u64,
    pub(super) targets: u64,
    /// A hybrid's Mamba layers' own activations and scratch (None: not a hybrid).
    pub(super) mamba: Option<MambaActs>,
    /// A hybrid's routed experts' activations and scratch (None: no experts).
    pub(super) moe: Option<MoeActs>,
}

pub(super) struct Arena {
    /// `model.recompute = "offload"`: the blocks' inputs' copy stream and host memory
    /// (dropped first: its Drop waits for the copies that read or write `_bf`).
    pub(super) offload: Option<Offload>,
    pub(super) _bf: CudaSlice<bf16>,
    /// The dropout seed (one u64), the loss scales (g, lw), then the kept-flags of every layer.
    pub(super) words: CudaSlice<u64>,
    pub(super) f32s: CudaSlice<f32>,
    pub(super) ids: CudaSlice<u32>,
    pub(super) targets: CudaSlice<u32>,
    pub(super) starts: CudaSlice<i32>,
    pub(super) lows: CudaSlice<i32>,
    /// `lows` hold the unpacked rows' window lows (nothing to upload for unpacked rows).
    pub(super) lows_plain: bool,
    pub(super) acts: Activations,
    /// The memory behind `acts.mamba`.
    pub(super) _mamba: Option<MambaArena>,
    /// The memory behind `acts.moe` (its counts are read back per layer: moe.rs).
    pub(super) moe: Option<MoeArena>,
    /// The micro-batch programs captured over this arena's buffers (dropped with it).
    pub(super) graphs: Graphs,
}

/// Rows per chunk for `n` rows of `per_row` bytes in chunks of about `limit` bytes at most: as
/// few chunks as that allows, their rows rounded up to whole 64-row tensor-core tiles (at least
/// one row, at most `n`).
fn chunk_rows(n: usize, per_row: usize, limit: usize) -> usize {
    let chunks = (n * per_row).div_ceil(limit).max(1);
    n.div_ceil(chunks).next_multiple_of(64).clamp(1, n)
}

impl ModelStep {
    /// Rows per chunk of the LM head ([`Self::head_and_loss`]) for `n` rows: the logits chunk
    /// stays under 256 MiB (a trained head re-reads and re-writes its fp32 gradient once per
    /// chunk; smaller chunks also make smaller matmuls).
    pub(super) fn head_rows(&self, n: usize) -> usize {
        if let Some(rows) = self.head_chunk_rows {
            return rows.clamp(1, n);
        }
        chunk_rows(n, 2 * self.vpad, 256 << 20)
    }

    /// Rows per pass of the MLP for `n` rows ([`Activations::mlp_rows`]). Where the backward
    /// recomputes whole blocks (`model.recompute` "full" / "offload") the MLP's own buffers —
    /// its pre-activation, activation and their gradients, 12·F bytes a row with SwiGLU (96
    /// KiB for the 1B's F = 8192: past T = 64K the largest buffers of the step) — hold a chunk
    /// of rows under 512 MiB, which the forward and the backward walk through (whole chunks
    /// of 64 rows). Elsewhere (the MLP's buffers kept per layer, routed experts) all `n` rows
    /// at once.
    pub(super) fn mlp_rows(&self, n: usize) -> usize {
        if !self.recompute.whole_block() || self.moe.is_some() {
            return n;
        }
        if let Some(rows) = self.mlp_chunk_rows {
            return rows.clamp(1, n);
        }
        let per_row = 2 * (2 * self.up_out() + self.hidden + self.dact_width());
        chunk_rows(n, per_row, 512 << 20)
    }

    /// The chunks of rows layer `l`'s MLP runs in ([`Self::mlp_rows`]): each one's first row
    /// and its arena ([`Self::mlp_window`]; the whole arena itself where one chunk holds every
    /// row).
    pub(super) fn mlp_chunks<'a>(
        &'a self,
        a: &'a Activations,
        l: usize,
        li: &'a LayerIdx,
    ) -> impl Iterator<Item = (usize, Cow<'a, Activations>)> + 'a {
        (0..a.n).step_by(a.mlp_rows).map(move |r0| {
            let rows = a.mlp_rows.min(a.n - r0);
            let w = if rows == a.n {
                Cow::Borrowed(a)
            } else {
                Cow::Owned(self.mlp_window(a, l, li, (r0, rows)))
            };
            (r0, w)
        })
    }

    /// Rows `r0..r0 + rows` of layer `l`'s MLP as an arena of their own for the MLP's
    /// functions: `n` = `rows`, and the addresses of the row-indexed
    /// buffers they read and write past the window's first row — the normed input (a
    /// concatenated LoRA group's `[x | u]` rows included), its gradient `da` (the same row
    /// stride) and the gate|up and down adapters' `u`, `du`; `fc`, `act`, `dh`, `dact` are
    /// already a chunk's. The output's and its gradient's rows are the caller's to offset.
    fn mlp_window(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        (r0, rows): (usize, usize),
    ) -> Activations {
        let at = |p: u64, ld: usize| if p == 0 { 0 } else { p + 2 * (r0 * ld) as u64 };
        let mut w = a.clone();
        w.n = rows;
        w.row0 = a.row0 + r0;
        let ld = self.ln_ld(l, G_GU);
        w.ln2[l] = at(a.ln2[l], ld);
        w.da = at(a.da, ld);
        for g in [G_GU, G_DOWN] {
            let width = lora_width(li, g);
            w.lora_u[l][g] = at(a.lora_u[l][g], width);
            w.lora_du[l][g] = at(a.lora_du[l][g], width);
        }
        w
    }

    /// The MLP's up projection's output width: F, or SwiGLU's packed gate|up 2F.
    pub(super) fn up_out(&self) -> usize {
        if self.swiglu {
            2 * self.hidden
        } else {
            self.hidden
        }
    }

    /// `dact`'s width: SwiGLU's activation gradient F (GELU's runs in `dh`: none).
    fn dact_width(&self) -> usize {
        if self.swiglu {
            self.hidden
        } else {
            0
        }
    }

    /// Size (or re-size) the activation arena for micro-batch `b`.
    pub(super) fn ensure(&mut self, b: usize) -> Result<()> {
        if self.arena.as_ref().is_some_and(|a| a.acts.b == b) {
            return Ok(());
        }
        self.arena = None;
        let (l, c, t, f) = (self.n_layer, self.c, self.t, self.hidden);
        let n = b * t;
        let nc = n * c;
        // Materialised attention keeps [B·H, T, T] probabilities per layer; flash attention
        // keeps none (a [B, H, T] log-sum-exp in f32 instead).
        let probs = if self.flash {
            0
        } else {
            b * self.n_head * t * t
        };
        // (q, k, v heads [B, H, T, hd] each: key/value heads repeated for their query heads)
        let heads_len = if self.flash { 0 } else { 3 * n * self.att_c };
        let mut next = 0usize;
        let mut take = |len: usize| {
            let o = next;
            next += align(len);
            o
        };
        // A projection's input is kept for the backward only where a gradient needs it (its
        // weight trains, or an adapter sits on it); elsewhere (a frozen LoRA base) every
        // layer writes it into one shared buffer.
        let keep = |w: fn(&LayerIdx) -> usize, ad: &[usize]| -> Vec<bool> {
            self.layers
                .iter()
                .map(|li| {
                    self.trained_grad_ptr(w(li)).is_some()
                        || ad.iter().any(|&j| li.lora[j].is_some())
                })
                .collect()
        };
        // Recompute: the attention half's activations (and with "full" the MLP half's) are
        // rewritten in the backward, one layer at a time, into shared buffers.
        let attn_kept = self.recompute == Recompute::None;
        let mlp_kept = !self.recompute.whole_block();
        let and = |v: Vec<bool>, k: bool| v.into_iter().map(|x| x && k).collect::<Vec<_>>();
        let keep_ln1 = and(keep(|li| li.qkv_w, &[Q, K, V]), attn_kept);
        // (Routed experts' router and gate | up read the normed input in their weights'
        // gradients as the shared MLP's do.)
        let experts_train = self.layers.iter().map(|li| {
            li.moe.as_ref().is_some_and(|m| {
                self.trained_grad_ptr(m.router).is_some()
                    || self.trained_grad_ptr(m.gate_up).is_some()
            })
        });
        let keep_ln2 = keep(|li| li.up_w, &[GATE, UP])
            .into_iter()
            .zip(experts_train)
            .map(|(a, b)| a || b)
            .collect();
        let keep_ln2 = and(keep_ln2, mlp_kept);
        let keep_act = and(keep(|li| li.down_w, &[DOWN]), mlp_kept);
        let attn_layers = vec![attn_kept; l];
        let mlp_layers = vec![mlp_kept; l];
        // (Per layer: lengths that differ between a hybrid's Mamba and attention layers; a
        // buffer shared by layers that do not keep theirs takes the longest of them.)
        let mut per_if = |lens: &[usize], keep: &[bool]| {
            let shared_len = lens
                .iter()
                .zip(keep)
                .filter(|(_, k)| !**k)
                .map(|(&len, _)| len)
                .max();
            let mut shared = None;
            lens.iter()
                .zip(keep)
                .map(|(&len, &k)| match shared_len {
                    Some(sl) if !k => *shared.get_or_insert_with(|| take(sl)),
                    _ => take(len),
                })
                .collect::<Vec<_>>()
        };
        let uni = |len: usize| vec![len; l];
        // A Mamba layer's in_proj output `[N, z | x B C | dt]` and its gated norm's `[N, inner]`
        // sit where an attention layer's q|k|v and merged heads do; it keeps no attention
        // probabilities nor QK-norm values.
        let mixer_lens =
            |f: &dyn Fn(&LayerIdx) -> usize| self.layers.iter().map(f).collect::<Vec<_>>();
        let attn_only = |len: usize| mixer_lens(&|li| if li.mamba.is_some() { 0 } else { len });
        let all_layers = vec![true; l];
        // (A concatenated LoRA group's normed input is `[x | u]`, rows `ld` apart: [`Cat`](super::lora::Cat).)
        let ld_max = |g: usize| (0..l).map(|i| self.ln_ld(i, g)).max().unwrap_or(c);
        let (ld1, ld2) = (ld_max(G_QKV), ld_max(G_GU));
        // Offload: two device slots for the blocks' inputs, the rest on the host (offload.rs).
        let offload = self.recompute == Recompute::Offload && l > 2;
        let res_o = if offload {
            let slots = per_if(&[nc, nc], &[true, true]);
            (0..l).map(|i| slots[i % 2]).collect()
        } else {
            per_if(&uni(nc), &all_layers)
        };
        let ln1_o = per_if(&uni(n * ld1), &keep_ln1);
        let qkv_o = per_if(&mixer_lens(&|li| n * self.in_width(li)), &attn_layers);
        let qk_groups = if self.layers.iter().any(|li| li.qk_norm.is_some()) {
            self.n_head + self.n_kv_head
        } else {
            0
        };
        let qk_raw_o = per_if(&attn_only(n * qk_groups * self.hd), &attn_layers);
        let prob_o = per_if(&attn_only(probs), &attn_layers);
        let nac = n * self.att_c;
        let dq_acc = self.dq_acc_len(b);
        let atty_o = per_if(&mixer_lens(&|li| n * self.mixer_width(li)), &attn_layers);
        let mid_o = per_if(&uni(nc), &mlp_layers);
        let ln2_o = per_if(&uni(n * ld2), &keep_ln2);
        // SwiGLU keeps the packed gate|up pre-activation [N, 2F]; with the MLP recomputed,
        // its buffers hold a chunk of rows.
        let up_out = self.up_out();
        let nm = self.mlp_rows(n);
        let fc_o = per_if(&uni(nm * up_out), &mlp_layers);
        let act_o = per_if(&uni(nm * f), &keep_act);
        // Gemma's sandwich: the attention output before its norm is written in the MLP half
        // (kept with it), the MLP's in the forward's loop (kept for every layer).
        let post = self.layers.iter().any(|li| li.post.is_some());
        let post_len = if post { nc } else { 0 };
        let post_a_o = per_if(&uni(post_len), &mlp_layers);
        let post_m_o = per_if(&uni(post_len), &all_layers);
        let res_last = take(nc);
        let lnf = take(nc);
        let head_rows = self.head_rows(n);
        let logits = take(head_rows * self.vpad);
        let tmp = take(nc);
        // (d atty [N, n_head·head_dim] or a Mamba layer's [N, inner], the other [N, C]
        // gradients, a concatenated LoRA group's [dx | du])
        let mixer_max = self.layers.iter().map(|li| self.mixer_width(li)).max();
        let da = take(
            nc.max(nac)
                .max(n * ld1.max(ld2))
                .max(n * mixer_max.unwrap_or(0)),
        );
        let dres = take(nc);
        let dh = take(nm * up_out);
        let dact = take(nm * self.dact_width());
        let in_max = self.layers.iter().map(|li| self.in_width(li)).max();
        let dqkv = take(n * in_max.unwrap_or(self.qkv_out));
        let heads = take(heads_len);
        let yh = take(heads_len / 3);
        let dheads = take(heads_len);
        let dyh = take(heads_len / 3);
        let dprob = take(probs);
        let drop = self.drop_thr > 0;
        let dmask = take(if self.res_scaled() { nc } else { 0 });
        let dpost = take(post_len);
        // LoRA: each layer's and group's x·[A₁; A₂; …]ᵀ [N, Σr] (kept for the backward) and its
        // gradient du (per layer too: the side stream's dA reads it while the backward goes on);
        // a concatenated group keeps them in its input's and `da`'s last columns instead.
        let (mut lora_u, mut lora_du) = (Vec::new(), Vec::new());
        for (i, li) in self.layers.iter().enumerate() {
            let (mut u, mut du) = ([None; 4], [None; 4]);
            for (g, (ug, dug)) in u.iter_mut().zip(du.iter_mut()).enumerate() {
                let w = lora_width(li, g);
                if w > 0 && self.cat(i, g).is_none() {
                    *ug = Some(take(n * w));
                    *dug = Some(take(n * w));
                }
            }
            lora_u.push(u);
            lora_du.push(du);
        }
        let xmax = self
            .layers
            .iter()
            .flat_map(|li| li.lora.iter().flatten().map(|ad| ad.inp))
            .max()
            .unwrap_or(0);
        let lora_x = take(if self.lora_thr > 0 { n * xmax } else { 0 });
        let bf_len = next;
        // f32: the loss accumulator [N], then (flash, or a soft-capped softmax) the per-layer
        // attention log-sum-exp [B·H·T] and (flash) the backward scratch (dq accumulator [N·C] + delta [B·H·T]).
        // (Materialised attention keeps them too where Gemma 2 soft-caps the scores.)
        let bht = if self.flash || self.attn_cap > 0.0 {
            b * self.n_head * t
        } else {
            0
        };
        let f_lse_att = align(n);
        let f_scratch = f_lse_att + l * align(bht);
        // (head dim 256 with grouped-query attention: the heads' dK, dV shares, bf16 [N, H, 2, hd]
        // = nac f32 words)
        let kv_part = if self.flash && self.fa_per_head_kv() {
            align(nac)
        } else {
            0
        };
        let f_stats = f_scratch
            + if self.flash {
                align(dq_acc) + align(bht) + kv_part
            } else {
                0
            };
        let f_qk = f_stats + (2 * l + 1) * align(2 * n);
        let f_post = f_qk + l * align(n * qk_groups);
        let f_len = f_post + if post { 2 * l * align(2 * n) } else { 0 };
        // SAFETY: every activation is written before it is read within a micro-batch.
        let bf = unsafe { self.dev.alloc::<bf16>(bf_len)? };
        let f32s = self.dev.alloc_zeros::<f32>(f_len)?;
        // u64 words: the seed, (g, lw) as two f32, then each layer's kept-flags (from word 16).
        let nkt = t.div_ceil(64);
        let bits_len = if drop {
            (b * self.n_head * t * nkt).div_ceil(16) * 16
        } else {
            0
        };
        let words = self.dev.alloc_zeros::<u64>(16 + l * bits_len)?;
        let wbase = ptr(&words, &self.stream);
        let ids = self.dev.alloc_zeros::<u32>(n)?;
        let targets = self.dev.alloc_zeros::<u32>(n)?;
        let starts = self.dev.alloc_zeros::<i32>(n)?;
        let lows = self
            .dev
            .alloc_zeros::<i32>(if self.window > 0 { n } else { 1 })?;
        let mamba = match &self.mamba {
            Some(dims) => {
                let layers: Vec<bool> = self.layers.iter().map(|li| li.mamba.is_some()).collect();
                let keep = self.recompute == Recompute::None;
                Some(MambaArena::new(&self.dev, dims, (b, t), &layers, keep)?)
            }
            None => None,
        };
        let moe = match &self.moe {
            Some(dims) => Some(MoeArena::new(&self.dev, dims, (b, t, c), l, mlp_kept)?),
            None => None,
        };
        let base = ptr(&bf, &self.stream);
        let fbase = ptr(&f32s, &self.stream);
        let at = |o: usize| base + 2 * o as u64;
        let all = |v: &[usize]| v.iter().map(|&o| at(o)).collect::<Vec<_>>();
        let mut res = all(&res_o);
        res.push(at(res_last));
        let acts = Activations {
            b,
            n,
            row0: 0,
            mlp_rows: nm,
            res,
            ln1: all(&ln1_o),
            qkv: all(&qkv_o),
            prob: all(&prob_o),
            atty: all(&atty_o),
            mid: all(&mid_o),
            ln2: all(&ln2_o),
            fc: all(&fc_o),
            act: all(&act_o),
            lnf: at(lnf),
            logits: at(logits),
            head_rows,
            tmp: at(tmp),
            da: at(da),
            dres: at(dres),
            dh: at(dh),
            dact: at(dact),
            dqkv: at(dqkv),
            heads: at(heads),
            yh: at(yh),
            dheads: at(dheads),
            dyh: at(dyh),
            dprob: at(dprob),
            dmask: at(dmask),
            lora_u: lora_u.iter().map(|u| u.map(|o| o.map_or(0, at))).collect(),
            lora_du: lora_du.iter().map(|u| u.map(|o| o.map_or(0, at))).collect(),
            lora_x: if self.lora_thr > 0 { at(lora_x) } else { 0 },
            mbits: (0..l)
                .map(|i| wbase + 8 * (16 + i * bits_len) as u64)
                .collect(),
            seed: wbase,
            gw: wbase + 8,
            starts: ptr(&starts, &self.stream),
            lse_att: (0..l)
                .map(|i| fbase + 4 * (f_lse_att + i * align(bht)) as u64)
                .collect(),
            fa_scratch: fbase + 4 * f_scratch as u64,
            fa_kv_part: if kv_part > 0 {
                fbase + 4 * (f_scratch + align(dq_acc) + align(bht)) as u64
            } else {
                0
            },
            qk_raw: if qk_groups > 0 {
                all(&qk_raw_o)
            } else {
                Vec::new()
            },
            qk_rstd: if qk_groups > 0 {
                (0..l)
                    .map(|i| fbase + 4 * (f_qk + i * align(n * qk_groups)) as u64)
                    .collect()
            } else {
                Vec::new()
            },
            stats: (0..2 * l + 1)
                .map(|i| fbase + 4 * (f_stats + i * align(2 * n)) as u64)
                .collect(),
            post_in: if post {
                post_a_o
                    .iter()
                    .zip(&post_m_o)
                    .map(|(&pa, &pm)| [at(pa), at(pm)])
                    .collect()
            } else {
                Vec::new()
            },
            post_stats: if post {
                (0..l)
                    .map(|i| {
                        let o = |j: usize| fbase + 4 * (f_post + (2 * i + j) * align(2 * n)) as u64;
                        [o(0), o(1)]
                    })
                    .collect()
            } else {
                Vec::new()
            },
            dpost: at(dpost),
            lows: ptr(&lows, &self.stream),
            loss: fbase,
            ids: ptr(&ids, &self.stream),
            targets: ptr(&targets, &self.stream),
            mamba: mamba.as_ref().map(|m| m.acts.clone()),
            moe: moe.as_ref().map(|m| m.acts.clone()),
        };
        let offload = if offload {
            Some(Offload::new(&self.stream, l - 2, 2 * nc)?)
        } else {
            None
        };
        self.arena = Some(Arena {
            offload,
            _bf: bf,
            words,
            f32s,
            ids,
            targets,
            starts,
            lows,
            lows_plain: false,
            acts,
            _mamba: mamba,
            moe,
            graphs: Graphs::default(),
        });
        Ok(())
    }
}
