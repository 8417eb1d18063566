// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// The fused regions' layout kernels: q|k|v split, heads merged, the embedding's backward.

// Packed projections qkv [B, T, 3·H·hd] → q, k, v each [B, H, T, hd] (one pass, coalesced reads).
template <typename T>
__device__ void qkv_split(const T* __restrict__ src, T* __restrict__ q, T* __restrict__ k,
                          T* __restrict__ v, int b, int t, int h, int hd) {
    const int c = h * hd;
    const size_t total = (size_t)b * t * 3 * c;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int j = (int)(i % (3 * c));
        const size_t bt = i / (3 * c);
        const int ti = (int)(bt % t), bi = (int)(bt / t);
        const int which = j / c, hh = (j % c) / hd, d = j % hd;
        T* dst = which == 0 ? q : (which == 1 ? k : v);
        dst[(((size_t)bi * h + hh) * t + ti) * hd + d] = src[i];
    }
}

// Element i of heads [B, H, T, hd] → its offset in a [B, T, ld] buffer at column off + h·hd + d.
__device__ __forceinline__ size_t heads_offset(size_t i, int t, int h, int hd, int ld, int off) {
    const int d = (int)(i % hd);
    size_t r = i / hd;
    const int ti = (int)(r % t);
    r /= t;
    const int hh = (int)(r % h);
    const size_t bi = r / h;
    return (bi * t + ti) * ld + off + hh * hd + d;
}

// src [B, H, T, hd] → dst[b, t, off + h·hd + d] of a [B, T, ld] buffer.
template <typename T>
__device__ void heads_merge(const T* __restrict__ src, T* __restrict__ dst, int b, int t, int h,
                            int hd, int ld, int off) {
    const size_t total = (size_t)b * h * t * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        dst[heads_offset(i, t, h, hd, ld, off)] = src[i];
}

// Embedding backward: dw[ids[r], :] += dy[r, :] in f32 (dw zeroed by the caller).
template <typename T>
__device__ void embedding_bwd(const uint32_t* __restrict__ ids, const T* __restrict__ dy,
                              float* __restrict__ dw, int n, int d, int vocab) {
    const size_t total = (size_t)n * d;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / d), j = (int)(i % d);
        const uint32_t id = ids[r];
        if (id < (uint32_t)vocab) atomicAdd(&dw[(size_t)id * d + j], to_f(dy[i]));
    }
}
