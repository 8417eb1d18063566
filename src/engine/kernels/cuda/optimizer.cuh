// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Optimizer (fp32 master weights and moments).

// out[0] += Σ (scale·g)²; grid-stride, one atomic per block.
extern "C" __global__ void sumsq_f32(const float* __restrict__ g, size_t n, float* out) {
    __shared__ float part[32];
    float s = 0.f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = g[i];
        s += v * v;
    }
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) atomicAdd(out, s);
    }
}

// AdamW in place: m ← β1·m + (1−β1)·g', v ← β2·v + (1−β2)·g'², g' = gscale·g,
// w ← w·decay − lr·(m/bc1)/(√(v/bc2) + eps), with decay = 1 − lr·wd (1 for no-decay params).
extern "C" __global__ void adamw_f32(float* __restrict__ w, const float* __restrict__ g,
                                     float* __restrict__ m, float* __restrict__ v, size_t n,
                                     float lr, float beta1, float beta2, float eps, float decay,
                                     float bc1, float bc2, float gscale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i] * gscale;
        float mi = beta1 * m[i] + (1.f - beta1) * gi;
        float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float upd = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        w[i] = w[i] * decay - lr * upd;
    }
}

// Multi-tensor kernels: one launch over a device table of tensors cut into chunks of
// MT_CHUNK elements; a fixed grid strides over the chunks (no empty blocks, whatever the
// tensor sizes), each block finds its tensor by a binary search over the chunk offsets.
#define MT_CHUNK 8192

template <typename T>
__device__ __forceinline__ int mt_find(const T* __restrict__ ts, int nt, unsigned long long c) {
    int lo = 0, hi = nt - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (ts[mid].chunk0 <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// AdamW in place on fp32 weights and moments. flags: 1 = weight decay, 2 = 16-byte aligned
// (float4 accesses), 4 = also write the updated weight as bf16 to `wbf` (the whole-model
// step's compute copy, so the step needs no separate cast pass).
struct AdamTensor {
    float* w;
    const float* g;
    float* m;
    float* v;
    bf16_t* wbf;
    unsigned long long n;
    unsigned long long chunk0;
    unsigned long long flags;
};

struct AdamScalars {
    float lr, beta1, beta2, eps, bc1, bc2, gscale, decay;
};

__device__ __forceinline__ float adam_one(float w, float g, float& m, float& v,
                                          const AdamScalars& a, float decay) {
    g *= a.gscale;
    m = a.beta1 * m + (1.f - a.beta1) * g;
    v = a.beta2 * v + (1.f - a.beta2) * g * g;
    return w * decay - a.lr * (m / a.bc1) / (sqrtf(v / a.bc2) + a.eps);
}

extern "C" __global__ void adamw_chunks_f32(const AdamTensor* __restrict__ ts, int nt,
                                            unsigned long long nchunks, float lr, float beta1,
                                            float beta2, float eps, float bc1, float bc2,
                                            float gscale, float decay_factor) {
    const AdamScalars a{lr, beta1, beta2, eps, bc1, bc2, gscale, decay_factor};
    for (unsigned long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const AdamTensor t = ts[mt_find(ts, nt, c)];
        const size_t start = (size_t)(c - t.chunk0) * MT_CHUNK;
        const size_t end = min(start + MT_CHUNK, (size_t)t.n);
        const float decay = (t.flags & 1) ? a.decay : 1.f;
        const bool cast = (t.flags & 4) != 0;
        size_t i = start + 4 * threadIdx.x;
        if (t.flags & 2) {
            for (; i + 4 <= end; i += 4 * blockDim.x) {
                const float4 g = *reinterpret_cast<const float4*>(t.g + i);
                float4 w = *reinterpret_cast<const float4*>(t.w + i);
                float4 m = *reinterpret_cast<const float4*>(t.m + i);
                float4 v = *reinterpret_cast<const float4*>(t.v + i);
                w.x = adam_one(w.x, g.x, m.x, v.x, a, decay);
                w.y = adam_one(w.y, g.y, m.y, v.y, a, decay);
                w.z = adam_one(w.z, g.z, m.z, v.z, a, decay);
                w.w = adam_one(w.w, g.w, m.w, v.w, a, decay);
                *reinterpret_cast<float4*>(t.w + i) = w;
                *reinterpret_cast<float4*>(t.m + i) = m;
                *reinterpret_cast<float4*>(t.v + i) = v;
                if (cast) {
                    __nv_bfloat162 lo = __floats2bfloat162_rn(w.x, w.y);
                    __nv_bfloat162 hi = __floats2bfloat162_rn(w.z, w.w);
                    uint2 o;
                    o.x = *reinterpret_cast<uint32_t*>(&lo);
                    o.y = *reinterpret_cast<uint32_t*>(&hi);
                    *reinterpret_cast<uint2*>(t.wbf + i) = o;
                }
            }
            // The tail of a tensor whose length is not a multiple of 4: one element a thread.
            i = (end & ~(size_t)3) + threadIdx.x;
            if (i < start) i = end;
        } else {
            i = start + threadIdx.x;
        }
        for (; i < end; i += blockDim.x) {
            float m = t.m[i], v = t.v[i];
            const float w = adam_one(t.w[i], t.g[i], m, v, a, decay);
            t.w[i] = w;
            t.m[i] = m;
            t.v[i] = v;
            if (cast) t.wbf[i] = __float2bfloat16(w);
        }
    }
}

// Σ x² over a table of f32 tensors into one f32 (zeroed by the caller): one atomic per block.
struct SqTensor {
    const float* g;
    unsigned long long n;
    unsigned long long chunk0;
};

extern "C" __global__ void sumsq_chunks_f32(const SqTensor* __restrict__ ts, int nt,
                                            unsigned long long nchunks, float* out) {
    __shared__ float part[32];
    float s = 0.f;
    for (unsigned long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const SqTensor t = ts[mt_find(ts, nt, c)];
        const size_t start = (size_t)(c - t.chunk0) * MT_CHUNK;
        const size_t end = min(start + MT_CHUNK, (size_t)t.n);
        if ((reinterpret_cast<uintptr_t>(t.g) & 15) == 0) {
            size_t i = start + 4 * threadIdx.x;
            for (; i + 4 <= end; i += 4 * blockDim.x) {
                const float4 v = *reinterpret_cast<const float4*>(t.g + i);
                s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            for (i = (end & ~(size_t)3) + threadIdx.x; i >= start && i < end; i += blockDim.x)
                s += t.g[i] * t.g[i];
        } else {
            for (size_t i = start + threadIdx.x; i < end; i += blockDim.x) s += t.g[i] * t.g[i];
        }
    }
    s = warp_sum(s);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0 && s != 0.f) atomicAdd(out, s);
    }
}
