// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Softmax cross-entropy over the vocabulary, straight from the compute-dtype logits [n, v]:
// loss[r] = logsumexp(x[r, :]) − x[r, t[r]] in f32. One block per row, online max/sum.
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) {
        m = mm;
        s = 0.f;
        return;
    }
    s = s * __expf(m - mm) + s2 * __expf(m2 - mm);
    m = mm;
}

// The log-sum-exp of a whole block's running (max, sum) pairs, returned to every thread
// (blockDim.x a multiple of 32, at most 1024).
__device__ float block_lse(float m, float s) {
    __shared__ float sm[32], ss[32], out;
    for (int o = 16; o > 0; o >>= 1)
        lse_combine(m, s, __shfl_xor_sync(FULL_MASK, m, o), __shfl_xor_sync(FULL_MASK, s, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? sm[lane] : -INFINITY;
        s = lane < warps ? ss[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1)
            lse_combine(m, s, __shfl_xor_sync(FULL_MASK, m, o),
                        __shfl_xor_sync(FULL_MASK, s, o));
        if (lane == 0) out = m + logf(s);
    }
    __syncthreads();
    return out;
}

template <typename T>
__device__ void ce_fwd(const T* __restrict__ x, const uint32_t* __restrict__ t,
                       float* __restrict__ loss, int n, int v) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const T* xr = x + (size_t)row * v;
    float m = -INFINITY, s = 0.f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float z = to_f(xr[j]);
        if (z > m) {
            s = s * __expf(m - z) + 1.f;
            m = z;
        } else {
            s += __expf(z - m);
        }
    }
    const float lse = block_lse(m, s);
    if (threadIdx.x == 0) {
        uint32_t tg = t[row];
        loss[row] = tg < (uint32_t)v ? lse - to_f(xr[tg]) : __int_as_float(0x7fc00000);
    }
}

// dx[r, j] = g[r]·(softmax(x[r])_j − [j = t[r]]), with logsumexp = loss[r] + x[r, t[r]].
template <typename T>
__device__ void ce_bwd(const T* __restrict__ x, const uint32_t* __restrict__ t,
                       const float* __restrict__ loss, const float* __restrict__ g,
                       T* __restrict__ dx, int n, int v) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const T* xr = x + (size_t)row * v;
    T* dxr = dx + (size_t)row * v;
    const uint32_t tg = t[row];
    const float gr = g[row];
    const float lse = tg < (uint32_t)v ? loss[row] + to_f(xr[tg]) : 0.f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float p = __expf(to_f(xr[j]) - lse);
        dxr[j] = from_f<T>(gr * (p - (j == (int)tg ? 1.f : 0.f)));
    }
}
