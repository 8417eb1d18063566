// Multi-tensor copies over a table of items (one launch for many tensors): the fp32 masters
// cast to the step's 16-bit copies, ZeRO-1's gathered copies, the bf16 wire format of the
// data-parallel gradient sums, the SCU gradient's axpy, and LoRA's block-diagonal B.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// dst ← src (converted to T) over a table of (f32 source, destination, length) items, one grid
// row per item: one launch for many tensors.
template <typename T> struct MultiItem {
    const float* src;
    T* dst;
    unsigned long long n;
};
template <typename T> __device__ void convert_multi(const MultiItem<T>* __restrict__ ts) {
    const MultiItem<T> t = ts[blockIdx.y];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < t.n;
         i += (size_t)gridDim.x * blockDim.x)
        t.dst[i] = from_f<T>(t.src[i]);
}
// fp32 master weights → the bf16 (fp16 build: fp16) copy the step computes with.
extern "C" __global__ void cast_multi_f32_bf16(const MultiItem<bf16_t>* __restrict__ ts) {
    convert_multi(ts);
}
// ZeRO-1: updated weights into the gathered buffer, and the gathered weights back into every
// parameter.
extern "C" __global__ void copy_multi_f32(const MultiItem<float>* __restrict__ ts) {
    convert_multi(ts);
}

// Data-parallel gradient sums in bf16 (`distributed.reduce_dtype = "bf16"`): f32 gradients
// into the bf16 buffer the ranks sum (rounded to nearest even), and the sums back into the f32
// gradients (exact). Four elements a thread where both pointers allow 16/8-byte accesses.
// Launched from the bf16 builds of the module only (the fp16 build maps bf16 to fp16).

// Whether four values from p are one aligned vector access.
__device__ __forceinline__ bool aligned4(const float* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}
__device__ __forceinline__ bool aligned4(const __nv_bfloat16* p) {
    return (reinterpret_cast<uintptr_t>(p) & 7) == 0;
}
__device__ __forceinline__ void wire4(const float* __restrict__ g, __nv_bfloat16* __restrict__ w,
                                      size_t j) {
    const float4 v = reinterpret_cast<const float4*>(g)[j];
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 o;
    o.x = *reinterpret_cast<uint32_t*>(&lo);
    o.y = *reinterpret_cast<uint32_t*>(&hi);
    reinterpret_cast<uint2*>(w)[j] = o;
}
__device__ __forceinline__ void wire4(const __nv_bfloat16* __restrict__ w, float* __restrict__ g,
                                      size_t j) {
    const uint2 u = reinterpret_cast<const uint2*>(w)[j];
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    reinterpret_cast<float4*>(g)[j] = make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void wire1(const float* g, __nv_bfloat16* w, size_t j) {
    w[j] = __float2bfloat16(g[j]);
}
__device__ __forceinline__ void wire1(const __nv_bfloat16* w, float* g, size_t j) {
    g[j] = __bfloat162float(w[j]);
}
// dst ← src over n values, four at a time where both pointers allow it.
template <typename S, typename D>
__device__ __forceinline__ void wire_convert(const S* __restrict__ src, D* __restrict__ dst,
                                             size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const bool vec = aligned4(src) && aligned4(dst);
    const size_t done = vec ? n / 4 * 4 : 0;
    if (vec)
        for (size_t j = i; j < n / 4; j += stride) wire4(src, dst, j);
    for (size_t j = done + i; j < n; j += stride) wire1(src, dst, j);
}
extern "C" __global__ void wire_pack_f32_bf16(const float* __restrict__ g,
                                              __nv_bfloat16* __restrict__ w, size_t n) {
    wire_convert(g, w, n);
}
extern "C" __global__ void wire_unpack_bf16_f32(const __nv_bfloat16* __restrict__ w,
                                                float* __restrict__ g, size_t n) {
    wire_convert(w, g, n);
}

// y += a·x over a table of f32 tensors (the SCU regulariser's gradient 2·λ·coef·w).
struct AxpyItem {
    const float* x;
    float* y;
    unsigned long long n;
};
extern "C" __global__ void axpy_multi_f32(const AxpyItem* __restrict__ ts, float a) {
    const AxpyItem t = ts[blockIdx.y];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < t.n;
         i += (size_t)gridDim.x * blockDim.x)
        t.y[i] += a * t.x[i];
}

// LoRA: each adapter's B [rows, cols] (16-bit, dense) into its block of its group's
// block-diagonal matrix of row stride ld (the entries outside the blocks stay zero), so the
// group's y = u·Bᵀ and du = dy·B are one matmul each.
struct BlockItem {
    const uint16_t* src;
    uint16_t* dst;
    unsigned long long rows, cols, ld;
};
extern "C" __global__ void lora_blocks_16(const BlockItem* __restrict__ ts) {
    const BlockItem t = ts[blockIdx.y];
    const size_t n = t.rows * t.cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        t.dst[i / t.cols * t.ld + i % t.cols] = t.src[i];
}
