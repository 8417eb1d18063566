// QK-norm per head (Qwen3, Gemma 3): RMSNorm over each q and k head's dims, one weight [hd]
// for every q head and one for every k head, before RoPE; forward and backward.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, warp_sum, to_f, from_f, ...) used here.
#pragma once

#define QKN_MAX_PER_LANE 8  // head dims up to 256

// In place on the first H + KVH heads (q's, then k's) of each row of qkv [n, ld]: a warp a
// (row, head); the input kept in raw [n, H + KVH, hd] and each head's 1/rms in rstd [n·(H + KVH)]
// for the backward. y = x · rsqrt(mean(x²) + eps) · (w + woff), in f32 (woff 1: Gemma's 1 + w).
extern "C" __global__ void qk_norm_fwd_bf16(bf16_t* __restrict__ qkv, bf16_t* __restrict__ raw,
                                            float* __restrict__ rstd,
                                            const bf16_t* __restrict__ wq,
                                            const bf16_t* __restrict__ wk, int n, int H, int KVH,
                                            int hd, int ld, float eps, float woff) {
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int G = H + KVH;
    const size_t total = (size_t)n * G;
    for (size_t r = (size_t)blockIdx.x * warps + (threadIdx.x >> 5); r < total;
         r += (size_t)gridDim.x * warps) {
        const size_t bt = r / G;
        const int g = (int)(r - bt * G);
        bf16_t* x = qkv + bt * ld + (size_t)g * hd;
        bf16_t* xr = raw + r * hd;
        const bf16_t* w = g < H ? wq : wk;
        float v[QKN_MAX_PER_LANE];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < QKN_MAX_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            v[k] = j < hd ? to_f(x[j]) : 0.f;
            ss += v[k] * v[k];
        }
        ss = warp_sum(ss);
        const float rs = rsqrtf(ss / hd + eps);
#pragma unroll
        for (int k = 0; k < QKN_MAX_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < hd) {
                xr[j] = x[j];
                x[j] = from_f<bf16_t>(v[k] * rs * (to_f(w[j]) + woff));
            }
        }
        if (lane == 0) rstd[r] = rs;
    }
}

// The backward, in place on the q and k heads of dqkv [n, ld] (the gradient after RoPE's
// inverse): dx = rstd·(w·dy − x̂·mean(w·dy·x̂)), x̂ = raw·rstd; the weights' gradients
// dw += Σ dy·x̂ over the rows and heads (dwq/dwk null: frozen), reduced per block in shared
// memory first (one atomic per block and column).
extern "C" __global__ void qk_norm_bwd_bf16(bf16_t* __restrict__ dqkv,
                                            const bf16_t* __restrict__ raw,
                                            const float* __restrict__ rstd,
                                            const bf16_t* __restrict__ wq,
                                            const bf16_t* __restrict__ wk, float* __restrict__ dwq,
                                            float* __restrict__ dwk, int n, int H, int KVH, int hd,
                                            int ld, float woff) {
    __shared__ float part[2][32 * QKN_MAX_PER_LANE];
    for (int i = threadIdx.x; i < 2 * 32 * QKN_MAX_PER_LANE; i += blockDim.x) (&part[0][0])[i] = 0.f;
    __syncthreads();
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int G = H + KVH;
    const size_t total = (size_t)n * G;
    float aq[QKN_MAX_PER_LANE], ak[QKN_MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < QKN_MAX_PER_LANE; ++k) aq[k] = ak[k] = 0.f;
    for (size_t r = (size_t)blockIdx.x * warps + (threadIdx.x >> 5); r < total;
         r += (size_t)gridDim.x * warps) {
        const size_t bt = r / G;
        const int g = (int)(r - bt * G);
        bf16_t* dy = dqkv + bt * ld + (size_t)g * hd;
        const bf16_t* xr = raw + r * hd;
        const bf16_t* w = g < H ? wq : wk;
        const float rs = rstd[r];
        float d[QKN_MAX_PER_LANE], xh[QKN_MAX_PER_LANE], wd[QKN_MAX_PER_LANE];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < QKN_MAX_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            const bool in = j < hd;
            d[k] = in ? to_f(dy[j]) : 0.f;
            xh[k] = in ? to_f(xr[j]) * rs : 0.f;
            wd[k] = in ? (to_f(w[j]) + woff) * d[k] : 0.f;
            dot += wd[k] * xh[k];
        }
        dot = warp_sum(dot) / hd;
#pragma unroll
        for (int k = 0; k < QKN_MAX_PER_LANE; ++k) {
            const int j = lane + 32 * k;
            if (j < hd) dy[j] = from_f<bf16_t>(rs * (wd[k] - xh[k] * dot));
            if (g < H) {
                aq[k] += d[k] * xh[k];
            } else {
                ak[k] += d[k] * xh[k];
            }
        }
    }
    if (dwq == nullptr) return;
#pragma unroll
    for (int k = 0; k < QKN_MAX_PER_LANE; ++k) {
        const int j = lane + 32 * k;
        if (j < hd) {
            atomicAdd(&part[0][j], aq[k]);
            atomicAdd(&part[1][j], ak[k]);
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        atomicAdd(dwq + j, part[0][j]);
        atomicAdd(dwk + j, part[1][j]);
    }
}

// QK-norm over the whole projection (OLMo 2): RMSNorm over columns off..off + width of each row
// of qkv [n, ld] (q's: 0..H·hd, k's: H·hd..(H + KVH)·hd), one weight [width]; a block a row
// (grid-strided, 512 threads), each thread QKW_PER_THREAD columns at most (widths up to 8192). The input is
// kept in raw [n, raw_ld] at the same columns and 1/rms in rstd[2·row + part] for the backward.
#define QKW_PER_THREAD 16
__device__ __forceinline__ float qkw_block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // (red reused across calls)
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}
extern "C" __global__ void __launch_bounds__(512) qk_norm_whole_fwd_bf16(bf16_t* __restrict__ qkv, bf16_t* __restrict__ raw,
                                                  float* __restrict__ rstd,
                                                  const bf16_t* __restrict__ w, int n, int off,
                                                  int width, int ld, int raw_ld, int part, float eps,
                                                  float woff) {
    __shared__ float red[32];
    for (int row = blockIdx.x; row < n; row += gridDim.x) {
        bf16_t* x = qkv + (size_t)row * ld + off;
        bf16_t* xr = raw + (size_t)row * raw_ld + off;
        float v[QKW_PER_THREAD];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < QKW_PER_THREAD; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            v[k] = j < width ? to_f(x[j]) : 0.f;
            ss += v[k] * v[k];
        }
        const float rs = rsqrtf(qkw_block_sum(ss, red) / width + eps);
#pragma unroll
        for (int k = 0; k < QKW_PER_THREAD; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < width) {
                xr[j] = x[j];
                x[j] = from_f<bf16_t>(v[k] * rs * (to_f(w[j]) + woff));
            }
        }
        if (threadIdx.x == 0) rstd[2 * (size_t)row + part] = rs;
    }
}

// Its backward, in place on dqkv's columns off..off + width: dx = rstd·(w·dy − x̂·mean(w·dy·x̂)),
// and dw += Σ_rows dy·x̂ (dw null: frozen), summed per thread over its rows first.
extern "C" __global__ void __launch_bounds__(512) qk_norm_whole_bwd_bf16(bf16_t* __restrict__ dqkv,
                                                  const bf16_t* __restrict__ raw,
                                                  const float* __restrict__ rstd,
                                                  const bf16_t* __restrict__ w,
                                                  float* __restrict__ dw, int n, int off, int width,
                                                  int ld, int raw_ld, int part, float woff) {
    __shared__ float red[32];
    float acc[QKW_PER_THREAD];
#pragma unroll
    for (int k = 0; k < QKW_PER_THREAD; ++k) acc[k] = 0.f;
    for (int row = blockIdx.x; row < n; row += gridDim.x) {
        bf16_t* dy = dqkv + (size_t)row * ld + off;
        const bf16_t* xr = raw + (size_t)row * raw_ld + off;
        const float rs = rstd[2 * (size_t)row + part];
        float d[QKW_PER_THREAD], xh[QKW_PER_THREAD], wd[QKW_PER_THREAD];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < QKW_PER_THREAD; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            const bool in = j < width;
            d[k] = in ? to_f(dy[j]) : 0.f;
            xh[k] = in ? to_f(xr[j]) * rs : 0.f;
            wd[k] = in ? (to_f(w[j]) + woff) * d[k] : 0.f;
            dot += wd[k] * xh[k];
        }
        dot = qkw_block_sum(dot, red) / width;
#pragma unroll
        for (int k = 0; k < QKW_PER_THREAD; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < width) dy[j] = from_f<bf16_t>(rs * (wd[k] - xh[k] * dot));
            acc[k] += d[k] * xh[k];
        }
    }
    if (dw == nullptr) return;
#pragma unroll
    for (int k = 0; k < QKW_PER_THREAD; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < width) atomicAdd(dw + j, acc[k]);
    }
}
