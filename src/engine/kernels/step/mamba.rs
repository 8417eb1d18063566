//! The Mamba-2 mixer of a hybrid's Mamba layers on the whole-model step (mamba.cuh and
//! step/mamba_*.cuh): the causal conv1d + SiLU, the selective scan by state-space duality in
//! chunks, and the gated RMSNorm, forward and backward. A Mamba layer sits in the step as an
//! attention layer would: its in_proj is the layer's packed "qkv" projection (output
//! `z | x B C | dt`, LoRA group `G_QKV`), its out_proj the "o" projection (LoRA group `G_O`);
//! between them this file's kernels take `qkv[l]` to `atty[l]` (the gated norm's output,
//! `[N, inner]`) and, backward, `da` (its gradient) to `dqkv` (the in_proj output's gradient,
//! every column written).

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::Result;

use super::arena::Activations;
use super::kernels::{
    scan_bwd_fused_smem, scan_bwd_smem, scan_smem, state_bwd_smem, state_db_smem, walk_bwd_smem,
    walk_smem, ConvKern, Kern, CB_SMEM, MAMBA_HB,
};
use super::mamba_bufs::{MambaActs, MambaDims, MambaIdx};
use super::params::LayerIdx;
use super::{check, Arg, ModelStep};
use crate::engine::kernels::cuda::{err, flat_cfg, i32_of};

/// One Mamba layer's launch parameters.
struct Layer<'a> {
    d: MambaDims,
    m: &'a MambaActs,
    idx: MambaIdx,
    /// The in_proj output (forward) and its gradient (backward) `[N, in_w]`.
    zx: u64,
    /// The layer's slot (mamba_bufs.rs): dtv, lam, C·Bᵀ, the chunks' start states, the
    /// conv's output.
    dtv: u64,
    lam: u64,
    cb: u64,
    states: u64,
    xc: u64,
    /// Packed rows' sample starts (0: not packed): the conv and the scan begin again at each
    /// sample (mamba.cuh's mb_from).
    starts: u64,
    b: usize,
    n: usize,
    chunks: usize,
}

/// The dt kernels' grid: a warp per (batch row, head, chunk), four a block.
fn dt_cfg(y: &Layer, d: &MambaDims) -> LaunchConfig {
    cfg(((y.b * d.heads * y.chunks).div_ceil(4), 1, 1), 128, 0)
}

/// A conv kernel's grid: a thread a channel (`k.walkers` threads a channel, each over its
/// share of the rows), `k.threads` a block, a block per `k.rows` rows.
fn conv_cfg(n: usize, conv: usize, k: &ConvKern) -> LaunchConfig {
    let groups = conv.div_ceil((k.threads / k.walkers) as usize);
    cfg((groups, n.div_ceil(k.rows), 1), k.threads, k.smem)
}

/// Whether the conv's shared-memory builds (and the backward's vector one, 4 channels a
/// thread) take this layer: its channels, the in_proj output's row stride and the conv's first
/// column whole 16-byte pieces, and the buffers they read (and the vector build writes)
/// 16-byte aligned.
fn conv_vec(d: &MambaDims, ptrs: &[u64]) -> bool {
    [d.conv_dim(), d.in_w(), d.inner()]
        .iter()
        .all(|v| v.is_multiple_of(8))
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// The heads a block of the backward's chunk kernels takes in turn: the largest divisor of a
/// group's heads up to `max` (48 heads in one group, `MAMBA_HB`: 8, six blocks a chunk).
fn heads_a_block(d: &MambaDims, max: usize) -> usize {
    let per_group = d.heads / d.groups;
    (1..=max.min(per_group))
        .rev()
        .find(|h| per_group.is_multiple_of(*h))
        .unwrap_or(1)
}

/// The gated norm's backward: a block per `GN_ROWS` rows (mamba_gnorm.cuh's MB_GN_ROWS).
const GN_ROWS: usize = 8;

/// Whether the gated norm's rows move 16 bytes a thread (mamba_gnorm.cuh's mb_gn_vec: its widths
/// and the in_proj output's row stride).
fn gn_vec(d: &MambaDims) -> bool {
    let gw = d.inner() / d.groups;
    [gw, d.in_w(), d.inner()]
        .iter()
        .all(|v| v.is_multiple_of(8))
}

/// The gated norm's threads a block. Where a thread moves 16 bytes at a time (`vec`:
/// mamba_gnorm.cuh's mb_gn_vec, at most MB_GN_V = 4 pieces a thread), as many as spread a
/// group's pieces evenly over the fewest passes (a group of 3072 columns: 192 threads of two
/// pieces each, where 256 would leave half the warps a piece behind at each row's block-wide
/// sum); else 256.
fn gn_threads(gw: usize, vec: bool) -> u32 {
    let pieces = gw / 8;
    let passes = pieces.div_ceil(256);
    if !vec || !gw.is_multiple_of(8) || passes == 0 || passes > 4 {
        return 256;
    }
    pieces.div_ceil(passes).next_multiple_of(32).min(256) as u32
}

fn cfg(grid: (usize, usize, usize), threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

impl ModelStep {
    fn mamba_layer<'a>(&self, a: &'a Activations, l: usize, li: &LayerIdx) -> Result<Layer<'a>> {
        let (Some(d), Some(m), Some(idx)) = (self.mamba, a.mamba.as_ref(), li.mamba) else {
            return Err(err(format!(
                "whole-model step: layer {l} is not a Mamba layer of a hybrid"
            )));
        };
        check(m.y[l] != 0, || {
            format!("layer {l} has no Mamba activations")
        })?;
        Ok(Layer {
            d,
            m,
            idx,
            zx: a.qkv[l],
            dtv: m.dtv[l],
            lam: m.lam[l],
            cb: m.cb[l],
            states: m.states[l],
            xc: m.xc[l],
            starts: self.starts_ptr(a),
            b: a.b,
            n: a.b * self.t,
            chunks: d.chunks(self.t),
        })
    }

    /// The scan kernels, or why this GPU cannot run them.
    fn scan_kernels(&self) -> Result<&(Kern, Kern, Kern)> {
        self.k.mamba.scan.as_ref().ok_or_else(|| {
            err(format!(
                "whole-model step: the Mamba scan needs {} KB of shared memory a block, more \
                 than this GPU gives",
                scan_bwd_smem(1) / 1024
            ))
        })
    }

    /// The dt kernels' leading arguments (in_proj's output, its row stride, dt's first
    /// column, dt_bias, A_log) and trailing ones (B, T, heads, chunks, the limits).
    fn dt_args(&self, y: &Layer) -> Result<([Arg; 5], [Arg; 7])> {
        let d = &y.d;
        Ok((
            [
                Arg::P(y.zx),
                Arg::I(i32_of(d.in_w(), "in_proj width")?),
                Arg::I(i32_of(d.inner() + d.conv_dim(), "in_proj width")?),
                Arg::P(self.weight_ptr(y.idx.dt_bias)?),
                Arg::P(self.weight_ptr(y.idx.a_log)?),
            ],
            [
                Arg::I(i32_of(y.b, "B")?),
                Arg::I(i32_of(self.t, "T")?),
                Arg::I(i32_of(d.heads, "Mamba heads")?),
                Arg::I(i32_of(y.chunks, "chunks")?),
                Arg::I(d.clamp as i32),
                Arg::F(d.dt_min),
                Arg::F(d.dt_max),
            ],
        ))
    }

    /// The chunk kernels' shape arguments: T, heads, head width, state, groups.
    fn chunk_args(&self, d: &MambaDims) -> Result<[Arg; 5]> {
        Ok([
            Arg::I(i32_of(self.t, "T")?),
            Arg::I(i32_of(d.heads, "Mamba heads")?),
            Arg::I(i32_of(d.head_dim, "Mamba head width")?),
            Arg::I(i32_of(d.state, "Mamba state")?),
            Arg::I(i32_of(d.groups, "Mamba groups")?),
        ])
    }

    /// The conv (x | B | C → xc, in the layer's slot): the forward's first part.
    fn mamba_conv(&self, y: &Layer) -> Result<()> {
        let (d, k) = (&y.d, &self.k.mamba);
        let (inner, conv) = (d.inner(), d.conv_dim());
        let ld = i32_of(d.in_w(), "in_proj width")?;
        let (n_i, t_i) = (i32_of(y.n, "rows")?, i32_of(self.t, "T")?);
        let conv_args = [
            Arg::P(y.zx),
            Arg::I(ld),
            Arg::I(i32_of(inner, "Mamba width")?),
            Arg::P(self.weight_ptr(y.idx.conv_w)?),
            Arg::P(self.weight_ptr_or_null(y.idx.conv_b)?),
            Arg::P(y.xc),
            Arg::P(y.starts),
            Arg::I(n_i),
            Arg::I(t_i),
            Arg::I(i32_of(conv, "conv channels")?),
            Arg::I(i32_of(d.conv_k, "d_conv")?),
        ];
        let ck = k.conv_forward(d.conv_k, conv_vec(d, &[y.zx]));
        self.launch(ck.k, conv_cfg(y.n, conv, &ck), &conv_args)
    }

    /// dt (→ dtv, lam), each chunk's C·Bᵀ and each chunk's start state (→ states, one walk
    /// over the chunks), into the layer's slot.
    fn mamba_chunks(&self, y: &Layer) -> Result<()> {
        let (d, k) = (&y.d, &self.k.mamba);
        let (head, tail) = self.dt_args(y)?;
        let args: Vec<Arg> = head
            .into_iter()
            .chain([Arg::P(y.dtv), Arg::P(y.lam)])
            .chain(tail)
            .collect();
        self.launch(&k.dt_fwd, dt_cfg(y, d), &args)?;
        let mut args = vec![Arg::P(y.xc), Arg::P(y.cb)];
        args.extend(self.chunk_args(d)?);
        self.launch(
            &k.chunk_cb,
            cfg((y.chunks, d.groups, y.b), 256, CB_SMEM),
            &args,
        )?;
        let mut args = vec![
            Arg::P(y.xc),
            Arg::P(y.dtv),
            Arg::P(y.lam),
            Arg::P(y.states),
            Arg::P(y.starts),
        ];
        args.extend(self.chunk_args(d)?);
        args.push(Arg::I(i32_of(y.chunks, "chunks")?));
        let (walk, _, ns) = k.walks(d.state);
        let grid = (
            d.head_dim.div_ceil(64),
            d.state.div_ceil(64 * ns),
            y.b * d.heads,
        );
        self.launch(walk, cfg(grid, 256, walk_smem(ns as u32)), &args)
    }

    /// Layer `l`'s Mamba mixer forward: `qkv[l]` (in_proj's output `[N, in_w]`, bias
    /// included) → `atty[l]` (`[N, inner]`), keeping what the backward needs.
    pub(super) fn mamba_fwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let y = self.mamba_layer(a, l, li)?;
        let (d, m) = (&y.d, y.m);
        let (scan, _, _) = self.scan_kernels()?;
        self.mamba_conv(&y)?;
        self.mamba_chunks(&y)?;
        let mut args = vec![
            Arg::P(y.xc),
            Arg::P(y.cb),
            Arg::P(y.dtv),
            Arg::P(y.lam),
            Arg::P(y.states),
            Arg::P(self.weight_ptr(y.idx.d)?),
            Arg::P(m.y[l]),
            Arg::P(y.starts),
        ];
        args.extend(self.chunk_args(d)?);
        check(d.state <= self.k.mamba.scan_state, || {
            format!(
                "the Mamba scan needs {} KB of shared memory a block at mamba_d_state = {}, more \
                 than this GPU gives",
                scan_smem(d.state, 1) / 1024,
                d.state
            )
        })?;
        let hb = heads_a_block(d, MAMBA_HB);
        args.push(Arg::I(i32_of(hb, "heads a block")?));
        self.launch(
            scan,
            cfg((y.chunks, d.heads / hb, y.b), 256, scan_smem(d.state, hb)),
            &args,
        )?;
        self.launch(
            &self.k.mamba.gnorm_fwd,
            cfg(
                (y.n.min(65535), 1, 1),
                gn_threads(d.inner() / d.groups, gn_vec(d)),
                0,
            ),
            &[
                Arg::P(m.y[l]),
                Arg::P(y.zx),
                Arg::I(i32_of(d.in_w(), "in_proj width")?),
                Arg::P(self.weight_ptr(y.idx.norm)?),
                Arg::P(a.atty[l]),
                Arg::P(m.rstd[l]),
                Arg::I(i32_of(y.n, "rows")?),
                Arg::I(i32_of(d.inner(), "Mamba width")?),
                Arg::I(i32_of(d.groups, "Mamba groups")?),
                Arg::F(self.eps),
            ],
        )
    }

    /// The state passing's backward (one reverse walk over the chunks): `down` (the gradient
    /// of each chunk's own contribution to its end state) and the decay's share of dlam.
    fn mamba_walk_bwd(&self, y: &Layer) -> Result<()> {
        let (d, m) = (&y.d, y.m);
        let mut args = vec![
            Arg::P(y.xc),
            Arg::P(m.dy),
            Arg::P(y.lam),
            Arg::P(y.states),
            Arg::P(m.dlam),
            Arg::P(m.down),
            Arg::P(y.starts),
        ];
        args.extend(self.chunk_args(d)?);
        args.push(Arg::I(i32_of(y.chunks, "chunks")?));
        let (_, walk_bwd, ns) = self.k.mamba.walks(d.state);
        self.launch(
            walk_bwd,
            cfg(
                (
                    d.head_dim.div_ceil(64),
                    d.state.div_ceil(64 * ns),
                    y.b * d.heads,
                ),
                256,
                walk_bwd_smem(ns as u32),
            ),
            &args,
        )
    }

    /// Layer `l`'s Mamba mixer backward: `da` (d atty, `[N, inner]`) → `dqkv` (`[N, in_w]`,
    /// every column written), and the gradients of the conv, dt bias, A_log, D and norm
    /// weights added into theirs (where they train).
    pub(super) fn mamba_bwd(&self, a: &Activations, l: usize, li: &LayerIdx) -> Result<()> {
        let y = self.mamba_layer(a, l, li)?;
        let (d, m, k) = (&y.d, y.m, &self.k.mamba);
        let (_, scan_bwd, state_bwd) = self.scan_kernels()?;
        let (inner, conv) = (d.inner(), d.conv_dim());
        let ld = i32_of(d.in_w(), "in_proj width")?;
        let (n_i, t_i) = (i32_of(y.n, "rows")?, i32_of(self.t, "T")?);
        let (inner_i, conv_i) = (
            i32_of(inner, "Mamba width")?,
            i32_of(conv, "conv channels")?,
        );
        // The layer's slot holds its forward's conv output: its own where the layers keep
        // their slots, else the shared one that the step's recompute of this layer's forward
        // (`Self::attn_half_fwd`) has just refilled.
        self.launch(
            &k.gnorm_bwd,
            cfg(
                (y.n.div_ceil(GN_ROWS), 1, 1),
                gn_threads(inner, d.groups == 1 && gn_vec(d)),
                4 * inner as u32,
            ),
            &[
                Arg::P(m.y[l]),
                Arg::P(y.zx),
                Arg::I(ld),
                Arg::P(self.weight_ptr(y.idx.norm)?),
                Arg::P(m.rstd[l]),
                Arg::P(a.da),
                Arg::P(m.dy),
                Arg::P(a.dqkv),
                Arg::P(self.grad_ptr_or_null(Some(y.idx.norm))),
                Arg::I(n_i),
                Arg::I(inner_i),
                Arg::I(i32_of(d.groups, "Mamba groups")?),
            ],
        )?;
        // (dxc: the scan's backward stores its x columns and adds into its B | C ones.)
        self.launch(
            &k.zero,
            flat_cfg(y.n * (conv - inner)),
            &[
                Arg::P(m.dxc),
                Arg::I(n_i),
                Arg::I(conv_i),
                Arg::I(inner_i),
                Arg::I(i32_of(conv - inner, "B | C columns")?),
            ],
        )?;
        // The backward's chunk kernels take `hb` heads of a group a block (the chunk states'
        // one where the GPU lacks the shared memory to sum dB over several).
        let hb = heads_a_block(d, k.scan_bwd_hb);
        let hb_state = if d.state <= k.head_sum_state {
            heads_a_block(d, MAMBA_HB)
        } else {
            1
        };
        // Where the scan's backward takes the chunk states' share through x (`fused`), the
        // reverse walk runs first (its `down` is what that share reads) and adds its share of
        // dlam into a zeroed one, and dB alone follows (`MambaKernels::state_db`).
        let fused = d.state <= k.fused_state;
        if fused {
            let len = y.b * d.heads * y.chunks * 64;
            let len_i = i32_of(len, "Mamba positions")?;
            self.launch(
                &k.zero,
                flat_cfg(len),
                &[
                    Arg::P(m.dlam),
                    Arg::I(1),
                    Arg::I(len_i),
                    Arg::I(0),
                    Arg::I(len_i),
                ],
            )?;
            self.mamba_walk_bwd(&y)?;
        }
        let mut args = vec![
            Arg::P(y.xc),
            Arg::P(y.cb),
            Arg::P(y.dtv),
            Arg::P(y.lam),
            Arg::P(y.states),
            Arg::P(if fused { m.down } else { 0 }),
            Arg::P(self.weight_ptr(y.idx.d)?),
            Arg::P(m.dy),
            Arg::P(m.dxc),
            Arg::P(m.ddt),
            Arg::P(m.dlam),
            Arg::P(self.grad_ptr_or_null(Some(y.idx.d))),
            Arg::P(y.starts),
        ];
        args.extend(self.chunk_args(d)?);
        args.push(Arg::I(i32_of(hb, "heads a block")?));
        let smem = if fused {
            scan_bwd_fused_smem(hb, d.state)
        } else {
            scan_bwd_smem(hb)
        };
        self.launch(
            scan_bwd,
            cfg((y.chunks, d.heads / hb, y.b), 256, smem),
            &args,
        )?;
        if !fused {
            self.mamba_walk_bwd(&y)?;
        }
        // The chunk states' backward: dB alone where the scan's backward took the rest (every
        // head of a group a block can take), else all of it.
        let mut args = vec![
            Arg::P(y.xc),
            Arg::P(y.dtv),
            Arg::P(y.lam),
            Arg::P(m.down),
            Arg::P(m.dxc),
        ];
        let (kern, hb_c, smem) = if fused {
            let pair = d.head_dim.div_ceil(64) == 1 && d.state.div_ceil(64) == 2;
            (&k.state_db, heads_a_block(d, MAMBA_HB), state_db_smem(pair))
        } else {
            args.extend([Arg::P(m.ddt), Arg::P(m.dlam)]);
            let smem = state_bwd_smem(d.state, hb_state > 1);
            (state_bwd, hb_state, smem)
        };
        args.push(Arg::P(y.starts));
        args.extend(self.chunk_args(d)?);
        args.push(Arg::I(i32_of(hb_c, "heads a block")?));
        self.launch(kern, cfg((y.chunks, d.heads / hb_c, y.b), 256, smem), &args)?;
        let (head, tail) = self.dt_args(&y)?;
        let mid = [
            Arg::P(y.dtv),
            Arg::P(m.ddt),
            Arg::P(m.dlam),
            Arg::P(a.dqkv),
            Arg::P(self.grad_ptr_or_null(Some(y.idx.dt_bias))),
            Arg::P(self.grad_ptr_or_null(Some(y.idx.a_log))),
        ];
        let args: Vec<Arg> = head.into_iter().chain(mid).chain(tail).collect();
        self.launch(&k.dt_bwd, dt_cfg(&y, d), &args)?;
        let conv_w = self.weight_ptr(y.idx.conv_w)?;
        let k_i = i32_of(d.conv_k, "d_conv")?;
        let ck = k.conv_backward(d.conv_k, conv_vec(d, &[y.zx, m.dxc, a.dqkv]));
        self.launch(
            ck.k,
            conv_cfg(y.n, conv, &ck),
            &[
                Arg::P(y.zx),
                Arg::I(ld),
                Arg::I(inner_i),
                Arg::P(conv_w),
                Arg::P(self.weight_ptr_or_null(y.idx.conv_b)?),
                Arg::P(m.dxc),
                Arg::P(a.dqkv),
                Arg::P(self.grad_ptr_or_null(Some(y.idx.conv_w))),
                Arg::P(self.grad_ptr_or_null(y.idx.conv_b)),
                Arg::P(y.starts),
                Arg::I(n_i),
                Arg::I(t_i),
                Arg::I(conv_i),
                Arg::I(k_i),
            ],
        )
    }
}
