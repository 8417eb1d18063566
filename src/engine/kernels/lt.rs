//! cuBLASLt matmuls with fused epilogues for the whole-model step: the bias add (and GELU)
//! in the forward projections, and the bias gradients (and the GELU backward) in the
//! backward ones, so those elementwise passes over the activations disappear.
//!
//! A plan (descriptors, layouts and the heuristic's algorithm) is made once per shape and
//! epilogue and cached; only the pointers are set per call. Where cuBLASLt offers no
//! algorithm for a combination, [`Lt::matmul`] says so and the caller runs the separate
//! kernels instead.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

use super::cuda::err;

/// What the matmul does after `D = op(A)·op(B) (+ β·C)` (column-major `D` of m × n).
#[derive(Clone, Copy)]
pub(super) enum Epi {
    /// `D += bias` per row (bf16 bias of length m).
    Bias { bias: u64 },
    /// `aux = D + bias`, `D = gelu_tanh(aux)` (aux: bf16, m × n with leading dim `ld`).
    GeluAuxBias { bias: u64, aux: u64, ld: usize },
    /// `D = gelu_tanh'(aux) ⊙ D`.
    DGelu { aux: u64, ld: usize },
    /// `bgrad = Σ_k op(B)` (fp32, length n): the bias gradient of the weight-gradient matmul.
    BGradB { bgrad: u64 },
}

impl Epi {
    fn kind(&self) -> u8 {
        match self {
            Epi::Bias { .. } => 0,
            Epi::GeluAuxBias { .. } => 1,
            Epi::BGradB { .. } => 3,
            Epi::DGelu { .. } => 2,
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
    epi: u8,
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
    /// None: cuBLASLt has no algorithm for this key (the caller falls back).
    plans: RefCell<HashMap<Key, Option<Plan>>>,
}

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
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Self> {
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
            plans: RefCell::new(HashMap::new()),
        })
    }

    /// Make the plan for `key` (None when cuBLASLt has no algorithm for it).
    fn plan(&self, key: &Key, epi: &Epi) -> Result<Option<Plan>> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let bf = sys::cudaDataType::CUDA_R_16BF;
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
            Epi::Bias { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epi::GeluAuxBias { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epi::BGradB { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
            Epi::DGelu { .. } => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
        };
        // SAFETY: the descriptor is live; every value has its attribute's type.
        unsafe {
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(key.ta))?;
            set(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(key.tb))?;
            set(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if matches!(epi, Epi::BGradB { .. }) {
                // Bias gradients straight into the fp32 gradient buffer.
                set(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &f32t)?;
            }
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
        // SAFETY: every object is live; the workspace size is what we allocated.
        let found = unsafe {
            let r = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &self.ws_size as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(|e| lt_err("preference", e))
            .map(|_| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[2],
                    pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            r?
        };
        match found {
            Ok(h) => {
                plan.algo = h.algo;
                Ok(Some(plan))
            }
            Err(_) => Ok(None),
        }
    }

    fn set_pointers(&self, plan: &Plan, epi: &Epi) -> Result<()> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let (bias, aux) = match *epi {
            Epi::Bias { bias } => (Some(bias), None),
            Epi::GeluAuxBias { bias, aux, .. } => (Some(bias), Some(aux)),
            Epi::BGradB { bgrad } => (Some(bgrad), None),
            Epi::DGelu { aux, .. } => (None, Some(aux)),
        };
        // SAFETY: the descriptor is live; pointer attributes take a device address.
        unsafe {
            if let Some(bias) = bias {
                set(
                    plan.desc,
                    A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &(bias as *const c_void),
                )?;
            }
            if let Some(aux) = aux {
                set(
                    plan.desc,
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    &(aux as *const c_void),
                )?;
            }
        }
        Ok(())
    }

    /// `D = op(A)·op(B) + β·C` with the epilogue, D in place of C. Ok(false): cuBLASLt has
    /// no algorithm for this (nothing ran; the caller does it another way).
    pub(super) fn matmul(&self, mm: Mm, c_f32: bool, beta: f32, epi: Epi) -> Result<bool> {
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
            epi: epi.kind(),
            aux_ld,
        };
        let mut plans = self.plans.borrow_mut();
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(&key, &epi)?),
        };
        let Some(plan) = plan else {
            return Ok(false);
        };
        self.set_pointers(plan, &epi)?;
        let alpha = 1.0f32;
        // SAFETY: the operands are device addresses inside the step's buffers, sized by the
        // caller for these shapes; the plan's layouts describe exactly them; the workspace
        // is ours and the stream is the step's.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a.p as *const c_void,
                plan.layouts[0],
                b.p as *const c_void,
                plan.layouts[1],
                c.p as *const c_void,
                plan.layouts[2],
                c.p as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                self.ws_p as *mut c_void,
                self.ws_size,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("matmul", e))?;
        Ok(true)
    }
}
