// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// LayerNorm / RMSNorm over the last dim d of x [n, d]; one warp per row, two-pass statistics.
template <typename T>
__device__ __forceinline__ void row_stats(const T* xr, int d, float eps, int rms, int lane,
                                          float* mean, float* rstd) {
    float mu = 0.f;
    if (!rms) {
        float s = 0.f;
        for (int j = lane; j < d; j += 32) s += to_f(xr[j]);
        mu = warp_sum(s) / d;
    }
    float ss = 0.f;
    for (int j = lane; j < d; j += 32) {
        float c = to_f(xr[j]) - mu;
        ss += c * c;
    }
    ss = warp_sum(ss) / d;
    *mean = mu;
    *rstd = rsqrtf(ss + eps);
}

// The norm kernels' `rms` flag: bit 0 RMSNorm (else LayerNorm); bit 1 the weight scales as
// 1 + w (Gemma's norms: `(1 + w)` in f32, w's stored value untouched); bit 2 (the whole-model
// step's kernels only) no norm at all: out = x, dx (+)= dy (OLMo 2's blocks read the residual
// stream as it is).
__device__ __forceinline__ float norm_woff(int rms) { return (rms & 2) ? 1.f : 0.f; }
__device__ __forceinline__ bool norm_ident(int rms) { return (rms & 4) != 0; }

template <typename T>
__device__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                         const T* __restrict__ b, T* __restrict__ y, int n, int d, float eps,
                         int rms) {
    const float woff = norm_woff(rms);
    rms &= 1;
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;
    const T* xr = x + (size_t)row * d;
    T* yr = y + (size_t)row * d;
    float mu, rstd;
    row_stats(xr, d, eps, rms, lane, &mu, &rstd);
    for (int j = lane; j < d; j += 32) {
        float v = (to_f(xr[j]) - mu) * rstd * (to_f(w[j]) + woff);
        if (b != nullptr) v += to_f(b[j]);
        yr[j] = from_f<T>(v);
    }
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w (RMSNorm drops the mean(g) term);
// dw += Σ_rows dy·x̂, db += Σ_rows dy into f32 accumulators (zeroed by the caller).
// Rows are strided over the grid, one warp per row. For d ≤ 32·NORM_K each lane owns the
// columns lane + 32·k: the row's x and dy stay in registers (one read each), and the lane
// sums its columns' dw/db over all its rows in registers; the block combines the warps'
// partials in shared memory once at the end, then one global atomic per column per block.
// Wider rows take a slower path with shared-memory atomics per element.
// With `add`, dx accumulates (dx += …): the residual stream's gradient in the whole-model step.
#define NORM_K 32
template <typename T>
__device__ void norm_bwd(const T* __restrict__ x, const T* __restrict__ w,
                         const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ dw,
                         float* __restrict__ db, int n, int d, float eps, int rms, int add = 0) {
    const float woff = norm_woff(rms);
    if (norm_ident(rms)) {  // (the step's OLMo 2 blocks: no norm) dx (+)= dy
        const size_t total = (size_t)n * d;
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
             i += (size_t)gridDim.x * blockDim.x)
            dx[i] = from_f<T>((add ? to_f(dx[i]) : 0.f) + to_f(dy[i]));
        return;
    }
    rms &= 1;
    extern __shared__ float sh[];  // [2·d]: dw then db
    for (int j = threadIdx.x; j < 2 * d; j += blockDim.x) sh[j] = 0.f;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    if (d <= 32 * NORM_K) {
        float aw[NORM_K], ab[NORM_K];
#pragma unroll
        for (int k = 0; k < NORM_K; k++) aw[k] = ab[k] = 0.f;
        for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n;
             row += gridDim.x * warps) {
            const T* xr = x + (size_t)row * d;
            const T* dyr = dy + (size_t)row * d;
            T* dxr = dx + (size_t)row * d;
            float xv[NORM_K], gv[NORM_K];
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < NORM_K; k++) {
                const int j = lane + 32 * k;
                xv[k] = j < d ? to_f(xr[j]) : 0.f;
                gv[k] = j < d ? to_f(dyr[j]) : 0.f;  // dy for now
                s += xv[k];
            }
            const float mu = rms ? 0.f : warp_sum(s) / d;
            float ss = 0.f;
#pragma unroll
            for (int k = 0; k < NORM_K; k++) {
                const int j = lane + 32 * k;
                const float cdev = j < d ? xv[k] - mu : 0.f;
                ss += cdev * cdev;
            }
            const float rstd = rsqrtf(warp_sum(ss) / d + eps);
            float a = 0.f, c = 0.f;
#pragma unroll
            for (int k = 0; k < NORM_K; k++) {
                const int j = lane + 32 * k;
                if (j < d) {
                    const float xh = (xv[k] - mu) * rstd;
                    const float dyv = gv[k];
                    aw[k] += dyv * xh;
                    ab[k] += dyv;
                    const float g = dyv * (to_f(w[j]) + woff);
                    gv[k] = g;
                    xv[k] = xh;
                    a += g;
                    c += g * xh;
                }
            }
            a = rms ? 0.f : warp_sum(a) / d;
            c = warp_sum(c) / d;
#pragma unroll
            for (int k = 0; k < NORM_K; k++) {
                const int j = lane + 32 * k;
                if (j < d) {
                    const float prev = add ? to_f(dxr[j]) : 0.f;
                    dxr[j] = from_f<T>(prev + rstd * (gv[k] - a - xv[k] * c));
                }
            }
        }
#pragma unroll
        for (int k = 0; k < NORM_K; k++) {
            const int j = lane + 32 * k;
            if (j < d) {
                atomicAdd(&sh[j], aw[k]);
                if (!rms && db != nullptr) atomicAdd(&sh[d + j], ab[k]);
            }
        }
    } else {
        for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n;
             row += gridDim.x * warps) {
            const T* xr = x + (size_t)row * d;
            const T* dyr = dy + (size_t)row * d;
            T* dxr = dx + (size_t)row * d;
            float mu, rstd;
            row_stats(xr, d, eps, rms, lane, &mu, &rstd);
            float a = 0.f, c = 0.f;
            for (int j = lane; j < d; j += 32) {
                float xh = (to_f(xr[j]) - mu) * rstd;
                float dyv = to_f(dyr[j]);
                float g = dyv * (to_f(w[j]) + woff);
                a += g;
                c += g * xh;
                atomicAdd(&sh[j], dyv * xh);
                if (!rms && db != nullptr) atomicAdd(&sh[d + j], dyv);
            }
            a = rms ? 0.f : warp_sum(a) / d;
            c = warp_sum(c) / d;
            for (int j = lane; j < d; j += 32) {
                float xh = (to_f(xr[j]) - mu) * rstd;
                float g = to_f(dyr[j]) * (to_f(w[j]) + woff);
                const float prev = add ? to_f(dxr[j]) : 0.f;
                dxr[j] = from_f<T>(prev + rstd * (g - a - xh * c));
            }
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        if (dw != nullptr) atomicAdd(&dw[j], sh[j]);
        if (!rms && db != nullptr) atomicAdd(&db[j], sh[d + j]);
    }
}
