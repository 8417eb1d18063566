// LayerNorm / RMSNorm of the whole-model step, fused with the residual add: the warp-per-row
// kernels, the row-in-registers ones per row width (and the column sum the bias gradients use,
// which sits between their backward and their instantiations).
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

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
    const float woff = norm_woff(rms);
    const bool ident = norm_ident(rms);
    rms &= 1;
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
    bf16_t* o = out + (size_t)row * ldo;
    if (ident) {
        for (int j = lane; j < d; j += 32) o[j] = src[j];
        return;
    }
    float mu, rstd;
    row_stats(src, d, eps, rms, lane, &mu, &rstd);
    for (int j = lane; j < d; j += 32)
        o[j] = __float2bfloat16((to_f(src[j]) - mu) * rstd * (to_f(w[j]) + woff) +
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
    const float woff = norm_woff(rms);
    const bool ident = norm_ident(rms);
    rms &= 1;
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
        if (ident) {
#pragma unroll
            for (int c = 0; c < CH; c++) {
                const int col0 = (lane + 32 * c) * 8;
                if (col0 < d) *reinterpret_cast<uint4*>(out + (size_t)row * ldo + col0) = r[c].u;
            }
            continue;
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
                    o.h[i] = __floats2bfloat162_rn((a.x - mu) * rstd * (g.x + woff) + f.x,
                                                   (a.y - mu) * rstd * (g.y + woff) + f.y);
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
    const float woff = norm_woff(rms);
    const bool ident = norm_ident(rms);
    rms &= 1;
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
        if (ident) {  // dx (+)= dy
            if (add && CH > 4) {
#pragma unroll
                for (int c = 0; c < CH; c++) {
                    const int col0 = (lane + 32 * c) * 8;
                    if (col0 < d) pa[c].u = *reinterpret_cast<const uint4*>(dx + (size_t)row * d + col0);
                }
            }
#pragma unroll
            for (int c = 0; c < CH; c++) {
                const int col0 = (lane + 32 * c) * 8;
                if (col0 < d) {
                    Bf8 out;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float2 gv = bf2f(ga[c], i), p = bf2f(pa[c], i);
                        out.h[i] = __floats2bfloat162_rn(p.x + gv.x, p.y + gv.y);
                    }
                    *reinterpret_cast<uint4*>(dx + (size_t)row * d + col0) = out.u;
                }
            }
            continue;
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
                const float g0 = gv.x * (wf.x + woff), g1 = gv.y * (wf.y + woff);
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
                    out.h[i] = __floats2bfloat162_rn(p.x + rstd * (gv.x * (wf.x + woff) - a - h0 * cc),
                                                     p.y + rstd * (gv.y * (wf.y + woff) - a - h1 * cc));
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
