// Fused kernels for cockpit's CUDA engine (built to PTX by build.rs with the `cuda` feature).
// Every kernel reads and writes the compute dtype (f32, bf16, f16) and accumulates in f32.
// Layouts are contiguous row-major; the Rust side (src/engine/kernels/mod.rs) checks that.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

#ifdef COCKPIT_F16
// The fp16 build (cockpit_kernels_f16.ptx; build.rs defines COCKPIT_F16): this same source with
// the 16-bit type of the whole-model step and the flash kernels switched from bf16 to fp16, for
// `precision.dtype = "f16"` (fp16 activations and tensor-core operands, fp32 accumulation, the
// gradients scaled by the dynamic loss scale). The kernels keep their `_bf16` names: the module
// they are loaded from says which type they compute in (src/engine/kernels/cuda.rs).
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

// ---------------------------------------------------------------------------------------------
// Dropout masks from a counter-based RNG: Philox4x32-10 (Salmon et al., SC'11), keyed by the
// micro-batch's 64-bit seed; the counter names the element, so a mask is a pure function of
// (seed, site, element) — a replayed step draws the same one, on any device, in any order.
// src/engine/dropout.rs is the same arithmetic on the host (the CPU path and the tests).
// Each call gives 128 bits = eight 16-bit uniforms u; an element is kept iff u >= thr, where
// thr = round(p·65536), and a kept value is scaled by 65536 / (65536 − thr).
//   rows [rows, cols] (embedding and residual dropout): element (r, c) ↦ counter
//     (r lo, r hi, c / 8, site), uniform (c mod 8) — eight adjacent columns per call.
//   attention probabilities [B·H·T, T]: element (query row r, key j) with j = 64·tile + jj,
//     jj = 8·nt + 2·t4 + e ↦ counter (r lo, r hi, 8·tile + 2·t4 + nt / 4, site), uniform
//     2·(nt mod 4) + e — the layout of flash attention's mma fragments (a thread's 16 keys
//     of a 64-key tile in two calls).
struct Philox4 {
    uint32_t v[4];
};
__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                 uint32_t c3, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int i = 0; i < 10; i++) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    Philox4 r;
    r.v[0] = c0;
    r.v[1] = c1;
    r.v[2] = c2;
    r.v[3] = c3;
    return r;
}
// The 16-bit uniform i (0..7) of a call.
__device__ __forceinline__ uint32_t philox_u16(const Philox4& r, int i) {
    return (r.v[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
}
// Eight kept flags (bit i: uniform i kept) of the rows layout's call for (row, col / 8).
__device__ __forceinline__ uint32_t drop_bits8(unsigned long long seed, uint32_t site,
                                               unsigned long long row, uint32_t col8,
                                               uint32_t thr) {
    const Philox4 r = philox4x32_10((uint32_t)row, (uint32_t)(row >> 32), col8, site,
                                    (uint32_t)seed, (uint32_t)(seed >> 32));
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) bits |= (philox_u16(r, i) >= thr ? 1u : 0u) << i;
    return bits;
}

// The mask (0 or scale) of either layout as f32 [rows, cols] (the per-op path multiplies by it).
extern "C" __global__ void dropout_mask_f32(float* __restrict__ out, int rows, int cols,
                                            unsigned long long seed, uint32_t site, uint32_t thr,
                                            float scale, int attn) {
    const size_t total = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const unsigned long long r = i / cols;
        const uint32_t c = (uint32_t)(i % cols);
        uint32_t ctr2, u;
        if (attn) {
            const uint32_t tile = c >> 6, jj = c & 63, nt = jj >> 3, t4 = (jj >> 1) & 3;
            ctr2 = 8 * tile + 2 * t4 + (nt >> 2);
            u = 2 * (nt & 3) + (jj & 1);
        } else {
            ctr2 = c >> 3;
            u = c & 7;
        }
        const Philox4 p = philox4x32_10((uint32_t)r, (uint32_t)(r >> 32), ctr2, site,
                                        (uint32_t)seed, (uint32_t)(seed >> 32));
        out[i] = philox_u16(p, u) >= thr ? scale : 0.f;
    }
}

// ---------------------------------------------------------------------------------------------
// Causal softmax over the last dim of attention scores [rows = B·H·Tq, Tk]:
// y[i, j] = softmax_j(scale · x[i, j]) over j ≤ i mod Tq + (Tk − Tq); masked entries are 0.
// One warp per row.
template <typename T>
__device__ void causal_softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int rows, int tq,
                                   int tk, float scale) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + (size_t)row * tk;
    T* yr = y + (size_t)row * tk;
    const int lim = row % tq + (tk - tq);  // last visible column
    float m = -INFINITY;
    for (int j = lane; j <= lim; j += 32) m = fmaxf(m, to_f(xr[j]) * scale);
    m = warp_max(m);
    float s = 0.f;
    for (int j = lane; j <= lim; j += 32) s += __expf(to_f(xr[j]) * scale - m);
    s = warp_sum(s);
    const float inv = s > 0.f ? 1.f / s : 0.f;
    for (int j = lane; j < tk; j += 32) {
        float p = j <= lim ? __expf(to_f(xr[j]) * scale - m) * inv : 0.f;
        yr[j] = from_f<T>(p);
    }
}

// dx = scale · y ⊙ (dy − Σ_j y_j dy_j)
template <typename T>
__device__ void causal_softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy,
                                   T* __restrict__ dx, int rows, int tq, int tk, float scale) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const size_t off = (size_t)row * tk;
    const int lim = row % tq + (tk - tq);
    float d = 0.f;
    for (int j = lane; j <= lim; j += 32) d += to_f(y[off + j]) * to_f(dy[off + j]);
    d = warp_sum(d);
    for (int j = lane; j < tk; j += 32) {
        float g = j <= lim ? scale * to_f(y[off + j]) * (to_f(dy[off + j]) - d) : 0.f;
        dx[off + j] = from_f<T>(g);
    }
}

// ---------------------------------------------------------------------------------------------
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

template <typename T>
__device__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                         const T* __restrict__ b, T* __restrict__ y, int n, int d, float eps,
                         int rms) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;
    const T* xr = x + (size_t)row * d;
    T* yr = y + (size_t)row * d;
    float mu, rstd;
    row_stats(xr, d, eps, rms, lane, &mu, &rstd);
    for (int j = lane; j < d; j += 32) {
        float v = (to_f(xr[j]) - mu) * rstd * to_f(w[j]);
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
                    const float g = dyv * to_f(w[j]);
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
                float g = dyv * to_f(w[j]);
                a += g;
                c += g * xh;
                atomicAdd(&sh[j], dyv * xh);
                if (!rms && db != nullptr) atomicAdd(&sh[d + j], dyv);
            }
            a = rms ? 0.f : warp_sum(a) / d;
            c = warp_sum(c) / d;
            for (int j = lane; j < d; j += 32) {
                float xh = (to_f(xr[j]) - mu) * rstd;
                float g = to_f(dyr[j]) * to_f(w[j]);
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

// ---------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------
// Bias add and bias + GELU (tanh approximation, as candle's `gelu`) over x [n, c], b [c].
template <typename T>
__device__ void bias_add(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                         size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        y[i] = from_f<T>(to_f(x[i]) + to_f(b[i % c]));
    }
}

#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f

template <typename T>
__device__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ b,
                              T* __restrict__ y, size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = to_f(x[i]) + (b != nullptr ? to_f(b[i % c]) : 0.f);
        float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
        y[i] = from_f<T>(0.5f * u * (1.f + th));
    }
}

template <typename T>
__device__ void bias_gelu_bwd(const T* __restrict__ x, const T* __restrict__ b,
                              const T* __restrict__ dy, T* __restrict__ dx, size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = to_f(x[i]) + (b != nullptr ? to_f(b[i % c]) : 0.f);
        float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
        float d = 0.5f * (1.f + th) +
                  0.5f * u * (1.f - th * th) * GELU_K0 * (1.f + 3.f * GELU_K1 * u * u);
        dx[i] = from_f<T>(to_f(dy[i]) * d);
    }
}

// out[c] += Σ_rows x[r, c] (f32 accumulator zeroed by the caller). Block (32, 8).
template <typename T>
__device__ void col_sum(const T* __restrict__ x, float* __restrict__ out, int n, int c) {
    __shared__ float part[8][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (col < c) {
        for (int r = blockIdx.y * 8 + threadIdx.y; r < n; r += gridDim.y * 8)
            s += to_f(x[(size_t)r * c + col]);
    }
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += part[k][threadIdx.x];
        atomicAdd(&out[col], t);
    }
}

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

// ---------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------
// The whole-model training step (src/engine/kernels/step.rs): GPT-2 style, bf16 activations,
// fp32 master weights and gradients. Kernels here only add what the per-op kernels above lack.

// Eight bf16 values moved as one 16-byte access.
union Bf8 {
    uint4 u;
    __nv_bfloat162 h[4];
};


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

// out[r, :] = wte[ids[r], :] + wpe[r mod t, :]
extern "C" __global__ void embed_fwd_bf16(const uint32_t* __restrict__ ids,
                                          const bf16_t* __restrict__ wte,
                                          const bf16_t* __restrict__ wpe, bf16_t* __restrict__ out,
                                          int n, int t, int c, int vocab) {
    const size_t total = (size_t)n * c;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / c), j = (int)(i % c);
        const uint32_t id = ids[r];
        float v = id < (uint32_t)vocab ? to_f(wte[(size_t)id * c + j]) : 0.f;
        if (wpe != nullptr) v += to_f(wpe[(size_t)(r % t) * c + j]);
        out[i] = __float2bfloat16(v);
    }
}

// The residual add fused with the next norm: res = x + y + bias (y null: res is x itself,
// nothing written; bias may be null), out = Norm(res)·w + b (b may be null; rms: RMSNorm, no
// mean; `out`'s rows `ldo` apart: a LoRA group's `[x | x·Aᵀ]`). One warp per row; the
// statistics are taken from the stored bf16 residual, as the backward recomputes them.
extern "C" __global__ void residual_norm_bf16(const bf16_t* __restrict__ x,
                                              const bf16_t* __restrict__ y,
                                              const bf16_t* __restrict__ bias, bf16_t* res,
                                              const bf16_t* __restrict__ w,
                                              const bf16_t* __restrict__ b,
                                              bf16_t* __restrict__ out, int n, int d, float eps,
                                              int rms, const unsigned long long* seed,
                                              uint32_t site, uint32_t thr, float dscale,
                                              int ldo) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n) return;
    const bf16_t* src = x + (size_t)row * d;
    if (y != nullptr) {
        const bf16_t* yr = y + (size_t)row * d;
        bf16_t* rr = res + (size_t)row * d;
        for (int j = lane; j < d; j += 32) {
            float u = to_f(yr[j]) + (bias != nullptr ? to_f(bias[j]) : 0.f);
            if (thr || dscale != 1.f) {
                // (a mask and its scale, or Granite's residual multiplier alone)
                const uint32_t keep = thr ? drop_bits8(*seed, site, row, j >> 3, thr) : 0xFFu;
                u = (keep >> (j & 7)) & 1 ? __bfloat162float(__float2bfloat16(u)) * dscale : 0.f;
            }
            rr[j] = __float2bfloat16(to_f(src[j]) + u);
        }
        __syncwarp();
        src = rr;
    }
    float mu, rstd;
    row_stats(src, d, eps, rms, lane, &mu, &rstd);
    bf16_t* o = out + (size_t)row * ldo;
    for (int j = lane; j < d; j += 32)
        o[j] = __float2bfloat16((to_f(src[j]) - mu) * rstd * to_f(w[j]) +
                                (b != nullptr ? to_f(b[j]) : 0.f));
}

extern "C" __global__ void norm_bwd_add_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* dy,
                                             bf16_t* dx, float* dw, float* db, int n, int d,
                                             float eps, int rms) {
    norm_bwd<bf16_t>(x, w, dy, dx, dw, db, n, d, eps, rms, 1);
}

// Row-in-registers LayerNorm kernels for bf16 rows with d a multiple of 8 and d ≤ 256·CH:
// one warp per row, each lane owns CH chunks of 8 adjacent columns (16-byte accesses), so a
// row is read once. The raw bf16 chunks stay packed in registers (converted on use) to keep
// the register count low enough for two 256-thread blocks per SM.
__device__ __forceinline__ float2 bf2f(const Bf8& v, int i) { return __bfloat1622float2(v.h[i]); }

// (mean, rstd) of a row held as CH packed chunks per lane (padding chunks are zero), two-pass;
// rms: RMSNorm's (0, 1/sqrt(mean(x²) + eps)).
template <int CH>
__device__ __forceinline__ float2 row_stats_v8(const Bf8 (&r)[CH], int lane, int d, float eps,
                                               int rms) {
    float s = 0.f;
    if (!rms) {
#pragma unroll
        for (int c = 0; c < CH; c++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 a = bf2f(r[c], i);
                s += a.x + a.y;
            }
        }
    }
    const float mu = rms ? 0.f : warp_sum(s) / d;
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < CH; c++) {
        if ((lane + 32 * c) * 8 < d) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 a = bf2f(r[c], i);
                ss += (a.x - mu) * (a.x - mu) + (a.y - mu) * (a.y - mu);
            }
        }
    }
    return make_float2(mu, rsqrtf(warp_sum(ss) / d + eps));
}

// The residual add fused with the next norm: res = x + y + bias (y null: res is x; bias may
// be null), out = Norm(res)·w + b (b may be null; rms: RMSNorm; rows `ldo` apart, a multiple
// of 8). The statistics come from the rounded bf16 residual as stored, which is what the
// backward recomputes them from.
// With thr > 0, y + bias goes through dropout first (rows layout, site `site`, the seed read
// from the device so that a captured graph draws a new mask per micro-batch).
template <int CH>
__device__ void residual_norm_v8(const bf16_t* __restrict__ x, const bf16_t* __restrict__ y,
                                 const bf16_t* __restrict__ bias, bf16_t* res,
                                 const bf16_t* __restrict__ w, const bf16_t* __restrict__ b,
                                 bf16_t* __restrict__ out, float2* __restrict__ stats, int n,
                                 int d, float eps, int rms, const unsigned long long* seed,
                                 uint32_t site, uint32_t thr, float dscale, int ldo) {
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n; row += gridDim.x * warps) {
        Bf8 r[CH];
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int col0 = (lane + 32 * c) * 8;
            r[c].u = make_uint4(0, 0, 0, 0);
            if (col0 < d) {
                const size_t o = (size_t)row * d + col0;
                r[c].u = *reinterpret_cast<const uint4*>(x + o);
                if (y != nullptr) {
                    Bf8 yv, bv;
                    yv.u = *reinterpret_cast<const uint4*>(y + o);
                    bv.u = bias != nullptr ? *reinterpret_cast<const uint4*>(bias + col0)
                                           : make_uint4(0, 0, 0, 0);
                    const uint32_t keep =
                        thr ? drop_bits8(*seed, site, row, col0 >> 3, thr) : 0xFFu;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float2 a = bf2f(r[c], i), e = bf2f(yv, i), f = bf2f(bv, i);
                        float u0 = e.x + f.x, u1 = e.y + f.y;
                        if (thr || dscale != 1.f) {
                            // (rounded to bf16 first, as the per-op model's projection output)
                            u0 = __bfloat162float(__float2bfloat16(u0));
                            u1 = __bfloat162float(__float2bfloat16(u1));
                            u0 = (keep >> (2 * i)) & 1 ? u0 * dscale : 0.f;
                            u1 = (keep >> (2 * i + 1)) & 1 ? u1 * dscale : 0.f;
                        }
                        r[c].h[i] = __floats2bfloat162_rn(a.x + u0, a.y + u1);
                    }
                    *reinterpret_cast<uint4*>(res + o) = r[c].u;
                }
            }
        }
        const float2 st = row_stats_v8<CH>(r, lane, d, eps, rms);
        const float mu = st.x, rstd = st.y;
        if (stats != nullptr && lane == 0) stats[row] = make_float2(mu, rstd);
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int col0 = (lane + 32 * c) * 8;
            if (col0 < d) {
                Bf8 wv, bv, o;
                wv.u = *reinterpret_cast<const uint4*>(w + col0);
                bv.u = b != nullptr ? *reinterpret_cast<const uint4*>(b + col0)
                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 a = bf2f(r[c], i), g = bf2f(wv, i), f = bf2f(bv, i);
                    o.h[i] = __floats2bfloat162_rn((a.x - mu) * rstd * g.x + f.x,
                                                   (a.y - mu) * rstd * g.y + f.y);
                }
                *reinterpret_cast<uint4*>(out + (size_t)row * ldo + col0) = o.u;
            }
        }
    }
}

// acc[i] += the 8 bf16 values of u.
__device__ __forceinline__ void add_bf8(float* acc, uint4 u) {
    Bf8 b;
    b.u = u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(b.h[i]);
        acc[2 * i] += f.x;
        acc[2 * i + 1] += f.y;
    }
}

// LayerNorm backward in two passes. This one: dx (+)= rstd·(g − mean(g) − x̂·mean(g·x̂)) with
// g = dy·w, a warp per row (dy's rows `ldg` apart: a LoRA group's `[dx | du]`). `add`: dx
// accumulates into what it holds (the residual stream's gradient). No column sums here
// (norm_bwd_wb_v8 does them), so few registers and many rows in flight per multiprocessor.
template <int CH>
__device__ void norm_bwd_dx_v8(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                               const bf16_t* __restrict__ dy, bf16_t* dx,
                               const float2* __restrict__ stats, int n, int d, float eps,
                               int add, int rms, int ldg) {
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < n; row += gridDim.x * warps) {
        // Every load of the row first (x, dy and the residual gradient), one round trip.
        Bf8 xa[CH], ga[CH], pa[CH];
        const float2 st = stats != nullptr ? stats[row] : make_float2(0.f, 0.f);
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int col0 = (lane + 32 * c) * 8;
            xa[c].u = ga[c].u = pa[c].u = make_uint4(0, 0, 0, 0);
            if (col0 < d) {
                const size_t o = (size_t)row * d + col0;
                xa[c].u = *reinterpret_cast<const uint4*>(x + o);
                ga[c].u = *reinterpret_cast<const uint4*>(dy + (size_t)row * ldg + col0);
                // (Wide rows load the residual gradient only when they add it: registers.)
                if (add && CH <= 4) pa[c].u = *reinterpret_cast<const uint4*>(dx + o);
            }
        }
        // The forward's statistics, or recomputed the same way.
        const float2 ms = stats != nullptr ? st : row_stats_v8<CH>(xa, lane, d, eps, rms);
        const float mu = ms.x, rstd = ms.y;
        float a = 0.f, cc = 0.f;
#pragma unroll
        for (int c = 0; c < CH; c++) {
            Bf8 wv;
            const int col0 = (lane + 32 * c) * 8;
            wv.u = col0 < d ? *reinterpret_cast<const uint4*>(w + col0) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 xv = bf2f(xa[c], i), gv = bf2f(ga[c], i), wf = bf2f(wv, i);
                const float g0 = gv.x * wf.x, g1 = gv.y * wf.y;
                a += g0 + g1;
                cc += g0 * (xv.x - mu) * rstd + g1 * (xv.y - mu) * rstd;
            }
        }
        a = rms ? 0.f : warp_sum(a) / d;
        cc = warp_sum(cc) / d;
#pragma unroll
        for (int c = 0; c < CH; c++) {
            const int col0 = (lane + 32 * c) * 8;
            if (col0 < d) {
                Bf8 wv, out;
                wv.u = *reinterpret_cast<const uint4*>(w + col0);
                if (add && CH > 4) pa[c].u = *reinterpret_cast<const uint4*>(dx + (size_t)row * d + col0);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float2 xv = bf2f(xa[c], i), gv = bf2f(ga[c], i), wf = bf2f(wv, i);
                    const float2 p = bf2f(pa[c], i);
                    const float h0 = (xv.x - mu) * rstd, h1 = (xv.y - mu) * rstd;
                    out.h[i] = __floats2bfloat162_rn(p.x + rstd * (gv.x * wf.x - a - h0 * cc),
                                                     p.y + rstd * (gv.y * wf.y - a - h1 * cc));
                }
                *reinterpret_cast<uint4*>(dx + (size_t)row * d + col0) = out.u;
            }
        }
    }
}

// LayerNorm backward, second pass: the column sums dw += Σ dy·x̂ and db += Σ dy over the rows,
// and, where `dsum` is given, dsum += Σ dx of the first pass's output (the residual stream's
// gradient, which is the next linear layer's bias gradient). Rows' statistics from the
// forward; dy's rows `ldg` apart. Block (32, 8), 8 columns per thread, two rows' loads in
// flight per thread; grid (⌈d/256⌉, any): few row blocks, so each column takes few atomics.
extern "C" __global__ void norm_bwd_wb_v8_bf16(const bf16_t* __restrict__ x,
                                               const bf16_t* __restrict__ dy,
                                               const bf16_t* __restrict__ dx,
                                               const float2* __restrict__ stats,
                                               float* __restrict__ dw, float* __restrict__ db,
                                               float* __restrict__ dsum, int n, int d,
                                               int ldg) {
    __shared__ float part[3][8][256 + 4];
    const int col0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    const bool sum = dsum != nullptr;
    float aw[8], ab[8], as[8];
#pragma unroll
    for (int i = 0; i < 8; i++) aw[i] = ab[i] = as[i] = 0.f;
    if (col0 < d) {
        const int step = gridDim.y * 8;
        const size_t ld = (size_t)d / 8, lg = (size_t)ldg / 8;  // row strides in uint4
        const uint4* px = reinterpret_cast<const uint4*>(x + col0);
        const uint4* pg = reinterpret_cast<const uint4*>(dy + col0);
        const uint4* po = reinterpret_cast<const uint4*>(dx + col0);
        auto add_row = [&](uint4 xu, uint4 gu, uint4 ou, float2 st) {
            Bf8 xb, gb;
            xb.u = xu;
            gb.u = gu;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float2 xv = bf2f(xb, i), gv = bf2f(gb, i);
                aw[2 * i] += gv.x * (xv.x - st.x) * st.y;
                aw[2 * i + 1] += gv.y * (xv.y - st.x) * st.y;
                ab[2 * i] += gv.x;
                ab[2 * i + 1] += gv.y;
            }
            if (sum) add_bf8(as, ou);
        };
        const uint4 zero = make_uint4(0, 0, 0, 0);
        int r = blockIdx.y * 8 + threadIdx.y;
        for (; r + step < n; r += 2 * step) {
            const size_t o0 = (size_t)r * ld, o1 = (size_t)(r + step) * ld;
            const uint4 x0 = px[o0], g0 = pg[(size_t)r * lg], x1 = px[o1],
                        g1 = pg[(size_t)(r + step) * lg];
            const uint4 s0 = sum ? po[o0] : zero, s1 = sum ? po[o1] : zero;
            const float2 st0 = stats[r], st1 = stats[r + step];
            add_row(x0, g0, s0, st0);
            add_row(x1, g1, s1, st1);
        }
        if (r < n) {
            const size_t o0 = (size_t)r * ld;
            add_row(px[o0], pg[(size_t)r * lg], sum ? po[o0] : zero, stats[r]);
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        part[0][threadIdx.y][threadIdx.x * 8 + i] = aw[i];
        part[1][threadIdx.y][threadIdx.x * 8 + i] = ab[i];
        part[2][threadIdx.y][threadIdx.x * 8 + i] = as[i];
    }
    __syncthreads();
    // 256 threads, 256 columns of this block: one column each.
    const int t = threadIdx.y * 32 + threadIdx.x;
    const int col = blockIdx.x * 256 + t;
    if (col < d) {
        float s0 = 0.f, s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            s0 += part[0][k][t];
            s1 += part[1][k][t];
            s2 += part[2][k][t];
        }
        if (dw != nullptr) atomicAdd(&dw[col], s0);
        if (db != nullptr) atomicAdd(&db[col], s1);
        if (sum) atomicAdd(&dsum[col], s2);
    }
}

// out[c] += Σ_rows x[r, c] for bf16 x [n, c] with c a multiple of 8 (f32 accumulator, zeroed
// or accumulating): 16-byte loads, 8 columns per thread, four rows' loads in flight per
// thread. Block (32, 8), grid (⌈c/256⌉, any): few row blocks (about two blocks per
// multiprocessor in all), so each column takes few atomics.
extern "C" __global__ void col_sum_v8_bf16(const bf16_t* __restrict__ x, float* __restrict__ out,
                                           int n, int c) {
    __shared__ float part[8][256 + 4];
    const int col0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.f;
    if (col0 < c) {
        const int step = gridDim.y * 8;
        const uint4* p = reinterpret_cast<const uint4*>(x + col0);
        const size_t ld = (size_t)c / 8;  // row stride in uint4
        int r = blockIdx.y * 8 + threadIdx.y;
        for (; r + 3 * step < n; r += 4 * step) {
            const uint4 a = p[(size_t)r * ld], b = p[(size_t)(r + step) * ld],
                        cc = p[(size_t)(r + 2 * step) * ld], d = p[(size_t)(r + 3 * step) * ld];
            add_bf8(acc, a);
            add_bf8(acc, b);
            add_bf8(acc, cc);
            add_bf8(acc, d);
        }
        for (; r < n; r += step) add_bf8(acc, p[(size_t)r * ld]);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) part[threadIdx.y][threadIdx.x * 8 + i] = acc[i];
    __syncthreads();
    // 256 threads, 256 columns of this block: one column each.
    const int t = threadIdx.y * 32 + threadIdx.x;
    const int col = blockIdx.x * 256 + t;
    if (col < c) {
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) sum += part[k][t];
        atomicAdd(&out[col], sum);
    }
}

// The launcher picks the smallest instantiated CH ≥ ceil(d / 256) (d ≤ 4096).
// One entry point per row width (CH chunks of 256 columns), each with its own register
// budget: up to d = 768 four 256-thread blocks of the forward fit on an SM, and three of
// the backward's dx pass (the launcher's grids assume these).
#define COCKPIT_NORM_V8(CH, FWD_MINB, BWD_MINB)                                                \
    extern "C" __global__ void __launch_bounds__(256, BWD_MINB) norm_bwd_dx_v8_bf16_##CH(       \
        const bf16_t* x, const bf16_t* w, const bf16_t* dy, bf16_t* dx, const float2* stats,    \
        int n, int d, float eps, int add, int rms, int ldg) {                                   \
        norm_bwd_dx_v8<CH>(x, w, dy, dx, stats, n, d, eps, add, rms, ldg);                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, FWD_MINB) residual_norm_v8_bf16_##CH(     \
        const bf16_t* x, const bf16_t* y, const bf16_t* bias, bf16_t* res, const bf16_t* w,     \
        const bf16_t* b, bf16_t* out, float2* stats, int n, int d, float eps, int rms,          \
        const unsigned long long* seed, uint32_t site, uint32_t thr, float dscale, int ldo) {   \
        residual_norm_v8<CH>(x, y, bias, res, w, b, out, stats, n, d, eps, rms, seed, site, thr, \
                             dscale, ldo);                                                      \
    }
COCKPIT_NORM_V8(1, 4, 3)
COCKPIT_NORM_V8(2, 4, 3)
COCKPIT_NORM_V8(3, 4, 3)
COCKPIT_NORM_V8(4, 2, 2)
// Wider rows (d up to 4096: Llama 1B–8B, Qwen 1.5B–7B widths), a warp per row still.
COCKPIT_NORM_V8(6, 2, 2)
COCKPIT_NORM_V8(8, 2, 2)
COCKPIT_NORM_V8(10, 2, 1)
COCKPIT_NORM_V8(12, 2, 1)
COCKPIT_NORM_V8(14, 2, 1)
COCKPIT_NORM_V8(16, 2, 1)

// Cross-entropy over padded logits [n, ld] (the first v columns are the vocabulary; ld a
// multiple of 8 and rows 16-byte aligned), forward and backward in one pass per row:
// acc[r] += logsumexp(x[r, :v]) − x[r, t[r]] (a per-row running sum over the micro-batches of
// one step, read back once), then in place x[r, j] = g·(softmax(x[r])_j − [j = t[r]]).
// One block per row, 16-byte loads and stores.

// The running (max, Σexp) of a thread's logits, over 8 more.
__device__ __forceinline__ void lse_acc8(uint4 u, float& m, float& s) {
    Bf8 b;
    b.u = u;
    float z[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(b.h[i]);
        z[2 * i] = f.x;
        z[2 * i + 1] = f.y;
    }
    float cm = z[0];
#pragma unroll
    for (int i = 1; i < 8; i++) cm = fmaxf(cm, z[i]);
    const float mm = fmaxf(m, cm);
    float cs = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) cs += __expf(z[i] - mm);
    s = s * __expf(m - mm) + cs;
    m = mm;
}

// g·(softmax − onehot) of 8 logits starting at column j0, given the row's log-sum-exp l.
__device__ __forceinline__ uint4 ce_grad8(uint4 u, int j0, float l, float g, uint32_t tg) {
    Bf8 b;
    b.u = u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(b.h[i]);
        const int j = j0 + 2 * i;
        const float p0 = g * (__expf(f.x - l) - (j == (int)tg ? 1.f : 0.f));
        const float p1 = g * (__expf(f.y - l) - (j + 1 == (int)tg ? 1.f : 0.f));
        b.h[i] = __floats2bfloat162_rn(p0, p1);
    }
    return b.u;
}

// The columns past the last full 8 (v not a multiple of 8): running (max, Σexp).
__device__ __forceinline__ void lse_tail(const bf16_t* xr, int v, float& m, float& s) {
    for (int j = ((v >> 3) << 3) + threadIdx.x; j < v; j += blockDim.x) {
        const float z = to_f(xr[j]);
        const float mm = fmaxf(m, z);
        s = s * __expf(m - mm) + __expf(z - mm);
        m = mm;
    }
}

// The target's logit (thread 0; read before block_lse, whose barriers order it before
// any gradient write).
__device__ __forceinline__ float ce_target(const bf16_t* xr, uint32_t tg, int v) {
    return threadIdx.x == 0 && tg < (uint32_t)v ? to_f(xr[tg]) : 0.f;
}

// The row's loss into acc (zt: the target's logit), and the tail columns' gradient.
__device__ __forceinline__ void ce_finish(bf16_t* xr, float* acc, int row, float l, float zt,
                                          float g, uint32_t tg, int v) {
    if (threadIdx.x == 0) acc[row] += tg < (uint32_t)v ? l - zt : __int_as_float(0x7fc00000);
    for (int j = ((v >> 3) << 3) + threadIdx.x; j < v; j += blockDim.x) {
        const float p = __expf(to_f(xr[j]) - l);
        xr[j] = __float2bfloat16(g * (p - (j == (int)tg ? 1.f : 0.f)));
    }
}

// Any vocabulary: the row is read twice (the second time mostly from L2).
extern "C" __global__ void ce_fused_bf16(bf16_t* __restrict__ x, const uint32_t* __restrict__ t,
                                         float* __restrict__ acc, float g, int n, int v, int ld) {
    const int row = blockIdx.x;
    if (row >= n) return;
    bf16_t* xr = x + (size_t)row * ld;
    uint4* xv = reinterpret_cast<uint4*>(xr);
    const int v8 = v >> 3;
    float m = -INFINITY, s = 0.f;
    for (int q = threadIdx.x; q < v8; q += blockDim.x) lse_acc8(xv[q], m, s);
    lse_tail(xr, v, m, s);
    const uint32_t tg = t[row];
    const float zt = ce_target(xr, tg, v);
    const float l = block_lse(m, s);
    for (int q = threadIdx.x; q < v8; q += blockDim.x) xv[q] = ce_grad8(xv[q], q * 8, l, g, tg);
    ce_finish(xr, acc, row, l, zt, g, tg, v);
}

// Vocabularies up to 512·CE_REG·8 = 53248 columns (GPT-2's 50257, Llama's 32000): the row
// is read once, into registers (every load in flight at once), and written once; one
// 512-thread block per multiprocessor at a time.
#define CE_REG 13
extern "C" __global__ void __launch_bounds__(512, 1)
    ce_fused_reg_bf16(bf16_t* __restrict__ x, const uint32_t* __restrict__ t,
                      float* __restrict__ acc, float g, int n, int v, int ld) {
    const int row = blockIdx.x;
    if (row >= n) return;
    bf16_t* xr = x + (size_t)row * ld;
    uint4* xv = reinterpret_cast<uint4*>(xr);
    const int v8 = v >> 3;
    uint4 r[CE_REG];
#pragma unroll
    for (int k = 0; k < CE_REG; k++) {
        const int q = threadIdx.x + k * 512;
        if (q < v8) r[k] = xv[q];
    }
    float m = -INFINITY, s = 0.f;
#pragma unroll
    for (int k = 0; k < CE_REG; k++)
        if (threadIdx.x + k * 512 < v8) lse_acc8(r[k], m, s);
    lse_tail(xr, v, m, s);
    const uint32_t tg = t[row];
    const float zt = ce_target(xr, tg, v);
    const float l = block_lse(m, s);
#pragma unroll
    for (int k = 0; k < CE_REG; k++) {
        const int q = threadIdx.x + k * 512;
        if (q < v8) xv[q] = ce_grad8(r[k], q * 8, l, g, tg);
    }
    ce_finish(xr, acc, row, l, zt, g, tg, v);
}

// Vectorised bias epilogues over x [rows, c] with c a multiple of 8 (16-byte accesses):
// y = x + b, y = gelu(x + b), and dx = dy·gelu'(x + b) (dx may alias dy, y may alias x).
__device__ __forceinline__ float gelu_f(float u) {
    return 0.5f * u * (1.f + tanhf(GELU_K0 * (u + GELU_K1 * u * u * u)));
}
__device__ __forceinline__ float gelu_grad_f(float u) {
    const float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
    return 0.5f * (1.f + th) + 0.5f * u * (1.f - th * th) * GELU_K0 * (1.f + 3.f * GELU_K1 * u * u);
}

// mode 0: bias add, 1: bias + GELU (b may be null: no bias)
extern "C" __global__ void bias_act_v8_bf16(const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ b, bf16_t* y,
                                            size_t total8, int c8, int mode) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* bv = reinterpret_cast<const uint4*>(b);
    uint4* yv = reinterpret_cast<uint4*>(y);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        Bf8 xa, ba, out;
        xa.u = xv[q];
        ba.u = bv != nullptr ? bv[q % c8] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(xa.h[i]);
            const float2 fb = __bfloat1622float2(ba.h[i]);
            float u0 = f.x + fb.x, u1 = f.y + fb.y;
            if (mode == 1) {
                u0 = gelu_f(u0);
                u1 = gelu_f(u1);
            }
            out.h[i] = __floats2bfloat162_rn(u0, u1);
        }
        yv[q] = out.u;
    }
}

extern "C" __global__ void bias_gelu_bwd_v8_bf16(const bf16_t* __restrict__ x,
                                                 const bf16_t* __restrict__ b, const bf16_t* dy,
                                                 bf16_t* dx, size_t total8, int c8) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* bv = reinterpret_cast<const uint4*>(b);
    const uint4* dyv = reinterpret_cast<const uint4*>(dy);
    uint4* dxv = reinterpret_cast<uint4*>(dx);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        Bf8 xa, ba, ga, out;
        xa.u = xv[q];
        ba.u = bv != nullptr ? bv[q % c8] : make_uint4(0, 0, 0, 0);
        ga.u = dyv[q];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(xa.h[i]);
            const float2 fb = __bfloat1622float2(ba.h[i]);
            const float2 fg = __bfloat1622float2(ga.h[i]);
            out.h[i] = __floats2bfloat162_rn(fg.x * gelu_grad_f(f.x + fb.x),
                                             fg.y * gelu_grad_f(f.y + fb.y));
        }
        dxv[q] = out.u;
    }
}

// RoPE in place on the q and k heads of packed projections [B·T, ld]: the first `nh` heads of
// each row (q's H heads, then k's KV heads, adjacent), row bt at position bt mod t; the two
// halves of each head rotated by pos·inv_freq[j] (the Llama/NeoX layout, as the model's
// tables, with any rope scaling already applied); dir = −1 rotates back (the backward). The
// rotations come from cs [t][hd/2] = (cos, sin) of pos·inv_freq[j], computed in double on the
// host (fast-math sines lose accuracy at arguments of hundreds of radians) and read from L2.
// Four pairs a thread (8-byte accesses) where hd/2 is a multiple of 4, else one.
extern "C" __global__ void rope_qkv_bf16(bf16_t* __restrict__ x, int nbt, int t, int nh, int hd,
                                         int ld, const float2* __restrict__ cs, float dir) {
    const int half = hd >> 1;
    const int w = (half & 3) == 0 ? 4 : 1;
    const int per = half / w;
    const size_t total = (size_t)nbt * nh * per;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int j = (int)(i % per) * w;
        const size_t row = i / per;  // (bt, head)
        const int hh = (int)(row % nh);
        const size_t bt = row / nh;
        const float2* r = cs + (size_t)(bt % t) * half + j;
        bf16_t* xr = x + bt * ld + (size_t)hh * hd + j;
        if (w == 4) {
            uint2 a = *reinterpret_cast<const uint2*>(xr);
            uint2 b = *reinterpret_cast<const uint2*>(xr + half);
            bf16_t* pa = reinterpret_cast<bf16_t*>(&a);
            bf16_t* pb = reinterpret_cast<bf16_t*>(&b);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 q = r[k];
                const float x1 = to_f(pa[k]), x2 = to_f(pb[k]), sn = dir * q.y;
                pa[k] = __float2bfloat16(x1 * q.x - x2 * sn);
                pb[k] = __float2bfloat16(x2 * q.x + x1 * sn);
            }
            *reinterpret_cast<uint2*>(xr) = a;
            *reinterpret_cast<uint2*>(xr + half) = b;
        } else {
            const float2 q = r[0];
            const float x1 = to_f(xr[0]), x2 = to_f(xr[half]), sn = dir * q.y;
            xr[0] = __float2bfloat16(x1 * q.x - x2 * sn);
            xr[half] = __float2bfloat16(x2 * q.x + x1 * sn);
        }
    }
}

// y = dropout(x), or y += dropout(x) with acc, over bf16 [n, d] (rows layout; d a multiple of
// 8; y may be x; x's and y's rows ldx8·8 and ldy8·8 apart): the embedding's dropout, in the backward the masked copies of the residual
// gradient, LoRA dropout (acc: the adapters' data gradient through their input's mask), and
// with thr = 0 a plain scale (Granite's multipliers).
extern "C" __global__ void dropout_rows_v8_bf16(const bf16_t* x, bf16_t* y, size_t total8, int d8,
                                                const unsigned long long* __restrict__ seed,
                                                uint32_t site, uint32_t thr, float dscale,
                                                int acc, int ldx8, int ldy8) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* yv = reinterpret_cast<uint4*>(y);
    const unsigned long long sd = *seed;
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / d8, col8 = q % d8;
        const size_t qy = row * ldy8 + col8;
        const uint32_t keep = drop_bits8(sd, site, row, (uint32_t)col8, thr);
        Bf8 a, b, o;
        a.u = xv[row * ldx8 + col8];
        b.u = acc ? yv[qy] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(a.h[i]), g = __bfloat1622float2(b.h[i]);
            o.h[i] = __floats2bfloat162_rn(g.x + ((keep >> (2 * i)) & 1 ? f.x * dscale : 0.f),
                                           g.y + ((keep >> (2 * i + 1)) & 1 ? f.y * dscale : 0.f));
        }
        yv[qy] = o.u;
    }
}

// SwiGLU over packed gate|up projections gu [n, 2·hid] (gate columns first): h = silu(g)·u,
// [n, hid]; hid a multiple of 8 (16-byte accesses). The backward writes dgu [n, 2·hid]:
// dg = dh·u·σ(g)·(1 + g·(1 − σ(g))), du = dh·silu(g).
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }
extern "C" __global__ void swiglu_fwd_v8_bf16(const bf16_t* __restrict__ gu, bf16_t* __restrict__ h,
                                              size_t total8, int hid8) {
    const uint4* gv = reinterpret_cast<const uint4*>(gu);
    uint4* hv = reinterpret_cast<uint4*>(h);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / hid8, col = q % hid8;
        Bf8 g, u, out;
        g.u = gv[row * 2 * hid8 + col];
        u.u = gv[row * 2 * hid8 + hid8 + col];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 fg = __bfloat1622float2(g.h[i]), fu = __bfloat1622float2(u.h[i]);
            // silu rounded to bf16 first, as the per-op model computes silu(g) then the product
            const float s0 = __bfloat162float(__float2bfloat16(fg.x * sigmoid_f(fg.x)));
            const float s1 = __bfloat162float(__float2bfloat16(fg.y * sigmoid_f(fg.y)));
            out.h[i] = __floats2bfloat162_rn(s0 * fu.x, s1 * fu.y);
        }
        hv[q] = out.u;
    }
}
extern "C" __global__ void swiglu_bwd_v8_bf16(const bf16_t* __restrict__ gu,
                                              const bf16_t* __restrict__ dh,
                                              bf16_t* __restrict__ dgu, size_t total8, int hid8) {
    const uint4* gv = reinterpret_cast<const uint4*>(gu);
    const uint4* dv = reinterpret_cast<const uint4*>(dh);
    uint4* ov = reinterpret_cast<uint4*>(dgu);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / hid8, col = q % hid8;
        Bf8 g, u, d, og, ou;
        g.u = gv[row * 2 * hid8 + col];
        u.u = gv[row * 2 * hid8 + hid8 + col];
        d.u = dv[q];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 fg = __bfloat1622float2(g.h[i]), fu = __bfloat1622float2(u.h[i]);
            const float2 fd = __bfloat1622float2(d.h[i]);
            const float sg0 = sigmoid_f(fg.x), sg1 = sigmoid_f(fg.y);
            og.h[i] = __floats2bfloat162_rn(fd.x * fu.x * sg0 * (1.f + fg.x * (1.f - sg0)),
                                            fd.y * fu.y * sg1 * (1.f + fg.y * (1.f - sg1)));
            ou.h[i] = __floats2bfloat162_rn(fd.x * fg.x * sg0, fd.y * fg.y * sg1);
        }
        ov[row * 2 * hid8 + col] = og.u;
        ov[row * 2 * hid8 + hid8 + col] = ou.u;
    }
}

// src[b, t, off + h·hd + d] of a [B, T, ld] buffer → dst [B, H, T, hd] (heads_merge's inverse).
extern "C" __global__ void heads_split_bf16(const bf16_t* __restrict__ src,
                                            bf16_t* __restrict__ dst, int b, int t, int h,
                                            int hd, int ld, int off) {
    const size_t total = (size_t)b * h * t * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[heads_offset(i, t, h, hd, ld, off)];
}

// ---------------------------------------------------------------------------------------------
// NF4 (4-bit NormalFloat, QLoRA's data type) for a frozen LoRA base; src/engine/nf4.rs holds the
// host reference of the same arithmetic. A weight of n elements (row-major, n % 64 == 0):
//   codes  u8 [n/2]     element 2i in the low nibble of byte i, 2i+1 in the high one
//   absq   u8 [n/64]    each 64-element block's absmax, quantized per group of 256 blocks
//   gscale f32 [ceil(n/64/256)]   absmax = absq · gscale (absq rounded up: |w| / absmax <= 1)
// w ≈ NF4[code] · absmax of its block.
__constant__ float NF4_VALUES[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// The code nearest to x in [-1, 1] (ties to the lower code), by the midpoints of the table.
__device__ __forceinline__ uint32_t nf4_code(float x) {
    uint32_t c = 0;
#pragma unroll
    for (int i = 0; i < 15; ++i) c += x > 0.5f * (NF4_VALUES[i] + NF4_VALUES[i + 1]) ? 1u : 0u;
    return c;
}

// 1. Each 64-element block's absmax (fp32 scratch [n/64]): one warp per block, 2 elements a lane.
extern "C" __global__ void nf4_absmax_bf16(const bf16_t* __restrict__ w, float* __restrict__ amax,
                                           long long blocks) {
    const long long blk = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (blk >= blocks) return;
    const __nv_bfloat162 v = reinterpret_cast<const __nv_bfloat162*>(w + blk * 64)[lane];
    const float2 f = __bfloat1622float2(v);
    const float m = warp_max(fmaxf(fabsf(f.x), fabsf(f.y)));
    if (lane == 0) amax[blk] = m;
}

// 2. Per group of 256 blocks: gscale = max absmax / 255, absq = ceil(absmax / gscale). One warp
// per group.
extern "C" __global__ void nf4_group_f32(const float* __restrict__ amax, uint8_t* __restrict__ absq,
                                         float* __restrict__ gscale, long long blocks) {
    const long long grp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const long long b0 = grp * 256;
    if (b0 >= blocks) return;
    float m = 0.f;
    for (int i = lane; i < 256; i += 32)
        if (b0 + i < blocks) m = fmaxf(m, amax[b0 + i]);
    m = warp_max(m);
    const float sc = m / 255.f;
    if (lane == 0) gscale[grp] = sc;
    for (int i = lane; i < 256; i += 32)
        if (b0 + i < blocks) {
            const float q = sc > 0.f ? ceilf(amax[b0 + i] / sc) : 0.f;
            absq[b0 + i] = (uint8_t)fminf(q, 255.f);
        }
}

// 3. The codes: one thread per 8 elements (4 code bytes).
extern "C" __global__ void nf4_codes_bf16(const bf16_t* __restrict__ w,
                                          const uint8_t* __restrict__ absq,
                                          const float* __restrict__ gscale,
                                          uint32_t* __restrict__ codes, long long n8) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const long long blk = i >> 3;
    const float am = (float)absq[blk] * gscale[blk >> 8];
    const float inv = am > 0.f ? 1.f / am : 0.f;
    const uint4 raw = reinterpret_cast<const uint4*>(w)[i];
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
    uint32_t out = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(p[k]);
        const uint32_t lo = nf4_code(fminf(fmaxf(f.x * inv, -1.f), 1.f));
        const uint32_t hi = nf4_code(fminf(fmaxf(f.y * inv, -1.f), 1.f));
        out |= (lo | (hi << 4)) << (8 * k);
    }
    codes[i] = out;
}

// Dequantize to bf16: one thread per 8 elements (4 code bytes -> one 16-byte store).
extern "C" __global__ void nf4_dequant_bf16(const uint32_t* __restrict__ codes,
                                            const uint8_t* __restrict__ absq,
                                            const float* __restrict__ gscale,
                                            bf16_t* __restrict__ out, long long n8) {
    // The table in shared memory: lanes index it with different codes (the constant cache
    // would serialise them).
    __shared__ float tab[16];
    if (threadIdx.x < 16) tab[threadIdx.x] = NF4_VALUES[threadIdx.x];
    __syncthreads();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const long long blk = i >> 3;
    const float am = (float)__ldg(absq + blk) * __ldg(gscale + (blk >> 8));
    const uint32_t c = __ldg(codes + i);
    uint4 raw;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint32_t byte = (c >> (8 * k)) & 0xffu;
        p[k] = __floats2bfloat162_rn(tab[byte & 15u] * am, tab[byte >> 4] * am);
    }
    reinterpret_cast<uint4*>(out)[i] = raw;
}

// Causal flash attention (head dims 64 and 128) for the whole-model step.
#include "flash.cu"
// Its backward's main kernel with Hopper's warpgroup products (compute_90a builds only).
#include "flash_sm90.cu"
