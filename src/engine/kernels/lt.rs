//! cuBLASLt matmuls for the whole-model step, plain or with fused epilogues: the bias add
//! (and GELU) in the forward projections and the GELU backward in the MLP's data gradient,
//! so those elementwise passes over the activations disappear. (Bias gradients are not
//! epilogues: `BGRADB` rules out split-K, and on the weight gradients' small outputs and
//! long K it was slower than the plain matmul plus a column sum; `DGELU_BGRAD`, with a bf16
//! bias gradient (cuBLASLt has no fp32 one there), ran the MLP's data gradient in 231 µs
//! against 75 µs for `DGELU` on an H200.)
//!
//! A plan (descriptors, layouts and an algorithm) is made once per shape and epilogue and
//! cached; only the pointers are set per call. With tuning on, making a plan times the
//! heuristic's first [`CANDIDATES`] algorithms on the call's own operands and keeps the
//! fastest: the heuristic's first pick is not always it (on an H200, 11–13 % slower on
//! the LM head and the q|k|v projection). Where cuBLASLt offers no algorithm for a
//! combination, [`Lt::matmul`] says so and the caller runs the separate kernels instead.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::cuda::err;

/// What the matmul does after `D = op(A)·op(B) (+ β·C)` (column-major `D` of m × n).
#[derive(Clone, Copy)]
pub(super) enum Epi {
    /// Nothing: the plain matmul.
    None,
    /// `D += bias` per row (bf16 bias of length m).
    Bias { bias: u64 },
    /// `aux = D + bias`, `D = gelu_tanh(aux)` (aux: bf16, m × n with leading dim `ld`).
    GeluAuxBias { bias: u64, aux: u64, ld: usize },
    /// `D = gelu_tanh'(aux) ⊙ D`.
    DGelu { aux: u64, ld: usize },
}

impl Epi {
    /// The epilogue's name (in the tuning log, and as part of a plan's key).
    fn name(&self) -> &'static str {
        match self {
            Epi::None => "none",
            Epi::Bias { .. } => "bias",
            Epi::GeluAuxBias { .. } => "gelu+bias",
            Epi::DGelu { .. } => "dgelu",
        }
    }
}

/// One operand: device address and leading dimension (elements).
#[derive(Clone, Copy)]
pub(super) struct Operand {
    pub p: u64,
    pub ld: usize,
}

/// One matmul `D = op(A)·op(B)` in cuBLAS's column-major terms: transposes, (m, n, k), and
/// the operands (C is also D).
#[derive(Clone, Copy)]
pub(super) struct Mm {
    pub t: (bool, bool),
    pub mnk: (usize, usize, usize),
    pub a: Operand,
    pub b: Operand,
    pub c: Operand,
}

/// Everything that selects a plan.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    c_f32: bool,
    epi: &'static str,
    aux_ld: usize,
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by this plan and destroyed once, here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    _ws: CudaSlice<u8>,
    ws_p: u64,
    ws_size: usize,
    /// The workspace of matmuls queued on a second stream (they may run alongside the main
    /// stream's, which must not share a workspace with them).
    side_ws: Option<(CudaSlice<u8>, u64)>,
    /// None: cuBLASLt has no algorithm for this key (the caller falls back).
    plans: RefCell<HashMap<Key, Option<Plan>>>,
    /// Time the heuristic's candidates when making a plan (else take its first).
    tune: bool,
    /// fp16 operands instead of bf16.
    half: bool,
}

/// How many of the heuristic's algorithms a plan times.
pub(super) const CANDIDATES: usize = 16;
/// Timed runs per candidate (after one untimed run).
const TUNE_REPS: usize = 3;

// SAFETY: the handle and descriptors are host-side cuBLASLt objects, usable from any thread
// as long as no two threads use them at once; `Lt` is not Sync (its plan cache is a RefCell),
// so it moves to the engine thread whole and is used there alone.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: the handle is ours and every plan using it is gone.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    err(format!("cuBLASLt {what}: {e:?}"))
}

/// Set one descriptor attribute from a plain value.
///
/// # Safety
/// `desc` is live and `T` is the attribute's documented type.
unsafe fn set<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err("attribute", e))
}

impl Lt {
    /// `half`: fp16 operands (and 16-bit results) instead of bf16.
    pub(super) fn new(stream: Arc<CudaStream>, tune: bool, half: bool) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
        let ws_size = 32 << 20;
        // SAFETY: scratch for cuBLASLt; never read by us.
        let ws = unsafe { stream.alloc::<u8>(ws_size) }.w()?;
        let ws_p = {
            let (p, _sync) = ws.device_ptr(&stream);
            p
        };
        Ok(Self {
            handle,
            stream,
            _ws: ws,
            ws_p,
            ws_size,
            side_ws: None,
            plans: RefCell::new(HashMap::new()),
            tune,
            half,
        })
    }

    /// Give matmuls on a second stream ([`Lt::matmul`]) their own workspace.
    pub(super) fn enable_side(&mut self) -> Result<()> {
        if self.side_ws.is_none() {
            // SAFETY: scratch for cuBLASLt; never read by us.
            let ws = unsafe { self.stream.alloc::<u8>(self.ws_size) }.w()?;
            let p = {
                let (p, _sync) = ws.device_ptr(&self.stream);
                p
            };
            self.side_ws = Some((ws, p));
        }
        Ok(())
    }

    /// Make the plan for `key` (None when cuBLASLt has no algorithm for it), tuned on the
    /// call `(mm, beta, epi)` when tuning is on.
    fn plan(&self, key: &Key, mm: &Mm, beta: f32, epi: &Epi) -> Result<Option<Plan>> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let bf = if self.half {
            sys::cudaDataType::CUDA_R_16F
        } else {
            sys::cudaDataType::CUDA_R_16BF
        };
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(|e| lt_err("descriptor", e))?;
        let layout = |rows: usize, cols: usize, ld: usize, t| {
            lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
                .map_err(|e| lt_err("layout", e))
        };
        // Stored shapes (before the transposes).
        let (ar, ac) = if key.ta {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (br, bc) = if key.tb {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let layouts = [
            layout(ar, ac, key.lda, bf)?,
            layout(br, bc, key.ldb, bf)?,
            layout(key.m, key.n, key.ldc, if key.c_f32 { f32t } else { bf })?,
        ];
        let mut plan = Plan {
            desc,
            layouts,
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (a 32-bit enum).
        let op = |t: bool| -> i32 { t as i32 };
        let epilogue = match epi {
            Epi::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epi::Bias { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epi::GeluAuxBias { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epi::DGelu { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
        };
        // SAFETY: the descriptor is live; every value has its attribute's type.
        unsafe {
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.ta))?;
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.tb))?;
            set(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if key.aux_ld > 0 {
                set(
                    desc,
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    &(key.aux_ld as i64),
                )?;
            }
        }
        self.set_pointers(&plan, epi)?;
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let want = if self.tune { CANDIDATES } else { 1 };
        let mut found = vec![
            sys::cublasLtMatmulHeuristicResult_t {
                algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
                workspaceSize: 0,
                state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
                wavesCount: 0.0,
                reserved: [0; 4],
            };
            want
        ];
        let mut count = 0i32;
        // SAFETY: every object is live; the workspace size is what we allocated; `found`
        // holds `want` results.
        let status = unsafe {
            let r = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &self.ws_size as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(|e| lt_err("preference", e))
            .map(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                    want as i32,
                    found.as_mut_ptr(),
                    &mut count,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            r?
        };
        found.truncate(count.max(0) as usize);
        found.retain(|h| {
            h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= self.ws_size
        });
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || found.is_empty() {
            return Ok(None);
        }
        plan.algo = found[0].algo;
        if found.len() > 1 {
            plan.algo = self.fastest(&plan, &found, mm, key.c_f32, beta, epi.name())?;
        }
        Ok(Some(plan))
    }

    /// The fastest of `found` on this call's operands (the plan's epilogue pointers set).
    /// Outputs the real call overwrites anyway (D when `beta` is 0, the GELU input) are
    /// written in place; an accumulated D (`beta` ≠ 0) goes to a zeroed scratch copy.
    fn fastest(
        &self,
        plan: &Plan,
        found: &[sys::cublasLtMatmulHeuristicResult_t],
        mm: &Mm,
        c_f32: bool,
        beta: f32,
        epi_name: &str,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let (_, n, _) = mm.mnk;
        let scratch = if beta != 0.0 {
            let bytes = mm.c.ld * n * if c_f32 { 4 } else { 2 };
            Some(self.stream.alloc_zeros::<u8>(bytes).w()?)
        } else {
            None
        };
        let d = match &scratch {
            Some(s) => {
                let (p, _sync) = s.device_ptr(&self.stream);
                p
            }
            None => mm.c.p,
        };
        // Time on an idle GPU: nothing queued earlier, on any stream, runs alongside.
        self.stream.context().synchronize().w()?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = (f32::INFINITY, found[0].algo);
        let mut first = None;
        for h in found {
            // One untimed run; an algorithm that fails to launch is skipped.
            if self.run(plan, &h.algo, mm, d, beta).is_err() {
                continue;
            }
            let start = self.stream.record_event(timing).w()?;
            for _ in 0..TUNE_REPS {
                self.run(plan, &h.algo, mm, d, beta)?;
            }
            let end = self.stream.record_event(timing).w()?;
            end.synchronize().w()?;
            let ms = start.elapsed_ms(&end).w()? / TUNE_REPS as f32;
            first.get_or_insert(ms);
            if ms < best.0 {
                best = (ms, h.algo);
            }
        }
        tracing::info!(
            "matmul {:?} m,n,k {:?} epilogue {}: heuristic's first {:.1} µs, fastest of {} {:.1} µs",
            mm.t,
            mm.mnk,
            epi_name,
            first.unwrap_or(f32::NAN) * 1e3,
            found.len(),
            best.0 * 1e3
        );
        Ok(best.1)
    }

    fn set_pointers(&self, plan: &Plan, epi: &Epi) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let (bias, aux) = match *epi {
            Epi::None => (None, None),
            Epi::Bias { bias } => (Some(bias), None),
            Epi::GeluAuxBias { bias, aux, .. } => (Some(bias), Some(aux)),
            Epi::DGelu { aux, .. } => (None, Some(aux)),
        };
        let attrs = [
            (A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias),
            (A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux),
        ];
        for (attr, p) in attrs {
            if let Some(p) = p {
                // SAFETY: the descriptor is live; pointer attributes take a device address.
                unsafe { set(plan.desc, attr, &(p as *const c_void))? };
            }
        }
        Ok(())
    }

    /// `D = α·op(A)·op(B) + β·C` with the epilogue, D in place of C, queued on `side` (with the
    /// side workspace, [`Lt::enable_side`]) or, when None or without a side workspace, on the
    /// step's stream. A plan is made and tuned on the step's stream, after a device-wide
    /// synchronise. Ok(false): cuBLASLt has no algorithm for this (nothing ran; the caller
    /// does it another way).
    pub(super) fn matmul(
        &self,
        mm: Mm,
        c_f32: bool,
        (alpha, beta): (f32, f32),
        epi: Epi,
        side: Option<&CudaStream>,
    ) -> Result<bool> {
        let Mm {
            t: (ta, tb),
            mnk: (m, n, k),
            a,
            b,
            c,
        } = mm;
        let aux_ld = match epi {
            Epi::GeluAuxBias { ld, .. } | Epi::DGelu { ld, .. } => ld,
            _ => 0,
        };
        let key = Key {
            ta,
            tb,
            m,
            n,
            k,
            lda: a.ld,
            ldb: b.ld,
            ldc: c.ld,
            c_f32,
            epi: epi.name(),
            aux_ld,
        };
        let mut plans = self.plans.borrow_mut();
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.plan(&key, &mm, beta, &epi)?)
            }
        };
        let Some(plan) = plan else {
            return Ok(false);
        };
        self.set_pointers(plan, &epi)?;
        let on = match (side, &self.side_ws) {
            (Some(s), Some((_, ws))) => (s, *ws),
            _ => (&*self.stream, self.ws_p),
        };
        self.run_on(plan, &plan.algo, &mm, mm.c.p, (alpha, beta), on)?;
        Ok(true)
    }

    /// Launch `plan` with `algo` on the step's stream, writing D at `d` (C is read from `d`
    /// too).
    fn run(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        mm: &Mm,
        d: u64,
        beta: f32,
    ) -> Result<()> {
        self.run_on(plan, algo, mm, d, (1.0, beta), (&self.stream, self.ws_p))
    }

    /// [`Lt::run`] with `alpha` on `stream` with the workspace at `ws` (of `ws_size` bytes).
    fn run_on(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        mm: &Mm,
        d: u64,
        (alpha, beta): (f32, f32),
        (stream, ws): (&CudaStream, u64),
    ) -> Result<()> {
        // SAFETY: the operands are device addresses inside the step's buffers (or a scratch
        // copy of D of the same layout), sized by the caller for these shapes; the plan's
        // layouts describe exactly them; the workspace is ours, and used by no other stream.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                mm.a.p as *const c_void,
                plan.layouts[0],
                mm.b.p as *const c_void,
                plan.layouts[1],
                d as *const c_void,
                plan.layouts[2],
                d as *mut c_void,
                plan.layouts[2],
                algo,
                ws as *mut c_void,
                self.ws_size,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("matmul", e))
    }
}
