//! LoRA: the adapters' layout in their groups, the block-diagonal and concatenated `[W | B]`
//! matrices, and the adapters' forward and backward.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;
use half::bf16;

use super::arena::Activations;
use super::gemm::Lin;
use super::params::{group_first, lora_width, LayerIdx, LoraIdx, G_GU, G_QKV, LORA_GROUPS};
use super::{align, check, ptr, Arg, ModelStep};
use crate::engine::dropout;
use crate::engine::kernels::cuda::{err, multi_grid};
use crate::engine::kernels::side::Buf;

/// A LoRA group run as one matmul with its base projection (`kernels.lora_concat`;
/// [`ModelStep::plan_lora_blocks`]): the 16-bit matrix `[W | B]` of `out` rows (the base's
/// parts' rows, then the group's block-diagonal B beside them) and its row stride `ld` = the
/// model width + the group's Σ r — also the row stride of the group's normed input, whose last
/// columns hold `u = scale·x·[A₁; A₂; …]ᵀ`. Forward `y = [x | u]·[W | B]ᵀ`, backward
/// `[dx | du] = dy·[W | B]`: no pass of the adapters' own over the projection's output.
#[derive(Clone, Copy)]
pub(super) struct Cat {
    pub(super) w: u64,
    pub(super) ld: usize,
}

/// An error unless a block-diagonal B's output row stride `ldy` is its projection's width
/// `out` (the matmul writes `out` columns a row).
fn check_stride(ldy: usize, out: usize) -> Result<()> {
    check(ldy == out, || {
        format!("a LoRA group's output row stride {ldy} is not its projection's width {out}")
    })
}

/// Rows per 2D memset: long-context micro-batches have hundreds of thousands of rows, and the
/// driver documents no limit on a 2D memset's height; bands of this many rows stay inside any
/// (a precaution, not a measured failure).
const MEMSET_ROWS: usize = 32768;

/// Zeroes `cols` 16-bit columns of `rows` rows from `p` (row pitch `ld` elements), queued on
/// `stream`, in bands of at most [`MEMSET_ROWS`] rows.
///
/// # Safety
/// The columns must lie inside an allocation that `stream` may write.
pub(super) unsafe fn memset_cols(
    p: u64,
    ld: usize,
    cols: usize,
    rows: usize,
    stream: &CudaStream,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    for r0 in (0..rows).step_by(MEMSET_ROWS) {
        let band = MEMSET_ROWS.min(rows - r0);
        let start = p + (2 * ld * r0) as u64;
        // SAFETY: the caller's contract (rows r0..r0 + band of the same columns); the driver
        // checks the pitch and extent.
        unsafe { sys::cuMemsetD2D16Async(start, 2 * ld, 0, cols, band, stream.cu_stream()) }
            .result()
            .w()?;
    }
    Ok(())
}

impl ModelStep {
    /// The output width of layer `li`'s LoRA group `g`'s projection (the row stride of its
    /// output).
    pub(super) fn group_out(&self, li: &LayerIdx, g: usize) -> usize {
        match g {
            G_QKV => self.in_width(li),
            G_GU => self.up_out(),
            _ => self.c,
        }
    }

    /// A SwiGLU MLP whose gate and up are two matrices (a hybrid's shared MLP has them as
    /// one, `shared_mlp.input_linear`, and its "up" adapter covers both).
    pub(super) fn gate_apart(&self) -> bool {
        self.swiglu && self.mamba.is_none()
    }

    /// The base's matrices under LoRA group `g` — q|k|v (a Mamba layer's in_proj) or gate|up
    /// (or the GELU MLP's up, a hybrid's gate | up) — as their first entry and how many; None
    /// for o and down.
    pub(super) fn group_parts(&self, li: &LayerIdx, g: usize) -> Option<(usize, usize)> {
        match g {
            G_QKV if li.mamba.is_some() => Some((li.qkv_w, 1)),
            G_QKV => Some((li.qkv_w, 3)),
            G_GU => Some((li.up_w, 1 + self.gate_apart() as usize)),
            _ => None,
        }
    }

    /// Whether group `g` of a layer (its adapters `ads`) runs as one `[W | B]` matmul with its
    /// base ([`Cat`]): asked for (`kernels.lora_concat`), q|k|v or gate|up, adapters of one
    /// scale whose Σ r is a multiple of 8 (16-byte rows), a frozen 16-bit base with nothing of
    /// it training (a weight gradient would want `x` alone), and the rows-in-registers norms
    /// (which write and read the strided rows).
    pub(super) fn concat_ok(&self, li: &LayerIdx, g: usize, ads: &[LoraIdx]) -> bool {
        let Some((first, count)) = self.group_parts(li, g) else {
            return false;
        };
        let bias = if g == G_QKV { li.qkv_b } else { li.up_b };
        self.lora_concat
            && self.k.norm_v8.is_some()
            && !ads.is_empty()
            && ads.iter().all(|ad| ad.scale == ads[0].scale)
            && lora_width(li, g).is_multiple_of(8)
            && (first..first + count).all(|i| {
                let e = &self.entries[i];
                e.frozen && e.quant.is_none() && self.trained_grad_ptr(i).is_none()
            })
            && self.grad_ptr_or_null(bias) == 0
    }

    /// Activations out the groups' B matrices: a group that runs concatenated ([`Self::concat_ok`])
    /// gets its `[W | B]` ([`Cat`]; the base's parts copied in by [`Self::cast_weights`]);
    /// every other group of two or more adapters of one scale (q, k, v; gate, up) its
    /// block-diagonal B, one zeroed `[out, Σ r]` matrix. A table says where each adapter's B
    /// goes ([`Self::lora_blocks`]).
    pub(super) fn plan_lora_blocks(&mut self) -> Result<()> {
        let c = self.c;
        let (mut at, mut cats) = (Vec::new(), Vec::new());
        // (source entry, element offset, rows, columns, row stride)
        let (mut blocks, mut parts) = (Vec::new(), Vec::new());
        let mut len = 0;
        for li in &self.layers {
            let (mut offs, mut cat) = ([None; 4], [None; 4]);
            for g in 0..LORA_GROUPS.len() {
                let ads: Vec<LoraIdx> = LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]).collect();
                let width = lora_width(li, g);
                // (Concatenated: the base's columns first.)
                let (ld, c0) = match self.group_parts(li, g) {
                    Some((first, count)) if self.concat_ok(li, g, &ads) => {
                        let mut row = 0;
                        for i in first..first + count {
                            let rows = self.entries[i].rows;
                            parts.push((i, len + row * (c + width), rows, c, c + width));
                            row += rows;
                        }
                        let out = self.group_out(li, g);
                        check(row == out, || {
                            format!("LoRA group {g}'s base parts have {row} rows, its output {out}")
                        })?;
                        cat[g] = Some((len, c + width));
                        (c + width, c)
                    }
                    _ if ads.len() < 2 || ads.iter().any(|ad| ad.scale != ads[0].scale) => continue,
                    _ => {
                        offs[g] = Some(len);
                        (width, 0)
                    }
                };
                for ad in &ads {
                    blocks.push((ad.b, len + ad.col * ld + c0 + ad.ucol, ad.out, ad.r, ld));
                }
                len = align(len + self.group_out(li, g) * ld);
            }
            at.push(offs);
            cats.push(cat);
        }
        if blocks.is_empty() {
            self.lora_bd = vec![[0; 4]; at.len()];
            self.lora_cat = vec![[None; 4]; at.len()];
            return Ok(());
        }
        // The base's copy is made where it takes at most a quarter of the device memory free
        // now; otherwise (or where it does not fit after all) every group beside its base.
        let free = self
            .stream
            .context()
            .mem_get_info()
            .map_or(usize::MAX, |m| m.0);
        if !parts.is_empty() && 2 * len > free / 4 {
            self.lora_concat = false;
            return self.plan_lora_blocks();
        }
        let buf = match self.dev.alloc_zeros::<bf16>(len) {
            Ok(buf) => buf,
            Err(_) if !parts.is_empty() => {
                self.lora_concat = false;
                return self.plan_lora_blocks();
            }
            Err(e) => return Err(e),
        };
        let base = ptr(&buf, &self.stream);
        let at_base = |o: usize| base + 2 * o as u64;
        self.lora_bd = at
            .iter()
            .map(|offs| offs.map(|o| o.map_or(0, at_base)))
            .collect();
        self.lora_cat = cats
            .iter()
            .map(|cat| {
                cat.map(|o| {
                    o.map(|(off, ld)| Cat {
                        w: at_base(off),
                        ld,
                    })
                })
            })
            .collect();
        let table = |items: &[(usize, usize, usize, usize, usize)]| -> Result<_> {
            if items.is_empty() {
                return Ok(None);
            }
            let mut words = Vec::with_capacity(5 * items.len());
            for &(src, off, rows, cols, ld) in items {
                let src = self.weight_ptr(src)?;
                words.extend([src, at_base(off), rows as u64, cols as u64, ld as u64]);
            }
            let mut dev_table = self.dev.alloc_zeros::<u64>(words.len())?;
            self.stream.memcpy_htod(&words, &mut dev_table).w()?;
            let max_n = items.iter().map(|b| b.2 * b.3).max().unwrap_or(1);
            Ok(Some((dev_table, items.len(), max_n)))
        };
        let bd_table = table(&blocks)?;
        let cat_table = table(&parts)?;
        self._lora_bd_buf = Some(buf);
        self.lora_bd_table = bd_table;
        self.lora_cat_table = cat_table;
        Ok(())
    }

    /// Group `g` of layer `l` as one matmul with its base, if it runs so ([`Cat`]).
    pub(super) fn cat(&self, l: usize, g: usize) -> Option<Cat> {
        self.lora_cat.get(l).and_then(|c| c[g])
    }

    /// The row stride of group `g`'s normed input in layer `l`: the model width, or the
    /// `[x | u]` rows of a concatenated group.
    pub(super) fn ln_ld(&self, l: usize, g: usize) -> usize {
        self.cat(l, g).map_or(self.c, |c| c.ld)
    }

    /// Copy every adapter's B (its bf16 copy as the optimizer last wrote it) into its
    /// group's block-diagonal matrix ([`Self::plan_lora_blocks`]); nothing without one.
    pub(super) fn lora_blocks(&self) -> Result<()> {
        self.copy_blocks(&self.lora_bd_table)
    }

    /// One launch of the block copy over a table of (source, destination, rows, columns,
    /// destination row stride) items ([`Self::plan_lora_blocks`]); nothing without one.
    pub(super) fn copy_blocks(&self, table: &Option<(CudaSlice<u64>, usize, usize)>) -> Result<()> {
        let Some((table, count, max_n)) = table else {
            return Ok(());
        };
        let table = ptr(table, &self.stream);
        self.launch(
            &self.k.lora_blocks,
            multi_grid(*max_n, *count)?,
            &[Arg::P(table)],
        )
    }

    /// The forward of LoRA group `g` of layer `l` ([`LORA_GROUPS`]; nothing without an
    /// adapter), before the base's matmul: `u = x·[A₁; A₂; …]ᵀ` in one matmul (kept for the
    /// backward), then each adapter's `y[:, col..] = scale·u_k·B_kᵀ` into the projection's
    /// output of row stride `ldy`, the columns no adapter covers zeroed. Returns the beta of
    /// the base's matmul: 1 (add onto that: cuBLAS reads y in its epilogue, where a read of
    /// its own after the base would cost a pass over the output) or 0 (no adapter).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_fwd(
        &self,
        a: &Activations,
        l: usize,
        li: &LayerIdx,
        g: usize,
        x: u64,
        y: u64,
        ldy: usize,
    ) -> Result<f32> {
        let width = lora_width(li, g);
        let Some(first) = group_first(li, g) else {
            return Ok(0.0);
        };
        let n = a.n;
        let u = a.lora_u[l][g];
        let down = Lin::new(n, first.inp, width, width);
        let (x, _) = self.lora_input(a, l, g, (x, first.inp), first.inp)?;
        self.mm(
            "lora.xa",
            down.fwd(x, self.weight_ptr(first.a)?, u),
            false,
            1.0,
            0.0,
        )?;
        // The group's adapters sit on its output in column order (q, k, v; gate, up): the
        // gaps between them are the columns to zero.
        let zero = |start: usize, end: usize| -> Result<()> {
            if start == end {
                return Ok(());
            }
            // SAFETY: columns start..end ≤ ldy of y's n rows (row pitch ldy) lie inside y;
            // the memset is queued on the step's stream, which owns y.
            unsafe { memset_cols(y + 2 * start as u64, ldy, end - start, n, &self.stream) }
        };
        let bd = self.lora_bd[l][g];
        if bd != 0 {
            check_stride(ldy, self.group_out(li, g))?;
            // Every adapter at once, through the block-diagonal B: y = scale·u·Bᵀ.
            let up = Lin::new(n, width, ldy, ldy);
            self.mm("lora.ub", up.fwd(u, bd, y), false, first.scale, 0.0)?;
            return Ok(1.0);
        }
        let mut at = 0;
        for ad in LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]) {
            check(ad.col >= at && ad.col + ad.out <= ldy, || {
                format!(
                    "a LoRA adapter's columns {}..{} overlap the one before (to {at}) or pass the \
                     output's row stride {ldy}",
                    ad.col,
                    ad.col + ad.out
                )
            })?;
            zero(at, ad.col)?;
            at = ad.col + ad.out;
            let up = Lin::new(n, ad.r, ad.out, ldy).ldx(width);
            let (u, y) = (u + 2 * ad.ucol as u64, y + 2 * ad.col as u64);
            self.mm(
                "lora.ub",
                up.fwd(u, self.weight_ptr(ad.b)?, y),
                false,
                ad.scale,
                0.0,
            )?;
        }
        zero(at, ldy)?;
        Ok(1.0)
    }

    /// The backward of LoRA group `g` of layer `l` (nothing without an adapter), from the
    /// projection output's gradient `sc·dy` (row stride `ldy`, in the scratch `buf`; `sc` a
    /// scale still owed to it, taken into the matmuls' alpha), before the
    /// base's data gradient: du_k = scale·dy·B_k (one matmul through the group's block-diagonal
    /// B where it has one), the weight gradients dB_k (+)= scale·dyᵀ·u_k and dA (+)= duᵀ·x —
    /// on the side stream where there is one: they read only `dy` (released after) and what
    /// stays put until the pass ends (this layer's u, du and x) — and `dx = du·[A₁; A₂; …]`
    /// into the input's gradient. Returns the beta of the base's data-gradient matmul (1: add
    /// onto that; 0: no adapter).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lora_bwd(
        &self,
        a: &Activations,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        (dy, buf, sc): (u64, Buf, f32),
        ldy: usize,
        dx: u64,
        first: bool,
    ) -> Result<f32> {
        let width = lora_width(li, g);
        let Some(a0) = group_first(li, g) else {
            return Ok(0.0);
        };
        let n = a.n;
        let (u, du) = (a.lora_u[l][g], a.lora_du[l][g]);
        let beta = if first { 0.0 } else { 1.0 };
        let ads = || LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]);
        // The adapter's columns of dy, u and du, and its shape.
        let part = |ad: LoraIdx| {
            let up = Lin::new(n, ad.r, ad.out, ldy).ldx(width);
            let at = |p: u64, col: usize| p + 2 * col as u64;
            (up, at(dy, ad.col), at(u, ad.ucol), at(du, ad.ucol))
        };
        let bd = self.lora_bd[l][g];
        if bd != 0 {
            check_stride(ldy, self.group_out(li, g))?;
            let up = Lin::new(n, width, ldy, ldy);
            self.mm("lora.du", up.dx(dy, bd, du), false, a0.scale * sc, 0.0)?;
        } else {
            for ad in ads() {
                let (up, dy, _, du) = part(ad);
                self.mm(
                    "lora.du",
                    up.dx(dy, self.weight_ptr(ad.b)?, du),
                    false,
                    ad.scale * sc,
                    0.0,
                )?;
            }
        }
        // (LoRA dropout's dropped input is a scratch shared by every group: one stream then.)
        let side = if self.lora_thr == 0 {
            self.fork()?
        } else {
            None
        };
        for ad in ads() {
            let (up, dy, u, _) = part(ad);
            let mm = up.dw(u, dy, self.grad_ptr(ad.b));
            self.mm_on("lora.db", mm, (ad.scale * sc, beta), side)?;
        }
        let down = Lin::new(n, a0.inp, width, width);
        let (xd, _) = self.lora_input(a, l, g, (x, a0.inp), a0.inp)?;
        self.mm_on(
            "lora.da",
            down.dw(xd, du, self.grad_ptr(a0.a)),
            (1.0, beta),
            side,
        )?;
        if side.is_some() {
            self.release(buf)?;
        }
        if self.lora_thr == 0 {
            self.mm(
                "lora.dx",
                down.dx(du, self.weight_ptr(a0.a)?, dx),
                false,
                1.0,
                0.0,
            )?;
            return Ok(1.0);
        }
        // dx = mask ⊙ (du·[A₁; A₂; …]), through the scratch that held the dropped input.
        self.mm(
            "lora.dx",
            down.dx(du, self.weight_ptr(a0.a)?, a.lora_x),
            false,
            1.0,
            0.0,
        )?;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        self.drop_scaled(a, (a.lora_x, dx), (n, a0.inp), site, drop, false)?;
        Ok(1.0)
    }

    /// The adapters' input of group `g` of layer `l`: `x` itself (rows `ldx` apart), or with
    /// LoRA dropout `x` through its mask into the `lora_x` scratch (`[N, inp]`, dense); the
    /// address and its row stride.
    pub(super) fn lora_input(
        &self,
        a: &Activations,
        l: usize,
        g: usize,
        (x, ldx): (u64, usize),
        inp: usize,
    ) -> Result<(u64, usize)> {
        if self.lora_thr == 0 {
            return Ok((x, ldx));
        }
        let n = a.n;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        let io = ((x, ldx), (a.lora_x, inp));
        self.drop_scaled_ld(a, io, (n, inp), site, drop, false)?;
        Ok((a.lora_x, inp))
    }

    /// The projection of LoRA group `g` (q|k|v, or gate|up / the GELU MLP's up) of layer `l`
    /// from its normed input `x` into `y` (`d`: its shape), the bias `b` included: one
    /// `[x | u]·[W | B]ᵀ` after `u` where the group runs concatenated ([`Cat`]), else the
    /// adapters' share ([`Self::lora_fwd`]) and the base's matmul onto it.
    pub(super) fn group_fwd(
        &self,
        a: &Activations,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        b: Option<usize>,
        y: u64,
        d: Lin,
    ) -> Result<()> {
        let (Some(cat), Some(a0)) = (self.cat(l, g), group_first(li, g)) else {
            let parts = self
                .group_parts(li, g)
                .ok_or_else(|| err("whole-model step: no projection under a LoRA group"))?;
            let beta = self.lora_fwd(a, l, li, g, x, y, d.ldy)?;
            return self.lin_fwd_parts(x, parts, b, y, d, beta);
        };
        let n = a.n;
        let width = cat.ld - self.c;
        // u = scale·x·[A₁; A₂; …]ᵀ into x's last columns (kept there for the backward).
        let (xa, ldx) = self.lora_input(a, l, g, (x, cat.ld), a0.inp)?;
        let down = Lin::new(n, a0.inp, width, cat.ld).ldx(ldx);
        let u = x + 2 * self.c as u64;
        self.mm(
            "lora.xa",
            down.fwd(xa, self.weight_ptr(a0.a)?, u),
            false,
            a0.scale,
            0.0,
        )?;
        let wide = Lin::new(d.rows, cat.ld, d.out, d.ldy);
        self.lin_fwd_bias(x, cat.w, b, y, wide, 0.0)
    }

    /// The backward of group `g`'s projection (as [`Self::group_fwd`]) from its output's
    /// gradient `dy` (in the scratch `buf`; shape `d`): the input's gradient into `da`
    /// and the adapters' weight gradients. Returns `da`'s row stride (the model width, or
    /// a concatenated group's `[dx | du]`).
    pub(super) fn group_bwd(
        &self,
        a: &Activations,
        (l, li, g): (usize, &LayerIdx, usize),
        x: u64,
        (dy, buf): (u64, Buf),
        d: Lin,
        first: bool,
    ) -> Result<usize> {
        let (Some(cat), Some(a0)) = (self.cat(l, g), group_first(li, g)) else {
            let parts = self
                .group_parts(li, g)
                .ok_or_else(|| err("whole-model step: no projection under a LoRA group"))?;
            let beta = self.lora_bwd(a, (l, li, g), x, (dy, buf, 1.0), d.ldy, a.da, first)?;
            self.lin_dx_parts(dy, parts, a.da, d, beta)?;
            return Ok(self.c);
        };
        let (n, c) = (a.n, self.c);
        let width = cat.ld - c;
        let beta = if first { 0.0 } else { 1.0 };
        let u = x + 2 * c as u64;
        // dB_k (+)= dyᵀ·u_k (the scale is in u), on the side stream where there is one: it
        // reads `dy` (released after) and this layer's kept input.
        let side = if self.lora_thr == 0 {
            self.fork()?
        } else {
            None
        };
        for ad in LORA_GROUPS[g].iter().filter_map(|&j| li.lora[j]) {
            let up = Lin::new(n, ad.r, ad.out, d.ldy).ldx(cat.ld);
            let at = |p: u64, col: usize| p + 2 * col as u64;
            let mm = up.dw(at(u, ad.ucol), at(dy, ad.col), self.grad_ptr(ad.b));
            self.mm_on("lora.db", mm, (1.0, beta), side)?;
        }
        if side.is_some() {
            self.release(buf)?;
        }
        // [dx | du] = dy·[W | B]: the input's gradient and every adapter's du = dy·B_k at once.
        let wide = Lin::new(n, cat.ld, d.out, d.ldy);
        self.lin_dx_beta(dy, cat.w, a.da, wide, 0.0)?;
        let du = a.da + 2 * c as u64;
        // dA (+)= scale·duᵀ·x and dx += scale·du·[A₁; A₂; …], on the main stream (du lives in
        // `da`, which the next projection's gradient overwrites).
        let (xd, ldx) = self.lora_input(a, l, g, (x, cat.ld), a0.inp)?;
        let down = Lin::new(n, a0.inp, width, cat.ld);
        let da = down.ldx(ldx).dw(xd, du, self.grad_ptr(a0.a));
        self.mm_on("lora.da", da, (a0.scale, beta), None)?;
        if self.lora_thr == 0 {
            let dx = down.ldx(cat.ld).dx(du, self.weight_ptr(a0.a)?, a.da);
            self.mm("lora.dx", dx, false, a0.scale, 1.0)?;
            return Ok(cat.ld);
        }
        // dx += mask ⊙ (scale·du·[A₁; A₂; …]), through the scratch that held the dropped input.
        let dx = down.dx(du, self.weight_ptr(a0.a)?, a.lora_x);
        self.mm("lora.dx", dx, false, a0.scale, 0.0)?;
        let site = dropout::site_lora(l, g);
        let drop = (self.lora_thr, self.lora_scale);
        let io = ((a.lora_x, a0.inp), (a.da, cat.ld));
        self.drop_scaled_ld(a, io, (n, a0.inp), site, drop, true)?;
        Ok(cat.ld)
    }
}
