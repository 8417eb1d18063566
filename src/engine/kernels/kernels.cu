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
#include "step/dropout.cuh"
#include "step/swiglu.cuh"

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
// NF4 (4-bit NormalFloat, QLoRA's data type) for a frozen LoRA base; src/engine/kernels/nf4.rs holds the
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
