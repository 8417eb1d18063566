//! The routed experts' matmuls: one product per expert that has rows (its rows a contiguous
//! run of the pairs in expert order), as one grouped cuBLAS call a kind
//! (`cublasGemmGroupedBatchedEx`, CUDA 12.5 on) over device arrays of the experts' operand
//! addresses, written once a layer after its router (where the stream has just been waited
//! for). A grouped call cuBLAS refuses, an older toolkit's build, or `COCKPIT_MOE_GROUPED=0`
//! (to compare) runs one cuBLAS call an expert instead. (One H200, 64 experts of width 512, six
//! a token, B4×4 T2048: the experts' six products took 274 ms a step grouped against 417 ms
//! as one call an expert, the whole step 906 against 951 ms.)

#[cfg(cublas_grouped)]
use candle_core::cuda_backend::cudarc::cublas::sys as bsys;
use candle_core::cuda_backend::cudarc::driver::result as drv;
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::gemm::{mat, Mat};
use super::ModelStep;
use crate::engine::kernels::cuda::err;
#[cfg(cublas_grouped)]
use crate::engine::kernels::cuda::i32_of;

/// The experts' products, forward (gate | up, down), backward (their inputs' gradients) and
/// their weights' gradients (full fine-tuning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExpertMm {
    GateUp,
    Down,
    DownDx,
    GateUpDx,
    DownDw,
    GateUpDw,
}

impl ExpertMm {
    pub(super) const ALL: [ExpertMm; 6] = [
        ExpertMm::GateUp,
        ExpertMm::Down,
        ExpertMm::DownDx,
        ExpertMm::GateUpDx,
        ExpertMm::DownDw,
        ExpertMm::GateUpDw,
    ];

    fn name(self) -> &'static str {
        match self {
            ExpertMm::GateUp => "moe.gate_up",
            ExpertMm::Down => "moe.down",
            ExpertMm::DownDx => "moe.down dx",
            ExpertMm::GateUpDx => "moe.gate_up dx",
            ExpertMm::DownDw => "moe.down dw",
            ExpertMm::GateUpDw => "moe.gate_up dw",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What the experts' products of one layer read and write: the experts' 16-bit weights,
/// their f32 gradients (0: frozen), and the pairs' buffers in expert order (moe_bufs.rs).
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertBufs {
    pub(super) gate_up: u64,
    pub(super) down: u64,
    pub(super) g_gate_up: u64,
    pub(super) g_down: u64,
    pub(super) x: u64,
    pub(super) gu: u64,
    pub(super) act: u64,
    pub(super) y: u64,
    pub(super) du: u64,
    pub(super) dgu: u64,
    /// The model width C and an expert's width I.
    pub(super) c: usize,
    pub(super) i: usize,
}

/// One expert's product, column-major as cuBLAS takes it: `C = op(A)·op(B) + beta·C`.
struct Product {
    t: (bool, bool),
    mnk: (usize, usize, usize),
    a: Mat,
    b: Mat,
    c: Mat,
    c_f32: bool,
    beta: f32,
}

impl ExpertBufs {
    /// Expert `j`'s product of `kind` over its `cnt` pairs from `off` on (the row-major
    /// layers' products as `Lin` writes them: y = x·Wᵀ, dx = dy·W, dW += dyᵀ·x).
    fn product(&self, kind: ExpertMm, j: usize, off: usize, cnt: usize) -> Product {
        let (c, i) = (self.c, self.i);
        let w_gu = self.gate_up + 2 * (j * 2 * i * c) as u64;
        let w_down = self.down + 2 * (j * c * i) as u64;
        let rows = |p: u64, width: usize| mat(p + 2 * (off * width) as u64, width);
        let (t, mnk, a, b, cm) = match kind {
            ExpertMm::GateUp => (
                (true, false),
                (2 * i, cnt, c),
                mat(w_gu, c),
                rows(self.x, c),
                rows(self.gu, 2 * i),
            ),
            ExpertMm::Down => (
                (true, false),
                (c, cnt, i),
                mat(w_down, i),
                rows(self.act, i),
                rows(self.y, c),
            ),
            ExpertMm::DownDx => (
                (false, false),
                (i, cnt, c),
                mat(w_down, i),
                rows(self.y, c),
                rows(self.du, i),
            ),
            ExpertMm::GateUpDx => (
                (false, false),
                (c, cnt, 2 * i),
                mat(w_gu, c),
                rows(self.dgu, 2 * i),
                rows(self.x, c),
            ),
            ExpertMm::DownDw => (
                (false, true),
                (i, c, cnt),
                rows(self.act, i),
                rows(self.y, c),
                mat(self.g_down + 4 * (j * c * i) as u64, i),
            ),
            ExpertMm::GateUpDw => (
                (false, true),
                (c, 2 * i, cnt),
                rows(self.x, c),
                rows(self.dgu, 2 * i),
                mat(self.g_gate_up + 4 * (j * 2 * i * c) as u64, c),
            ),
        };
        let dw = matches!(kind, ExpertMm::DownDw | ExpertMm::GateUpDw);
        Product {
            t,
            mnk,
            a,
            b,
            c: cm,
            c_f32: dw,
            beta: if dw { 1.0 } else { 0.0 },
        }
    }

    /// Whether `kind` has anything to write (a weight gradient only where the weight trains).
    fn runs(&self, kind: ExpertMm) -> bool {
        match kind {
            ExpertMm::DownDw => self.g_down != 0,
            ExpertMm::GateUpDw => self.g_gate_up != 0,
            _ => true,
        }
    }
}

/// `(expert, first pair, pairs)` of each expert with pairs.
fn runs_of(counts: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut off = 0;
    let mut out = Vec::new();
    for (j, &cnt) in counts.iter().enumerate() {
        let cnt = cnt as usize;
        if cnt > 0 {
            out.push((j, off, cnt));
        }
        off += cnt;
    }
    out
}

#[cfg(cublas_grouped)]
fn op(t: bool) -> bsys::cublasOperation_t {
    if t {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl ModelStep {
    /// Layer `l`'s experts' products of `kind` (their row counts: the layer's, from its
    /// forward).
    pub(super) fn experts_mm(&self, l: usize, kind: ExpertMm, bufs: &ExpertBufs) -> Result<()> {
        if !bufs.runs(kind) {
            return Ok(());
        }
        let runs = runs_of(&self.moe_counts(l)?);
        if self.moe_grouped.get() & (1 << kind.index()) != 0 {
            match self.experts_grouped(l, kind, bufs, &runs) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // (cuBLAS may not take this kind's types: the loop from now on.)
                    tracing::warn!(
                        "{}: grouped matmul declined ({e}); one call an expert",
                        kind.name()
                    );
                    self.moe_grouped
                        .set(self.moe_grouped.get() & !(1 << kind.index()));
                }
            }
        }
        for &(j, off, cnt) in &runs {
            let p = bufs.product(kind, j, off, cnt);
            self.gemm_ab(
                kind.name(),
                p.t,
                p.mnk,
                (p.a, p.b, p.c),
                p.c_f32,
                (1.0, p.beta),
                1,
            )?;
        }
        Ok(())
    }

    /// With grouped matmuls on: layer `l`'s operand address arrays of every kind into its
    /// slot of the arena's table (`ptrs`: [layer][kind][A | B | C][expert]), after its
    /// counts came back (the stream is idle: the copy from host memory is safe to stage).
    pub(super) fn upload_expert_ptrs(
        &self,
        l: usize,
        bufs: &ExpertBufs,
        ptrs: u64,
        e: usize,
    ) -> Result<()> {
        if self.moe_grouped.get() == 0 {
            return Ok(());
        }
        let runs = runs_of(&self.moe_counts(l)?);
        let mut table = vec![0u64; ExpertMm::ALL.len() * 3 * e];
        for kind in ExpertMm::ALL {
            let base = kind.index() * 3 * e;
            for (slot, &(j, off, cnt)) in runs.iter().enumerate() {
                let p = bufs.product(kind, j, off, cnt);
                table[base + slot] = p.a.p;
                table[base + e + slot] = p.b.p;
                table[base + 2 * e + slot] = p.c.p;
            }
        }
        let at = ptrs + 8 * (l * table.len()) as u64;
        // SAFETY: layer l's slot of the table holds 6·3·E u64; pageable host memory is staged
        // before this returns.
        unsafe { drv::memcpy_htod_async(at, &table, self.stream.cu_stream()) }.w()
    }

    /// Without cuBLAS's grouped matmul in this build (a toolkit before CUDA 12.5): declined,
    /// the loop runs.
    #[cfg(not(cublas_grouped))]
    fn experts_grouped(
        &self,
        _l: usize,
        _kind: ExpertMm,
        _bufs: &ExpertBufs,
        _runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        Err(err("built with a CUDA toolkit before 12.5, which lacks it"))
    }

    /// One grouped cuBLAS call for layer `l`'s products of `kind` (a group an expert).
    #[cfg(cublas_grouped)]
    fn experts_grouped(
        &self,
        l: usize,
        kind: ExpertMm,
        bufs: &ExpertBufs,
        runs: &[(usize, usize, usize)],
    ) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let (ptrs, e) = self.moe_ptrs()?;
        let g = runs.len();
        let ps: Vec<Product> = runs
            .iter()
            .map(|&(j, off, cnt)| bufs.product(kind, j, off, cnt))
            .collect();
        let i32s = |f: &dyn Fn(&Product) -> usize| -> Result<Vec<i32>> {
            ps.iter()
                .map(|p| i32_of(f(p), "a grouped matmul's size"))
                .collect()
        };
        let (ta, tb) = (
            ps.iter().map(|p| op(p.t.0)).collect::<Vec<_>>(),
            ps.iter().map(|p| op(p.t.1)).collect::<Vec<_>>(),
        );
        let (m, n, k) = (
            i32s(&|p| p.mnk.0)?,
            i32s(&|p| p.mnk.1)?,
            i32s(&|p| p.mnk.2)?,
        );
        let lda: Vec<i32> = ps.iter().map(|p| p.a.ld).collect();
        let ldb: Vec<i32> = ps.iter().map(|p| p.b.ld).collect();
        let ldc: Vec<i32> = ps.iter().map(|p| p.c.ld).collect();
        let alpha = vec![1f32; g];
        let beta: Vec<f32> = ps.iter().map(|p| p.beta).collect();
        let size = vec![1i32; g];
        let bf = if self.half {
            bsys::cudaDataType::CUDA_R_16F
        } else {
            bsys::cudaDataType::CUDA_R_16BF
        };
        let ct = if ps[0].c_f32 {
            bsys::cudaDataType::CUDA_R_32F
        } else {
            bf
        };
        let base = ptrs + 8 * ((l * ExpertMm::ALL.len() + kind.index()) * 3 * e) as u64;
        let (pa, pb, pc) = (base, base + 8 * e as u64, base + 16 * e as u64);
        let h = *self.blas.handle();
        self.timed(kind.name(), || {
            // SAFETY: the host arrays hold one entry a group and live through the call; the
            // device arrays were written for this layer's counts (`upload_expert_ptrs`) and
            // address this step's buffers, sized for these shapes.
            let r = unsafe {
                bsys::cublasGemmGroupedBatchedEx(
                    h,
                    ta.as_ptr(),
                    tb.as_ptr(),
                    m.as_ptr(),
                    n.as_ptr(),
                    k.as_ptr(),
                    alpha.as_ptr() as *const _,
                    pa as *const *const _,
                    bf,
                    lda.as_ptr(),
                    pb as *const *const _,
                    bf,
                    ldb.as_ptr(),
                    beta.as_ptr() as *const _,
                    pc as *const *mut _,
                    ct,
                    ldc.as_ptr(),
                    i32_of(g, "experts")?,
                    size.as_ptr(),
                    bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            };
            match r {
                bsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
                s => Err(err(format!("cuBLAS grouped gemm: {s:?}"))),
            }
        })
    }
}
