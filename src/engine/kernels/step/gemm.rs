//! Matmuls: the linear layers' shapes and their cuBLAS and cuBLASLt calls.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as bsys};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::Result;

use super::ModelStep;
use crate::engine::kernels::cuda::{err, i32_of};
use crate::engine::kernels::lt::{Epi, Mm, Operand};
use crate::engine::kernels::side::{Buf, Side};

/// A linear layer's shape: `[rows, inp]` in, `[rows, out]` out; `ldy` is the output's (or
/// its gradient's) row stride.
#[derive(Clone, Copy)]
pub(super) struct Lin {
    pub(super) rows: usize,
    pub(super) inp: usize,
    pub(super) out: usize,
    pub(super) ldy: usize,
    /// The input's (or its gradient's) row stride: `inp` unless set ([`Lin::ldx`]).
    pub(super) ldx: usize,
}

impl Lin {
    pub(super) fn new(rows: usize, inp: usize, out: usize, ldy: usize) -> Self {
        Self {
            rows,
            inp,
            out,
            ldy,
            ldx: inp,
        }
    }

    /// The same layer over an input of row stride `ldx` (columns of a wider matrix).
    pub(super) fn ldx(self, ldx: usize) -> Self {
        Self { ldx, ..self }
    }

    /// `y[rows, out] = x[rows, inp]·wᵀ` (row-major; `ldy` ≥ out).
    pub(super) fn fwd(&self, x: u64, w: u64, y: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (true, false),
            mnk: (self.out, self.rows, self.inp),
            a: op(w, self.inp),
            b: op(x, self.ldx),
            c: op(y, self.ldy),
        }
    }

    /// `dx[rows, inp] = dy[rows, out]·w`.
    pub(super) fn dx(&self, dy: u64, w: u64, dx: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (false, false),
            mnk: (self.inp, self.rows, self.out),
            a: op(w, self.inp),
            b: op(dy, self.ldy),
            c: op(dx, self.ldx),
        }
    }

    /// `dw[out, inp] (+)= dyᵀ·x`.
    pub(super) fn dw(&self, x: u64, dy: u64, dw: u64) -> Mm {
        let op = |p, ld| Operand { p, ld };
        Mm {
            t: (false, true),
            mnk: (self.inp, self.out, self.rows),
            a: op(x, self.ldx),
            b: op(dy, self.ldy),
            c: op(dw, self.inp),
        }
    }
}

/// A matrix operand for cuBLAS: device address, leading dimension, batch stride (elements).
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub(super) p: u64,
    pub(super) ld: i32,
    pub(super) stride: i64,
}

pub(super) fn mat(p: u64, ld: usize) -> Mat {
    Mat {
        p,
        ld: ld as i32,
        stride: 0,
    }
}

pub(super) fn bmat(p: u64, ld: usize, stride: usize) -> Mat {
    Mat {
        p,
        ld: ld as i32,
        stride: stride as i64,
    }
}

impl ModelStep {
    /// `C = op(A)·op(B) (+ beta·C)` column-major, bf16 operands, fp32 accumulation; C in
    /// fp32 (weight gradients) or bf16; `batch > 1` strides every operand.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        name: &'static str,
        t: (bool, bool),
        mnk: (usize, usize, usize),
        a: Mat,
        b: Mat,
        c: Mat,
        c_f32: bool,
        beta: f32,
        batch: usize,
    ) -> Result<()> {
        self.gemm_ab(name, t, mnk, (a, b, c), c_f32, (1.0, beta), batch)
    }

    /// [`Self::gemm`] with `C = alpha·op(A)·op(B) + beta·C`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_ab(
        &self,
        name: &'static str,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, b, c): (Mat, Mat, Mat),
        c_f32: bool,
        (alpha, beta): (f32, f32),
        batch: usize,
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let bf = if self.half {
            bsys::cudaDataType::CUDA_R_16F
        } else {
            bsys::cudaDataType::CUDA_R_16BF
        };
        let ct = if c_f32 {
            bsys::cudaDataType::CUDA_R_32F
        } else {
            bf
        };
        let (m, n, k) = (i32_of(m, "m")?, i32_of(n, "n")?, i32_of(k, "k")?);
        let h = *self.blas.handle();
        let algo = bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
        let compute = bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let alpha_p = &alpha as *const f32 as *const _;
        let beta_p = &beta as *const f32 as *const _;
        // SAFETY: the operands are device addresses inside this step's buffers, sized by the
        // caller for these shapes; the handle is bound to this device's stream.
        self.timed(name, || {
            let r = unsafe {
                if batch > 1 {
                    blas::gemm_strided_batched_ex(
                        h,
                        op(ta),
                        op(tb),
                        m,
                        n,
                        k,
                        alpha_p,
                        a.p as *const _,
                        bf,
                        a.ld,
                        a.stride,
                        b.p as *const _,
                        bf,
                        b.ld,
                        b.stride,
                        beta_p,
                        c.p as *mut _,
                        ct,
                        c.ld,
                        c.stride,
                        i32_of(batch, "batch")?,
                        compute,
                        algo,
                    )
                } else {
                    blas::gemm_ex(
                        h,
                        op(ta),
                        op(tb),
                        m,
                        n,
                        k,
                        alpha_p,
                        a.p as *const _,
                        bf,
                        a.ld,
                        b.p as *const _,
                        bf,
                        b.ld,
                        beta_p,
                        c.p as *mut _,
                        ct,
                        c.ld,
                        compute,
                        algo,
                    )
                }
            };
            r.map_err(|e| err(format!("cuBLAS gemm: {e:?}")))
        })
    }

    /// One linear layer's matmul (bf16 operands, C in fp32 or bf16): cuBLASLt's tuned
    /// algorithm, on `side` if given, or cuBLAS where cuBLASLt has none (on the step's
    /// stream, which is as well ordered: after the operands are written, before anything
    /// overwrites them).
    pub(super) fn lin_gemm(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        beta: f32,
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        self.lin_gemm_ab(name, mm, c_f32, (1.0, beta), side)
    }

    /// [`Self::lin_gemm`] with `C = alpha·op(A)·op(B) + beta·C`.
    pub(super) fn lin_gemm_ab(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        ab: (f32, f32),
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        if self.lt_matmul(name, mm, c_f32, ab, Epi::None, side)? {
            return Ok(());
        }
        let m = |o: Operand| mat(o.p, o.ld);
        let (a, b, c) = (m(mm.a), m(mm.b), m(mm.c));
        self.gemm_ab(name, mm.t, mm.mnk, (a, b, c), c_f32, ab, 1)
    }

    /// `y[rows, out] = x[rows, inp]·wᵀ` (row-major; `ldy` ≥ out).
    pub(super) fn lin_fwd(&self, x: u64, w: u64, y: u64, d: Lin) -> Result<()> {
        self.lin_fwd_beta(x, w, y, d, 0.0)
    }

    /// [`Self::lin_fwd`] plus `beta`·y (1: on top of the adapters' share).
    pub(super) fn lin_fwd_beta(&self, x: u64, w: u64, y: u64, d: Lin, beta: f32) -> Result<()> {
        self.lin_gemm("matmul fwd", d.fwd(x, w, y), false, beta, None)
    }

    /// `dx[rows, inp] = dy[rows, out]·w`.
    pub(super) fn lin_dx(&self, dy: u64, w: u64, dx: u64, d: Lin) -> Result<()> {
        self.lin_dx_beta(dy, w, dx, d, 0.0)
    }

    /// [`Self::lin_dx`] plus `beta`·dx (1: on top of the adapters' share).
    pub(super) fn lin_dx_beta(&self, dy: u64, w: u64, dx: u64, d: Lin, beta: f32) -> Result<()> {
        self.lin_dx_ab(dy, w, dx, d, (1.0, beta))
    }

    /// `dx = alpha·dy·w + beta·dx` (alpha: a scale still owed to `dy`).
    pub(super) fn lin_dx_ab(&self, dy: u64, w: u64, dx: u64, d: Lin, ab: (f32, f32)) -> Result<()> {
        self.lin_gemm_ab("matmul dgrad", d.dx(dy, w, dx), false, ab, None)
    }

    /// `dw[out, inp] += dyᵀ·x` into fp32; the step's first micro-batch overwrites instead
    /// (`first`: the buffer is not zeroed, and C is not read).
    pub(super) fn lin_dw(&self, x: u64, dy: u64, dw: u64, d: Lin, first: bool) -> Result<()> {
        self.lin_dw_on(None, x, dy, dw, d, first)
    }

    /// [`Self::lin_dw`] queued on `side` when there is one ([`Self::lin_gemm`]).
    pub(super) fn lin_dw_on(
        &self,
        side: Option<&Arc<CudaStream>>,
        x: u64,
        dy: u64,
        dw: u64,
        d: Lin,
        first: bool,
    ) -> Result<()> {
        let beta = if first { 0.0 } else { 1.0 };
        self.lin_gemm("matmul wgrad", d.dw(x, dy, dw), true, beta, side)
    }

    /// The side stream, after it waits for the main stream's work so far ([`Side::fork`]);
    /// None when there is none or profiling is on.
    pub(super) fn fork(&self) -> Result<Option<&Arc<CudaStream>>> {
        match self.side() {
            Some(s) => s.fork().map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn side(&self) -> Option<&Side> {
        self.side.as_ref().filter(|_| self.prof.is_none())
    }

    /// [`Side::release`] (nothing without a side stream).
    pub(super) fn release(&self, buf: Buf) -> Result<()> {
        self.side().map_or(Ok(()), |s| s.release(buf))
    }

    /// [`Side::reclaim`] (nothing without a side stream).
    pub(super) fn reclaim(&self, buf: Buf) -> Result<()> {
        self.side().map_or(Ok(()), |s| s.reclaim(buf))
    }

    /// One linear layer's matmul through cuBLASLt with an epilogue. Ok(false): epilogues
    /// off, no cuBLASLt or no algorithm for it; nothing ran.
    pub(super) fn lin_lt(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        beta: f32,
        epi: Epi,
    ) -> Result<bool> {
        if !self.epilogues {
            return Ok(false);
        }
        self.lt_matmul(name, mm, c_f32, (1.0, beta), epi, None)
    }

    /// [`Lt::matmul`](crate::engine::kernels::lt::Lt::matmul), timed under `name`. Ok(false): no cuBLASLt or no algorithm for it.
    pub(super) fn lt_matmul(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        ab: (f32, f32),
        epi: Epi,
        side: Option<&Arc<CudaStream>>,
    ) -> Result<bool> {
        let Some(lt) = &self.lt else {
            return Ok(false);
        };
        let mut done = false;
        self.timed(name, || {
            done = lt.matmul(mm, c_f32, ab, epi, side.map(|s| &**s))?;
            Ok(())
        })?;
        Ok(done)
    }

    /// [`Self::lin_fwd_beta`] with a bias (+ GELU) epilogue.
    pub(super) fn lin_fwd_epi(
        &self,
        x: u64,
        w: u64,
        y: u64,
        d: Lin,
        epi: Epi,
        beta: f32,
    ) -> Result<bool> {
        let name = match epi {
            Epi::GeluAuxBias { .. } => "matmul fwd+bias+gelu",
            _ => "matmul fwd+bias",
        };
        self.lin_lt(name, d.fwd(x, w, y), false, beta, epi)
    }

    /// [`Self::lin_fwd_bias`] of a packed projection (`parts`: its first entry and how many):
    /// one matmul, or one per part into its columns of `y` when the parts lie apart.
    /// `beta` 1: add to what `y` holds (the adapters' share, [`Self::lora_fwd`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lin_fwd_parts(
        &self,
        x: u64,
        parts: (usize, usize),
        b: Option<usize>,
        y: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        if self.packed(parts) {
            return self.lin_fwd_bias(x, self.matmul_weight(parts.0)?, b, y, d, beta);
        }
        let mut col = 0;
        for i in parts.0..parts.0 + parts.1 {
            let out = self.entries[i].rows;
            let part = Lin::new(d.rows, d.inp, out, d.ldy);
            self.lin_fwd_beta(x, self.matmul_weight(i)?, y + 2 * col as u64, part, beta)?;
            col += out;
        }
        if let Some(b) = b {
            self.bias_act(y, self.weight_ptr(b)?, y, d.rows, d.out, 0)?;
        }
        Ok(())
    }

    /// [`Self::lin_dx`] of a packed projection: the parts' data gradients summed (one
    /// matmul when they are one matrix); `beta` 1: added to what `dx` holds (the adapters'
    /// share, [`Self::lora_bwd`]).
    pub(super) fn lin_dx_parts(
        &self,
        dy: u64,
        parts: (usize, usize),
        dx: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        if self.packed(parts) {
            return self.lin_dx_beta(dy, self.matmul_weight(parts.0)?, dx, d, beta);
        }
        let mut col = 0;
        for (k, i) in (parts.0..parts.0 + parts.1).enumerate() {
            let out = self.entries[i].rows;
            let mm = Lin::new(d.rows, d.inp, out, d.ldy).dx(
                dy + 2 * col as u64,
                self.matmul_weight(i)?,
                dx,
            );
            let beta = if k == 0 { beta } else { 1.0 };
            self.lin_gemm("matmul dgrad", mm, false, beta, None)?;
            col += out;
        }
        Ok(())
    }

    /// `y = x·wᵀ (+ b)` (`wp`: the matrix's address), `beta` as [`Self::lin_fwd_beta`]'s: the
    /// bias as a cuBLASLt epilogue where it runs, else a bias kernel.
    pub(super) fn lin_fwd_bias(
        &self,
        x: u64,
        wp: u64,
        b: Option<usize>,
        y: u64,
        d: Lin,
        beta: f32,
    ) -> Result<()> {
        let Some(b) = b else {
            return self.lin_fwd_beta(x, wp, y, d, beta);
        };
        let bias = Epi::Bias {
            bias: self.weight_ptr(b)?,
        };
        if !self.lin_fwd_epi(x, wp, y, d, bias, beta)? {
            self.lin_fwd_beta(x, wp, y, d, beta)?;
            self.bias_act(y, self.weight_ptr(b)?, y, d.rows, d.out, 0)?;
        }
        Ok(())
    }

    /// An adapter's weight-gradient matmul (fp32 C): on `side` through cuBLASLt, or [`Self::mm`]
    /// on the main stream.
    pub(super) fn mm_on(
        &self,
        name: &'static str,
        mm: Mm,
        (alpha, beta): (f32, f32),
        side: Option<&Arc<CudaStream>>,
    ) -> Result<()> {
        match side {
            Some(_) => self.lin_gemm_ab(name, mm, true, (alpha, beta), side),
            None => self.mm(name, mm, true, alpha, beta),
        }
    }

    /// One matmul through cuBLAS with `alpha` (the adapters' small matmuls: on the Llama-style
    /// 114M with LoRA q, v, cuBLASLt's tuned pick was no faster, 1.00 against 1.05 ms a step in all
    /// with the block-diagonal B, its x·Aᵀ and dB slower).
    pub(super) fn mm(
        &self,
        name: &'static str,
        mm: Mm,
        c_f32: bool,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let m = |o: Operand| mat(o.p, o.ld);
        let (a, b, c) = (m(mm.a), m(mm.b), m(mm.c));
        self.gemm_ab(name, mm.t, mm.mnk, (a, b, c), c_f32, (alpha, beta), 1)
    }
}
