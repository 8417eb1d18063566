// Fused kernels for cockpit's CUDA engine (built to PTX by build.rs with the `cuda` feature).
// Every kernel reads and writes the compute dtype (f32, bf16, f16) and accumulates in f32.
// Layouts are contiguous row-major; the Rust side (src/engine/kernels/mod.rs) checks that.
// One translation unit: this file holds the shared helpers and includes each kernel family in
// order — the per-op kernels from cuda/*.cuh (launched by cuda/*.rs of the same name), the
// whole-model step's from step/*.cuh (launched by step/*.rs), flash attention last.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

#ifdef COCKPIT_F16
// The fp16 build (cockpit_kernels_f16.ptx; build.rs defines COCKPIT_F16): this same source with
// the 16-bit type of the whole-model step and the flash kernels switched from bf16 to fp16, for
// `precision.dtype = "f16"` (fp16 activations and tensor-core operands, fp32 accumulation, the
// gradients scaled by the dynamic loss scale). The kernels keep their `_bf16` names: the module
// they are loaded from says which type they compute in (src/engine/kernels/cuda/mod.rs).
#define __nv_bfloat16 __half
#define __nv_bfloat162 __half2
#define __float2bfloat16 __float2half_rn
#define __bfloat162float __half2float
#define __floats2bfloat162_rn __floats2half2_rn
#define __bfloat1622float2 __half22float2
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
#ifndef COCKPIT_F16
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
#endif

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}
#ifndef COCKPIT_F16
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
#endif

typedef __nv_bfloat16 bf16_t;

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

#include "cuda/dropout.cuh"
#include "cuda/sampling.cuh"
#include "cuda/softmax.cuh"
#include "cuda/norm.cuh"
#include "cuda/cross_entropy.cuh"
#include "cuda/bias.cuh"
#include "cuda/region.cuh"

// The per-op kernels' entry points (their templates are in the cuda/*.cuh above), per dtype.
#define INSTANTIATE(T, S)                                                                       \
    extern "C" __global__ void causal_softmax_fwd_##S(const T* x, T* y, int rows, int tq,      \
                                                      int tk, float scale) {                  \
        causal_softmax_fwd<T>(x, y, rows, tq, tk, scale);                                     \
    }                                                                                           \
    extern "C" __global__ void causal_softmax_bwd_##S(const T* y, const T* dy, T* dx, int rows, \
                                                      int tq, int tk, float scale) {          \
        causal_softmax_bwd<T>(y, dy, dx, rows, tq, tk, scale);                                \
    }                                                                                           \
    extern "C" __global__ void norm_fwd_##S(const T* x, const T* w, const T* b, T* y, int n,   \
                                            int d, float eps, int rms) {                      \
        norm_fwd<T>(x, w, b, y, n, d, eps, rms);                                              \
    }                                                                                           \
    extern "C" __global__ void norm_bwd_##S(const T* x, const T* w, const T* dy, T* dx,        \
                                            float* dw, float* db, int n, int d, float eps,    \
                                            int rms) {                                        \
        norm_bwd<T>(x, w, dy, dx, dw, db, n, d, eps, rms);                                    \
    }                                                                                           \
    extern "C" __global__ void ce_fwd_##S(const T* x, const uint32_t* t, float* loss, int n,   \
                                          int v) {                                            \
        ce_fwd<T>(x, t, loss, n, v);                                                          \
    }                                                                                           \
    extern "C" __global__ void ce_bwd_##S(const T* x, const uint32_t* t, const float* loss,    \
                                          const float* g, T* dx, int n, int v) {              \
        ce_bwd<T>(x, t, loss, g, dx, n, v);                                                   \
    }                                                                                           \
    extern "C" __global__ void bias_add_##S(const T* x, const T* b, T* y, size_t total,        \
                                            int c) {                                          \
        bias_add<T>(x, b, y, total, c);                                                       \
    }                                                                                           \
    extern "C" __global__ void bias_gelu_fwd_##S(const T* x, const T* b, T* y, size_t total,   \
                                                 int c) {                                     \
        bias_gelu_fwd<T>(x, b, y, total, c);                                                  \
    }                                                                                           \
    extern "C" __global__ void bias_gelu_bwd_##S(const T* x, const T* b, const T* dy, T* dx,   \
                                                 size_t total, int c) {                       \
        bias_gelu_bwd<T>(x, b, dy, dx, total, c);                                             \
    }                                                                                           \
    extern "C" __global__ void col_sum_##S(const T* x, float* out, int n, int c) {             \
        col_sum<T>(x, out, n, c);                                                             \
    }                                                                                           \
    extern "C" __global__ void qkv_split_##S(const T* src, T* q, T* k, T* v, int b, int t,     \
                                             int h, int hd) {                                 \
        qkv_split<T>(src, q, k, v, b, t, h, hd);                                              \
    }                                                                                           \
    extern "C" __global__ void heads_merge_##S(const T* src, T* dst, int b, int t, int h,      \
                                               int hd, int ld, int off) {                     \
        heads_merge<T>(src, dst, b, t, h, hd, ld, off);                                       \
    }                                                                                           \
    extern "C" __global__ void embedding_bwd_##S(const uint32_t* ids, const T* dy, float* dw,  \
                                                 int n, int d, int vocab) {                   \
        embedding_bwd<T>(ids, dy, dw, n, d, vocab);                                           \
    }

INSTANTIATE(float, f32)
INSTANTIATE(__nv_bfloat16, bf16)
INSTANTIATE(__half, f16)

#include "cuda/optimizer.cuh"

// ---------------------------------------------------------------------------------------------
// The whole-model training step (launched from src/engine/kernels/step/): every model it runs
// (LayerNorm or RMSNorm, GELU or SwiGLU, learned positions or RoPE, LoRA, dropout), bf16 (fp16
// build: fp16) activations, fp32 master weights and gradients. Kernels here only add what the
// per-op kernels above lack; each family is in its own file under step/, included in this order.

// Eight bf16 values moved as one 16-byte access.
union Bf8 {
    uint4 u;
    __nv_bfloat162 h[4];
};


#include "step/multi_tensor.cuh"
#include "step/embed.cuh"
#include "step/norms.cuh"
#include "step/cross_entropy.cuh"
#include "step/gelu.cuh"
#include "step/rope.cuh"
#include "step/qk_norm.cuh"
#include "step/dropout.cuh"
#include "step/swiglu.cuh"
#include "step/moe.cuh"
#include "step/mamba.cuh"
#include "step/mamba_conv.cuh"
#include "step/mamba_dt.cuh"
#include "step/mamba_scan.cuh"
#include "step/mamba_state.cuh"
#include "step/mamba_gnorm.cuh"

// src[b, t, off + h·hd + d] of a [B, T, ld] buffer → dst [B, H, T, hd] (heads_merge's inverse).
extern "C" __global__ void heads_split_bf16(const bf16_t* __restrict__ src,
                                            bf16_t* __restrict__ dst, int b, int t, int h,
                                            int hd, int ld, int off) {
    const size_t total = (size_t)b * h * t * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[heads_offset(i, t, h, hd, ld, off)];
}

#include "step/attn_heads.cuh"

#include "cuda/nf4.cuh"
#include "cuda/ggml.cuh"
#include "cuda/decode_attention.cuh"
#include "cuda/mamba_decode.cuh"

// Causal flash attention (head dims 64, 128 and 256) for the whole-model step.
#include "flash.cu"
// Its backward's main kernel with Hopper's warpgroup products (compute_90a builds only).
#include "flash_sm90.cu"
