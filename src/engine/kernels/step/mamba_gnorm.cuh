// The Mamba-2 mixer's gated RMSNorm — y·silu(z), normalised over each group of columns, times w
// — and its backward. Part of mamba.cuh's family, launched by mamba.rs; included by
// ../kernels.cu after mamba.cuh.
#pragma once

// The gated RMSNorm: per row and group of gw = inner / groups columns, v = y·silu(z),
// out = v / rms(v)·w; 1/rms kept in rstd [N, groups]. A block (256 threads) per row. Where the
// widths and strides allow (mb_gn_vec), a thread reads 16 bytes at a time, up to MB_GN_V of
// them a group, and keeps v in registers between the sum and the output.
#define MB_GN_V 4
__device__ __forceinline__ bool mb_gn_vec(int inner, int gw, int ld) {
    return gw % 8 == 0 && ld % 8 == 0 && inner % 8 == 0 && gw / 8 <= MB_GN_V * (int)blockDim.x;
}
__device__ __forceinline__ void mb_ld8(const bf16_t* p, float v[8]) {
    mb_unpack(*reinterpret_cast<const uint4*>(p), v, static_cast<const bf16_t*>(nullptr));
}
__device__ __forceinline__ void mb_st8(bf16_t* p, const float v[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(mb_pack2(v[0], v[1]), mb_pack2(v[2], v[3]),
                                              mb_pack2(v[4], v[5]), mb_pack2(v[6], v[7]));
}
extern "C" __global__ void __launch_bounds__(256)
    mamba_gnorm_fwd_bf16(const bf16_t* __restrict__ y, const bf16_t* __restrict__ zx, int ld,
                         const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                         float* __restrict__ rstd, int n, int inner, int groups, float eps) {
    __shared__ float red[32];
    const int gw = inner / groups;
    const bool vec = mb_gn_vec(inner, gw, ld);
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        for (int g = 0; g < groups; ++g) {
            float ss = 0.f;
            if (vec) {
                float v[MB_GN_V][8];
#pragma unroll
                for (int q = 0; q < MB_GN_V; ++q) {
                    const int j = g * gw + 8 * (threadIdx.x + q * blockDim.x);
                    if (j < (g + 1) * gw) {
                        float yv[8], zv[8];
                        mb_ld8(y + (size_t)r * inner + j, yv);
                        mb_ld8(zx + (size_t)r * ld + j, zv);
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            v[q][e] = yv[e] * silu_f(zv[e]);
                            ss += v[q][e] * v[q][e];
                        }
                    }
                }
                const float rs = rsqrtf(qkw_block_sum(ss, red) / gw + eps);
                if (threadIdx.x == 0) rstd[(size_t)r * groups + g] = rs;
#pragma unroll
                for (int q = 0; q < MB_GN_V; ++q) {
                    const int j = g * gw + 8 * (threadIdx.x + q * blockDim.x);
                    if (j < (g + 1) * gw) {
                        float wv[8];
                        mb_ld8(w + j, wv);
#pragma unroll
                        for (int e = 0; e < 8; ++e) wv[e] *= v[q][e] * rs;
                        mb_st8(out + (size_t)r * inner + j, wv);
                    }
                }
                continue;
            }
            for (int j = g * gw + threadIdx.x; j < (g + 1) * gw; j += blockDim.x) {
                const float v = to_f(y[(size_t)r * inner + j]) * silu_f(to_f(zx[(size_t)r * ld + j]));
                ss += v * v;
            }
            const float rs = rsqrtf(qkw_block_sum(ss, red) / gw + eps);
            if (threadIdx.x == 0) rstd[(size_t)r * groups + g] = rs;
            for (int j = g * gw + threadIdx.x; j < (g + 1) * gw; j += blockDim.x) {
                const float v = to_f(y[(size_t)r * inner + j]) * silu_f(to_f(zx[(size_t)r * ld + j]));
                out[(size_t)r * inner + j] = from_f<bf16_t>(v * rs * to_f(w[j]));
            }
        }
    }
}

// The gated RMSNorm's backward from d out (`dout` [N, inner]): dy ([N, inner], in the 16-bit
// type the scan's backward tiles round it to), dz into dzx's first inner columns (row stride
// ld), and the weight's gradient (+=, where dw is not null). A block per MB_GN_ROWS rows, the
// weight's gradient summed over them first: in each thread's registers on the 16-byte path
// (one group, mb_gn_vec: a thread's columns are the same in every row), else in shared memory.
#define MB_GN_ROWS 8  // (32 left most SMs a block or two: 2048 rows gave 256 blocks)
// Two block-wide sums at once (qkw_block_sum's two barriers for both).
__device__ __forceinline__ float2 mb_block_sum2(float a, float b, float2* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();  // (red reused across calls)
    if (lane == 0) red[warp] = make_float2(a, b);
    __syncthreads();
    float2 t = make_float2(0.f, 0.f);
    for (int i = 0; i < nw; ++i) t.x += red[i].x, t.y += red[i].y;
    return t;
}
// The 16-byte path where a thread takes Q pieces of 8 columns a row: RP rows at a time, their
// loads issued before the first sum, one pair of barriers for the RP rows' sums; where KEEP
// their 16-bit values stay in registers for the outputs (else read again: four pieces a
// thread spilled); the weight's gradient only where it trains (GRADS). Not inlined: each of
// the six builds gets its registers of its own (inlined into one kernel they spilled 52 bytes).
template <bool KEEP>
__device__ __forceinline__ uint4 mb_gn_raw(const uint4& kept, const bf16_t* p) {
    return KEEP ? kept : *reinterpret_cast<const uint4*>(p);
}
template <int Q, int RP, bool GRADS, bool KEEP>
__device__ __noinline__ void mb_gnorm_bwd_vec(const bf16_t* __restrict__ y,
                                              const bf16_t* __restrict__ zx, int ld,
                                              const bf16_t* __restrict__ w,
                                              const float* __restrict__ rstd,
                                              const bf16_t* __restrict__ dout,
                                              mb_t* __restrict__ dy, bf16_t* __restrict__ dzx,
                                              float* __restrict__ dw, int r_end, int inner,
                                              float2* red) {
    float dwr[Q][8];
    uint4 wq[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        const int j = 8 * (threadIdx.x + q * blockDim.x);
#pragma unroll
        for (int e = 0; e < 8; ++e) dwr[q][e] = 0.f;
        if (KEEP)
            wq[q] = j < inner ? *reinterpret_cast<const uint4*>(w + j) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int r = blockIdx.x * MB_GN_ROWS; r < r_end; r += RP) {
        uint4 yq[RP][Q], zq[RP][Q], dq[RP][Q];
        float rs[RP], dot[2] = {0.f, 0.f};
        // row rr's (the h-th of the pass) piece q, columns j .. j + 7, of y, z, d out and w as f32
        auto unpack = [&](int h, int q, size_t rr, int j, float(&yv)[8], float(&zv)[8],
                          float(&dv)[8], float(&wv)[8]) {
            const bf16_t* f16 = nullptr;  // (mb_unpack's overload of 16-bit values)
            mb_unpack(mb_gn_raw<KEEP>(yq[h][q], y + rr * inner + j), yv, f16);
            mb_unpack(mb_gn_raw<KEEP>(zq[h][q], zx + rr * ld + j), zv, f16);
            mb_unpack(mb_gn_raw<KEEP>(dq[h][q], dout + rr * inner + j), dv, f16);
            mb_unpack(mb_gn_raw<KEEP>(wq[q], w + j), wv, f16);
        };
#pragma unroll
        for (int h = 0; h < RP; ++h) {
            const int rr = min(r + h, r_end - 1);  // (an odd last row is read twice, kept once)
            rs[h] = rstd[rr];
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const int j = 8 * (threadIdx.x + q * blockDim.x);
                if (KEEP && j < inner) {
                    yq[h][q] = *reinterpret_cast<const uint4*>(y + (size_t)rr * inner + j);
                    zq[h][q] = *reinterpret_cast<const uint4*>(zx + (size_t)rr * ld + j);
                    dq[h][q] = *reinterpret_cast<const uint4*>(dout + (size_t)rr * inner + j);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < RP; ++h) {
            const bool keep = r + h < r_end;
            const size_t rr = min(r + h, r_end - 1);
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const int j = 8 * (threadIdx.x + q * blockDim.x);
                if (j < inner) {
                    float yv[8], zv[8], dv[8], wv[8];
                    unpack(h, q, rr, j, yv, zv, dv, wv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float v = yv[e] * silu_f(zv[e]) * rs[h];
                        dot[h] += dv[e] * wv[e] * v;
                        if (GRADS && keep) dwr[q][e] += dv[e] * v;
                    }
                }
            }
        }
        const float2 sums = mb_block_sum2(dot[0], dot[1], red);
        dot[0] = sums.x / inner;
        dot[1] = sums.y / inner;
#pragma unroll
        for (int h = 0; h < RP; ++h) {
            if (r + h >= r_end) break;
            const size_t rr = r + h;
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const int j = 8 * (threadIdx.x + q * blockDim.x);
                if (j < inner) {
                    float yv[8], zv[8], dv[8], wv[8], gy[8], gz[8];
                    unpack(h, q, rr, j, yv, zv, dv, wv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float sz = silu_f(zv[e]);
                        const float g = rs[h] * (dv[e] * wv[e] - yv[e] * sz * rs[h] * dot[h]);
                        gy[e] = g * sz;
                        gz[e] = g * yv[e] * dsilu_f(zv[e]);
                    }
                    mb_st8(dy + rr * inner + j, gy);
                    mb_st8(dzx + rr * ld + j, gz);
                }
            }
        }
    }
    if (GRADS)
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int j = 8 * (threadIdx.x + q * blockDim.x);
            if (j < inner)
#pragma unroll
                for (int e = 0; e < 8; ++e) atomicAdd(&dw[j + e], dwr[q][e]);
        }
}
extern "C" __global__ void __launch_bounds__(256, 3)
    mamba_gnorm_bwd_bf16(const bf16_t* __restrict__ y, const bf16_t* __restrict__ zx, int ld,
                         const bf16_t* __restrict__ w, const float* __restrict__ rstd,
                         const bf16_t* __restrict__ dout, mb_t* __restrict__ dy,
                         bf16_t* __restrict__ dzx, float* __restrict__ dw, int n, int inner,
                         int groups) {
    extern __shared__ float mb_smem[];
    float* dws = mb_smem;  // [inner]
    __shared__ float2 red[32];
    const int gw = inner / groups;
    const int r_end = min(n, (int)(blockIdx.x + 1) * MB_GN_ROWS);
    if (groups == 1 && mb_gn_vec(inner, gw, ld)) {
        // (mb_gn_vec: at most MB_GN_V pieces a thread)
        const int q = (gw / 8 + blockDim.x - 1) / blockDim.x;
#define MB_GN_RUN(Q, RP, G, KEEP) \
    mb_gnorm_bwd_vec<Q, RP, G, KEEP>(y, zx, ld, w, rstd, dout, dy, dzx, dw, r_end, inner, red)
        if (dw != nullptr) {
            if (q == 1) MB_GN_RUN(1, 2, true, true);
            else if (q == 2) MB_GN_RUN(2, 1, true, true);
            else MB_GN_RUN(MB_GN_V, 1, true, false);
        } else {
            if (q == 1) MB_GN_RUN(1, 2, false, true);
            else if (q == 2) MB_GN_RUN(2, 1, false, true);
            else MB_GN_RUN(MB_GN_V, 1, false, false);
        }
#undef MB_GN_RUN
        return;
    }
    for (int j = threadIdx.x; j < inner; j += blockDim.x) dws[j] = 0.f;
    for (int r = blockIdx.x * MB_GN_ROWS; r < r_end; ++r) {
        for (int g = 0; g < groups; ++g) {
            const float rs = rstd[(size_t)r * groups + g];
            float dot = 0.f;
            for (int j = g * gw + threadIdx.x; j < (g + 1) * gw; j += blockDim.x) {
                const float z = to_f(zx[(size_t)r * ld + j]);
                const float v = to_f(y[(size_t)r * inner + j]) * silu_f(z) * rs;
                const float d = to_f(dout[(size_t)r * inner + j]);
                dot += d * to_f(w[j]) * v;
                dws[j] += d * v;
            }
            dot = qkw_block_sum(dot, reinterpret_cast<float*>(red)) / gw;
            for (int j = g * gw + threadIdx.x; j < (g + 1) * gw; j += blockDim.x) {
                const float z = to_f(zx[(size_t)r * ld + j]), yy = to_f(y[(size_t)r * inner + j]);
                const float v = yy * silu_f(z) * rs;
                const float d = to_f(dout[(size_t)r * inner + j]);
                const float dv = rs * (d * to_f(w[j]) - v * dot);
                dy[(size_t)r * inner + j] = from_f<mb_t>(dv * silu_f(z));
                dzx[(size_t)r * ld + j] = from_f<bf16_t>(dv * yy * dsilu_f(z));
            }
        }
    }
    __syncthreads();
    if (dw)
        for (int j = threadIdx.x; j < inner; j += blockDim.x) atomicAdd(&dw[j], dws[j]);
}
