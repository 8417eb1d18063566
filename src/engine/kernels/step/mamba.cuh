// The Mamba-2 mixer of a hybrid's Mamba layers (launched by mamba.rs): the depthwise causal
// conv1d + SiLU, dt's softplus and its cumulative sum × A per chunk, the selective scan by
// state-space duality in chunks of MB_L positions (a chunk's own outputs as masked, decayed
// C·Bᵀ products; the state carried between chunks in fp32), and the gated RMSNorm; forward and
// backward. Part of the whole-model step's kernels: included by ../kernels.cu after swiglu.cuh
// and qk_norm.cuh (sigmoid_f, qkw_block_sum).
//
// Layouts (rows r = b·T + t): the in_proj output zx [N, W] holds z (inner columns), x | B | C
// (conv columns: x heads·P, then B and C groups·S each) and dt (heads); xc [N, conv] the conv's
// output after SiLU; per (b, h) the f32 vectors dtv (dt after softplus and limits) and lam (its
// cumulative sum × A within each chunk) over Tp = chunks·MB_L positions ([B, H, Tp]); the
// states at the chunks' starts [B, H, chunks, P, S] in the 16-bit type (mb_t), which is what
// the chunk products read (their tiles round to it; the forward carries them in f32 from chunk
// to chunk). Head h reads group h / (H / G) of B and C. Positions past T (the last chunk's
// tail) have dt = 0 and x = B = C = 0: they change nothing.
//
// The chunk kernels run one block of 256 threads per (chunk, head, batch row) over 64 × 64
// tiles of 16-bit values in shared memory (rows of MB_LDH = 72: ldmatrix reads them without
// bank conflicts), each thread a 4 × 4 piece of a tile's f32 product (mb_mm).
#pragma once

#define MB_L 64
// A tile's row stride in 16-bit elements: 144-byte rows, so the eight 16-byte rows an
// ldmatrix reads start four banks apart (no bank conflicts, transposed or not).
#define MB_LDH 72
#define MB_TILE_BYTES (64 * MB_LDH * 2)

// The chunk kernels' tiles hold the step's 16-bit type (bf16, or fp16 in the COCKPIT_F16
// build), as mamba_ssm's chunk kernels round their operands before the products; products
// accumulate in f32.
typedef bf16_t mb_t;
#ifdef COCKPIT_F16
#define MB_AB "f16"
#else
#define MB_AB "bf16"
#endif

__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_f(x); }
// d silu(x) / dx
__device__ __forceinline__ float dsilu_f(float x) {
    const float s = sigmoid_f(x);
    return s * (1.f + x * (1.f - s));
}
__device__ __forceinline__ float softplus_f(float x) {
    return fmaxf(x, 0.f) + log1pf(__expf(-fabsf(x)));
}

// The chunk kernels' 64 × 64 tile products. Each of the 256 threads holds 16 accumulators
// acc[a][c] of the output tile, at row mb_row(a, c) and column mb_col(a, c):
// - on sm_80 and newer, tensor cores (mma.sync m16n8k16 on 16-bit operands loaded by
//   ldmatrix, f32 accumulation): warp w owns rows 16·(w % 4).. and columns 32·(w / 4)..;
//   acc[a][c] is n8 tile a, element c of mma's accumulator layout;
// - elsewhere (the compute_75 build) f32 FMAs: thread (tx, ty) = (thread % 16, thread / 16) owns
//   rows ty + 16a and columns tx + 16c.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MB_TC 1
#else
#define MB_TC 0
#endif

__device__ __forceinline__ int mb_row(int a, int c) {
#if MB_TC
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    (void)a;
    return 16 * (w & 3) + (lane >> 2) + 8 * (c >> 1);
#else
    (void)c;
    return (threadIdx.x >> 4) + 16 * a;
#endif
}
__device__ __forceinline__ int mb_col(int a, int c) {
#if MB_TC
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    return 32 * (w >> 2) + 8 * a + 2 * (lane & 3) + (c & 1);
#else
    (void)a;
    return (threadIdx.x & 15) + 16 * c;
#endif
}

// Tile element (i, j) as f32, and its store.
__device__ __forceinline__ float mb_get(const mb_t* tile, int i, int j) {
    return to_f(tile[i * MB_LDH + j]);
}
__device__ __forceinline__ void mb_put(mb_t* tile, int i, int j, float v) {
    tile[i * MB_LDH + j] = from_f<mb_t>(v);
}

#if MB_TC
// Four 8 × 8 matrices of 16-bit values (this lane's row address `p`), transposed where T.
template <bool T>
__device__ __forceinline__ void mb_ldsm4(const mb_t* p, uint32_t r[4]) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    if (T)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
}
__device__ __forceinline__ void mb_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MB_AB "." MB_AB
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// acc[a][c] += Σ_k A(mb_row, k)·B(k, mb_col) over k < kn (a multiple of 16), both tiles of row
// stride MB_LDH: A(r, k) = a[r][k], or a[k][r] where AT (A stored transposed); B(k, c) =
// b[k][c], or b[c][k] where BT.
//
// On tensor cores a warp's k step of 16 is one ldmatrix.x4 of A (its 16 × 16 fragment:
// matrices rows 0–7 / 8–15 × k 0–7 / 8–15) and two of B (each two n8 tiles × k 0–7 / 8–15),
// `.trans` where the tile's rows run along k for B or across it for A, then four mma.
template <bool AT, bool BT>
__device__ __forceinline__ void mb_mm(float acc[4][4], const mb_t* a, const mb_t* b, int kn) {
#if MB_TC
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, j = l >> 3;
    const int r0 = 16 * (w & 3), c0 = 32 * (w >> 2);
    // this lane's row address of its matrix j at k = 0
    const mb_t* pa = AT ? a + ((l & 7) + 8 * (j >> 1)) * MB_LDH + r0 + 8 * (j & 1)
                        : a + (r0 + (l & 7) + 8 * (j & 1)) * MB_LDH + 8 * (j >> 1);
    const mb_t* pb = BT ? b + (c0 + (l & 7) + 8 * (j >> 1)) * MB_LDH + 8 * (j & 1)
                        : b + ((l & 7) + 8 * (j & 1)) * MB_LDH + c0 + 8 * (j >> 1);
    const int sa = AT ? 16 * MB_LDH : 16, sb = BT ? 16 : 16 * MB_LDH;
    const int nb = BT ? 16 * MB_LDH : 16;  // the second pair of n8 tiles, 16 columns on
    for (int k = 0; k < kn; k += 16, pa += sa, pb += sb) {
        uint32_t ar[4], b0[4], b1[4];
        mb_ldsm4<AT>(pa, ar);
        mb_ldsm4<!BT>(pb, b0);
        mb_ldsm4<!BT>(pb + nb, b1);
        mb_mma(acc[0], ar, b0[0], b0[1]);
        mb_mma(acc[1], ar, b0[2], b0[3]);
        mb_mma(acc[2], ar, b1[0], b1[1]);
        mb_mma(acc[3], ar, b1[2], b1[3]);
    }
#else
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    for (int k = 0; k < kn; ++k) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = AT ? mb_get(a, k, ty + 16 * i) : mb_get(a, ty + 16 * i, k);
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = BT ? mb_get(b, tx + 16 * j, k) : mb_get(b, k, tx + 16 * j);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
#endif
}

__device__ __forceinline__ void mb_zero(float acc[4][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
}

// sum[mb_row(a, c)] += v[a][c] over the tile (shared memory): on tensor cores each thread's
// two rows are summed first, then over the four lanes that share them (one atomic a row
// per four lanes instead of 16 a thread).
__device__ __forceinline__ void mb_row_sums(const float v[4][4], float* sum) {
#if MB_TC
    float r[2] = {0.f, 0.f};
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) r[c >> 1] += v[a][c];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        r[h] += __shfl_xor_sync(0xffffffffu, r[h], 1);
        r[h] += __shfl_xor_sync(0xffffffffu, r[h], 2);
    }
    if ((threadIdx.x & 3) == 0) {
        atomicAdd(&sum[mb_row(0, 0)], r[0]);
        atomicAdd(&sum[mb_row(0, 2)], r[1]);
    }
#else
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(&sum[mb_row(a, c)], v[a][c]);
#endif
}
// sum[mb_col(a, c)] += v[a][c]: as mb_row_sums, over the eight lanes that share a column.
__device__ __forceinline__ void mb_col_sums(const float v[4][4], float* sum) {
#if MB_TC
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float x = v[a][h] + v[a][h + 2];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if ((threadIdx.x & 31) < 4) atomicAdd(&sum[mb_col(a, h)], x);
        }
#else
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(&sum[mb_col(a, c)], v[a][c]);
#endif
}

// A tile's f32 values out to global memory at dst[mb_row·ld + mb_col] for rows < rows and
// columns < cols: stored (mb_store_tile) or added (mb_red_tile) there, each value times rs[its
// row] where rs is not null. On tensor cores a thread's values come in pairs of adjacent
// columns: stored as 8-byte pairs where the addresses allow; on sm_90 added as 16-byte vector
// reductions, lanes 2k and 2k + 1 trading halves so that each holds four columns of one row
// (a quarter of the atomics). Elsewhere one access per value. (The alignment test is the
// same for every thread of the block: the shuffles see whole warps.)
__device__ __forceinline__ float mb_rs(const float* rs, int i) { return rs ? rs[i] : 1.f; }
__device__ __forceinline__ void mb_store_tile(float* dst, size_t ld, const float v[4][4],
                                              int rows, int cols) {
#if MB_TC
    if (ld % 2 == 0 && cols % 2 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; c += 2) {
                const int i = mb_row(a, c), j = mb_col(a, c);
                if (i < rows && j < cols)
                    *reinterpret_cast<float2*>(dst + (size_t)i * ld + j) =
                        make_float2(v[a][c], v[a][c + 1]);
            }
        return;
    }
#endif
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int i = mb_row(a, c), j = mb_col(a, c);
            if (i < rows && j < cols) dst[(size_t)i * ld + j] = v[a][c];
        }
}
__device__ __forceinline__ void mb_red_tile(float* dst, size_t ld, const float v[4][4],
                                            int rows, int cols, const float* rs) {
#if MB_TC && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (ld % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        const bool odd = threadIdx.x & 1;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            // even lanes keep row mb_row(a, 0) and take the partner's two columns of it; odd
            // lanes keep row mb_row(a, 2), taking the partner's two columns before theirs
            const float s0 = __shfl_xor_sync(0xffffffffu, odd ? v[a][0] : v[a][2], 1);
            const float s1 = __shfl_xor_sync(0xffffffffu, odd ? v[a][1] : v[a][3], 1);
            const int c = odd ? 2 : 0, i = mb_row(a, c), j = mb_col(a, c) - (odd ? 2 : 0);
            if (i < rows && j < cols) {
                const float sc = mb_rs(rs, i);
                const float4 q = odd ? make_float4(s0, s1, v[a][2], v[a][3])
                                     : make_float4(v[a][0], v[a][1], s0, s1);
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                                 dst + (size_t)i * ld + j),
                             "f"(q.x * sc), "f"(q.y * sc), "f"(q.z * sc), "f"(q.w * sc)
                             : "memory");
            }
        }
        return;
    }
#endif
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int i = mb_row(a, c), j = mb_col(a, c);
            if (i < rows && j < cols) atomicAdd(&dst[(size_t)i * ld + j], v[a][c] * mb_rs(rs, i));
        }
}

// Eight 16-bit values or four f32 of one 16-byte load, as f32.
__device__ __forceinline__ void mb_unpack(uint4 u, float* v, const bf16_t*) {
    Bf8 q;
    q.u = u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(q.h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
}
__device__ __forceinline__ void mb_unpack(uint4 u, float* v, const float*) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
}

// Two f32 as two 16-bit values of one 32-bit word (the first in the low half).
__device__ __forceinline__ uint32_t mb_pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

// Row i, columns j.. of a tile from V values of one 16-byte load `u` of `src`'s type, times sc
// (16-bit values unscaled are copied as they are).
template <typename T>
__device__ __forceinline__ void mb_store16(mb_t* tile, int i, int j, uint4 u, float sc,
                                           bool scaled) {
    constexpr int V = 16 / sizeof(T);
    mb_t* dst = tile + i * MB_LDH + j;
    if constexpr (V == 8) {
        if (!scaled) {
            *reinterpret_cast<uint4*>(dst) = u;
            return;
        }
    }
    float v[V];
    mb_unpack(u, v, static_cast<const T*>(nullptr));
    if constexpr (V == 8)
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(mb_pack2(v[0] * sc, v[1] * sc), mb_pack2(v[2] * sc, v[3] * sc),
                       mb_pack2(v[4] * sc, v[5] * sc), mb_pack2(v[6] * sc, v[7] * sc));
    else
        *reinterpret_cast<uint2*>(dst) =
            make_uint2(mb_pack2(v[0] * sc, v[1] * sc), mb_pack2(v[2] * sc, v[3] * sc));
}

// tile[i][j] = src[(t0 + i)·ld + c0 + j]·(scale ? scale[i] : 1) for rows t0 + i < t_end and
// columns j < cols; 0 elsewhere (64 × 64, row stride MB_LDH, rounded to the 16-bit type).
// Whole rows of 16-byte aligned columns load 16 bytes a thread; with the chunk kernels' 256
// threads, each thread's loads are all issued before the first is stored (in flight
// together, not one memory latency each).
template <typename T>
__device__ __forceinline__ void mb_load(mb_t* tile, const T* src, size_t ld, int t0, int t_end,
                                        int c0, int cols, const float* scale) {
    constexpr int V = 16 / sizeof(T);
    if (cols == 64 && ld % V == 0 && c0 % V == 0 &&
        reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        if (blockDim.x == 256) {
            constexpr int PER = 64 * 64 / V / 256;
            uint4 u[PER];
#pragma unroll
            for (int q = 0; q < PER; ++q) {
                const int e = threadIdx.x + q * 256, i = e / (64 / V), j = (e % (64 / V)) * V;
                u[q] = t0 + i < t_end ? *reinterpret_cast<const uint4*>(
                                            src + (size_t)(t0 + i) * ld + c0 + j)
                                      : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int q = 0; q < PER; ++q) {
                const int e = threadIdx.x + q * 256, i = e / (64 / V), j = (e % (64 / V)) * V;
                // (zero bits: 0 in bf16, f16 and f32)
                mb_store16<T>(tile, i, j, u[q], scale ? scale[i] : 1.f, scale != nullptr);
            }
            return;
        }
        for (int e = threadIdx.x; e < 64 * 64 / V; e += blockDim.x) {
            const int i = e / (64 / V), j = (e % (64 / V)) * V;
            const uint4 u = t0 + i < t_end ? *reinterpret_cast<const uint4*>(
                                                 src + (size_t)(t0 + i) * ld + c0 + j)
                                           : make_uint4(0u, 0u, 0u, 0u);
            mb_store16<T>(tile, i, j, u, scale ? scale[i] : 1.f, scale != nullptr);
        }
        return;
    }
    for (int e = threadIdx.x; e < 64 * 64; e += blockDim.x) {
        const int i = e >> 6, j = e & 63;
        float v = 0.f;
        if (t0 + i < t_end && j < cols) {
            v = to_f(src[(size_t)(t0 + i) * ld + c0 + j]);
            if (scale) v *= scale[i];
        }
        mb_put(tile, i, j, v);
    }
}

// A state's rows p0.. (of p) and columns c0.. (cols of them; row stride s) as a tile.
template <typename T>
__device__ __forceinline__ void mb_load_state(mb_t* tile, const T* st, int p0, int p, int s,
                                              int c0, int cols) {
    mb_load(tile, st, (size_t)s, p0, p, c0, cols, nullptr);
}

// 16 bytes from global to shared memory: asynchronously on tensor-core builds (cp.async, zeros
// where !pred; done at the mb_cp_wait that follows the mb_cp_commit of its group), else a plain
// load and store (done on return).
__device__ __forceinline__ void mb_cp16(void* dst, const void* src, bool pred) {
#if MB_TC
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(pred ? 16 : 0)
                 : "memory");
#else
    *reinterpret_cast<uint4*>(dst) =
        pred ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}
__device__ __forceinline__ void mb_cp_commit() {
#if MB_TC
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void mb_cp_wait() {
#if MB_TC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// mb_load of a 16-bit source without a scale, as 16-byte mb_cp16 copies where whole chunks of 8
// fit (the shapes the step takes: heads and states of multiples of 8); else mb_load's
// synchronous path.
__device__ __forceinline__ void mb_load_async(mb_t* tile, const mb_t* src, size_t ld, int t0,
                                              int t_end, int c0, int cols) {
    if (cols % 8 == 0 && ld % 8 == 0 && c0 % 8 == 0 &&
        reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x) {
            const int i = e >> 3, j = (e & 7) * 8;
            const bool in = t0 + i < t_end && j < cols;
            mb_cp16(tile + i * MB_LDH + j, in ? src + (size_t)(t0 + i) * ld + c0 + j : src, in);
        }
        return;
    }
    mb_load(tile, src, ld, t0, t_end, c0, cols, nullptr);
}

// The chunk kernels' dynamic shared memory: n tiles, then f32 vectors.
__device__ __forceinline__ mb_t* mb_tile(unsigned char* smem, int i) {
    return reinterpret_cast<mb_t*>(smem + i * MB_TILE_BYTES);
}
__device__ __forceinline__ float* mb_vecs(unsigned char* smem, int tiles) {
    return reinterpret_cast<float*>(smem + tiles * MB_TILE_BYTES);
}

// The conv: xc[r, ch] = silu(cb[ch] + Σ_j w[ch, j]·zx[r − (K−1) + j, off + ch]) over the inputs
// of the same sequence (earlier ones are zeros). A thread per channel walks MB_CONV_ROWS rows
// with the last KW inputs in registers (each input loaded once); the weights are padded at the
// front to KW taps (K ≤ KW), so tap j reads the input KW − 1 − j rows back. Two builds of each
// kernel: KW = 4 (the published configs' d_conv 4: half the multiply-adds and registers of the
// general one) and KW = 8 (any K ≤ 8). Where the shapes and addresses allow (mamba.rs's
// conv_vec), the KW = 4 builds take a block's rows through shared memory instead
// (mamba_conv4s_fwd / mamba_conv4s_bwd, at the end of this file): a channel a thread reading 6
// bytes a row straight from memory has too few bytes in flight for its bandwidth.
#define MB_CONV_ROWS 128

// V consecutive 16-bit values (one access of 2V bytes) as f32, and back.
template <int V>
struct MbRaw;
template <>
struct MbRaw<1> {
    using T = unsigned short;
};
template <>
struct MbRaw<4> {
    using T = uint2;
};
template <int V>
__device__ __forceinline__ void mb_ldv(const bf16_t* p, float (&x)[V]) {
    union {
        typename MbRaw<V>::T u;
        bf16_t h[V];
    } q;
    q.u = *reinterpret_cast<const typename MbRaw<V>::T*>(p);
#pragma unroll
    for (int v = 0; v < V; ++v) x[v] = to_f(q.h[v]);
}
template <int V>
__device__ __forceinline__ void mb_stv(bf16_t* p, const float (&x)[V]) {
    union {
        typename MbRaw<V>::T u;
        bf16_t h[V];
    } q;
#pragma unroll
    for (int v = 0; v < V; ++v) q.h[v] = from_f<bf16_t>(x[v]);
    *reinterpret_cast<typename MbRaw<V>::T*>(p) = q.u;
}
// V consecutive f32 (16-byte accesses where V is a multiple of 4).
template <int V>
__device__ __forceinline__ void mb_ldv(const float* p, float (&x)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int v = 0; v < V; v += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + v);
            x[v] = f.x;
            x[v + 1] = f.y;
            x[v + 2] = f.z;
            x[v + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int v = 0; v < V; ++v) x[v] = p[v];
    }
}
template <int KW>
struct MbConvTaps {
    float w[KW];
    float bias;
};
template <int KW>
__device__ __forceinline__ MbConvTaps<KW> mb_conv_taps(const bf16_t* __restrict__ w,
                                                       const bf16_t* __restrict__ cb, int ch,
                                                       int k) {
    MbConvTaps<KW> taps;
#pragma unroll
    for (int j = 0; j < KW; ++j) taps.w[j] = j >= KW - k ? to_f(w[ch * k + j - (KW - k)]) : 0.f;
    taps.bias = cb ? to_f(cb[ch]) : 0.f;
    return taps;
}
// The window before row r0: win[j] = the input KW − j rows back (j < KW − 1) where it is in
// r0's sequence (tt = r0's position in it) and feeds a tap, else 0; win[KW − 1] is filled by
// the walk. `x` points at row r0's input of the channel, rows `ldx` apart.
template <int KW>
__device__ __forceinline__ void mb_conv_prefill(float win[KW], const bf16_t* x, int ldx, int tt,
                                                int k) {
#pragma unroll
    for (int j = 0; j < KW; ++j) {
        const int back = KW - j;  // win[j] moves to win[j - 1] when row r0 comes in
        win[j] = j >= KW + 1 - k && j < KW && tt - back >= 0 ? to_f(x[-back * ldx]) : 0.f;
    }
}
// Shift row r's input into the window (zeroing what lies before its sequence) and return the
// conv's output before the SiLU.
template <int KW>
__device__ __forceinline__ float mb_conv_push(float win[KW], const MbConvTaps<KW>& taps, float x,
                                              bool seq_start) {
#pragma unroll
    for (int j = 0; j < KW - 1; ++j) win[j] = seq_start ? 0.f : win[j + 1];
    win[KW - 1] = x;
    float acc = taps.bias;
#pragma unroll
    for (int j = 0; j < KW; ++j) acc += taps.w[j] * win[j];
    return acc;
}
// The forward's walk of one channel over rows r0 .. r_end − 1: its inputs at `x` (row r0's,
// rows ldx apart, the KW − 1 before it readable where they are in r0's sequence), its outputs
// from row r0 at `dst` (rows ld apart).
template <int KW>
__device__ __forceinline__ void mb_conv_walk(const bf16_t* __restrict__ x, int ldx,
                                             const bf16_t* __restrict__ w,
                                             const bf16_t* __restrict__ cb,
                                             bf16_t* __restrict__ dst, int ld, int ch, int r0,
                                             int r_end, int t, int k) {
    const MbConvTaps<KW> taps = mb_conv_taps<KW>(w, cb, ch, k);
    float win[KW];
    mb_conv_prefill<KW>(win, x, ldx, r0 % t, k);
    // Row pointers and the position within the sequence step with the walk (no 64-bit
    // multiply or integer division a row).
    int tt = r0 % t;
#pragma unroll 8
    for (int r = r0; r < r_end; ++r, x += ldx, dst += ld) {
        *dst = from_f<bf16_t>(silu_f(mb_conv_push<KW>(win, taps, to_f(*x), tt == 0)));
        tt = tt + 1 == t ? 0 : tt + 1;
    }
}
template <int KW>
__device__ __forceinline__ void mb_conv_fwd(const bf16_t* __restrict__ zx, int ld, int off,
                                            const bf16_t* __restrict__ w,
                                            const bf16_t* __restrict__ cb, bf16_t* __restrict__ xc,
                                            int n, int t, int conv, int k) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv) return;
    const int r0 = blockIdx.y * MB_CONV_ROWS, r_end = min(n, r0 + MB_CONV_ROWS);
    mb_conv_walk<KW>(zx + (size_t)r0 * ld + off + ch, ld, w, cb, xc + (size_t)r0 * conv + ch,
                     conv, ch, r0, r_end, t, k);
}
extern "C" __global__ void __launch_bounds__(128)
    mamba_conv_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                        const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                        bf16_t* __restrict__ xc, int n, int t, int conv, int k) {
    mb_conv_fwd<8>(zx, ld, off, w, cb, xc, n, t, conv, k);
}
extern "C" __global__ void __launch_bounds__(128)
    mamba_conv4_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                         const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                         bf16_t* __restrict__ xc, int n, int t, int conv, int k) {
    mb_conv_fwd<4>(zx, ld, off, w, cb, xc, n, t, conv, k);
}

// dt's kernels: a warp per (b, h, chunk), lane l owning the chunk's positions 2l and 2l + 1
// (MB_L = 64). Returns false for the grid's spare warps.
static_assert(MB_L == 64, "mamba_dt_*: a warp's lanes own two positions of a chunk each");
struct MbDtLane {
    int bb, hh, c;
    size_t base;  // (b·H + h)·Tp + c·MB_L: the chunk's dtv/lam/ddt/dlam
};
__device__ __forceinline__ bool mb_dt_lane(MbDtLane& d, int b, int h, int chunks) {
    const int q = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    if (q >= b * h * chunks) return false;
    d.c = q % chunks;
    d.hh = (q / chunks) % h;
    d.bb = q / (chunks * h);
    d.base = (size_t)(d.bb * h + d.hh) * chunks * MB_L + (size_t)d.c * MB_L;
    return true;
}

// dt: dtv = softplus(zx[r, off + h] + dt_bias[h]) (clamped to [lo, hi] where `clamp`), lam its
// running sum × A (A = −exp(a_log[h])) within each chunk; 0 and the chunk's last sum past T.
// The running sum is a warp scan over the lanes' pairs.
extern "C" __global__ void __launch_bounds__(128)
    mamba_dt_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                      const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ a_log,
                      float* __restrict__ dtv, float* __restrict__ lam, int b, int t, int h,
                      int chunks, int clamp, float lo, float hi) {
    MbDtLane d;
    if (!mb_dt_lane(d, b, h, chunks)) return;
    const int lane = threadIdx.x & 31;
    const float a = -__expf(to_f(a_log[d.hh])), bias = to_f(dt_bias[d.hh]);
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int tt = d.c * MB_L + 2 * lane + e;
        v[e] = 0.f;
        if (tt < t) {
            v[e] = softplus_f(to_f(zx[(size_t)(d.bb * t + tt) * ld + off + d.hh]) + bias);
            if (clamp) v[e] = fminf(fmaxf(v[e], lo), hi);
        }
    }
    const float mine = v[0] * a + v[1] * a;
    float run = mine;  // inclusive scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_up_sync(0xffffffffu, run, o);
        if (lane >= o) run += u;
    }
    const float first = run - mine + v[0] * a;
    *reinterpret_cast<float2*>(&dtv[d.base + 2 * lane]) = make_float2(v[0], v[1]);
    *reinterpret_cast<float2*>(&lam[d.base + 2 * lane]) = make_float2(first, first + v[1] * a);
}

// Grid of the chunk kernels: (chunks, heads, batch), 256 threads. Shared pointers for one block.
struct MbChunk {
    int c, h, b, g;         // chunk, head, batch row, the head's group
    int t0, t_end;          // the chunk's first row within the sequence, and T
    size_t row0;            // b·T + t0
    size_t pos;             // (b·H + h)·Tp + t0: this chunk's dtv/lam
    size_t st;              // this chunk's state
};
__device__ __forceinline__ MbChunk mb_chunk_of(int t, int heads, int groups, int p, int s,
                                               int h) {
    MbChunk k;
    k.c = blockIdx.x;
    k.h = h;
    k.b = blockIdx.z;
    k.g = k.h / (heads / groups);
    k.t0 = k.c * MB_L;
    k.t_end = t;
    k.row0 = (size_t)k.b * t + k.t0;
    k.pos = (size_t)(k.b * heads + k.h) * gridDim.x * MB_L + k.t0;
    k.st = ((size_t)(k.b * heads + k.h) * gridDim.x + k.c) * p * s;
    return k;
}
__device__ __forceinline__ MbChunk mb_chunk(int t, int heads, int groups, int p, int s) {
    return mb_chunk_of(t, heads, groups, p, s, blockIdx.y);
}

// The backward chunk kernels take hb heads of one group in turn (grid (chunks, heads / hb,
// batch); the host picks hb, a divisor of a group's heads, at most MB_HB): what the heads share
// (the chunk's B and C, its C·Bᵀ) is loaded once a block, and their shares of dB and dC are
// summed in the block before they are added into the conv's gradient (hb times fewer atomics).
#define MB_HB 8
// The scan's backward's per-position f32 vectors a head (kernels.rs's scan_bwd_smem).
#define MB_SV 8

// A tile's f32 values rounded to the 16-bit type at dst[mb_row·ld + mb_col] for rows < rows and
// columns < cols (on tensor cores in 4-byte pairs of adjacent columns where the addresses
// allow).
__device__ __forceinline__ void mb_store_tile16(mb_t* dst, size_t ld, const float v[4][4],
                                                int rows, int cols) {
#if MB_TC
    if (ld % 2 == 0 && cols % 2 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; c += 2) {
                const int i = mb_row(a, c), j = mb_col(a, c);
                if (i < rows && j < cols)
                    *reinterpret_cast<uint32_t*>(dst + (size_t)i * ld + j) =
                        mb_pack2(v[a][c], v[a][c + 1]);
            }
        return;
    }
#endif
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int i = mb_row(a, c), j = mb_col(a, c);
            if (i < rows && j < cols) dst[(size_t)i * ld + j] = from_f<mb_t>(v[a][c]);
        }
}

// mb_store_tile16 of a whole tile where ld is a multiple of 4 and dst 8-byte aligned (the
// walks' states on their fast paths), on tensor cores four adjacent columns of a row a lane in
// one 8-byte store: lanes 2k and 2k + 1 trade a pair (the even lane keeps its n8 tile 2m's pair
// and takes its partner's, the odd lane takes its partner's tile 2m + 1 pair before its own), so
// that a warp's store covers whole 32-byte sectors of eight rows (a pair a lane covers half
// sectors: twice the L2's requests).
__device__ __forceinline__ void mb_store_tile16_quad(mb_t* dst, size_t ld, const float v[4][4]) {
#if MB_TC
    const bool odd = threadIdx.x & 1;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const uint32_t a0 = mb_pack2(v[2 * m][2 * hr], v[2 * m][2 * hr + 1]);
            const uint32_t a1 = mb_pack2(v[2 * m + 1][2 * hr], v[2 * m + 1][2 * hr + 1]);
            const uint32_t o = __shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 1);
            const int i = mb_row(0, 2 * hr);
            const int j = odd ? mb_col(2 * m + 1, 0) - 2 : mb_col(2 * m, 0);
            *reinterpret_cast<uint2*>(dst + (size_t)i * ld + j) =
                odd ? make_uint2(o, a1) : make_uint2(a0, o);
        }
#else
    mb_store_tile16(dst, ld, v, 64, 64);
#endif
}

// The chunks' start states in one walk over the chunks: S_0 = 0, S_{c+1} = exp(lam_last(c))·S_c
// + Σ_i exp(lam_last(c) − lam_i)·dtv_i·x_i[p]·B_i[s] (chunk c's own contribution), stored in
// the 16-bit type ([B, H, chunks, P, S]). A block per (64 head columns, NS·64 state columns,
// batch row · head) carries its NS tiles of the state in f32 accumulators from chunk to chunk,
// so the state never goes through global memory in f32; its x tile is shared by the NS
// products (NS = 2: a state of 128 in one block, x read once a chunk instead of twice). Its x
// and B tiles and dt values come by cp.async into a ring of MB_WS stages, two chunks ahead of
// their product; x's rows are scaled in shared memory once they land. Shapes whose tiles are
// not whole 16-byte rows walk each of the block's state tiles in turn, loading each chunk's
// tiles when it comes (mb_load).
#define MB_WS 3
template <int NS>
__device__ __forceinline__ void mb_state_walk(const bf16_t* __restrict__ xc,
                                              const float* __restrict__ dtv,
                                              const float* __restrict__ lam,
                                              mb_t* __restrict__ states, int t, int heads, int p,
                                              int s, int groups, int chunks,
                                              unsigned char* mb_raw) {
    // stage q: x [i][p] (tile (1 + NS)q), B [i][s] (tiles (1 + NS)q + 1..), lam and dtv [i]
    // (vectors 2q, 2q + 1)
    constexpr int TS = 1 + NS;
    float* vecs = mb_vecs(mb_raw, TS * MB_WS);
    const int p0 = blockIdx.x * 64, s0 = blockIdx.y * 64 * NS, bh = blockIdx.z;
    const int b = bh / heads, h = bh % heads, g = h / (heads / groups);
    const int conv = heads * p + 2 * groups * s;
    const int xcol = h * p + p0, bcol = heads * p + g * s + s0;
    const int pc = min(64, p - p0);
    const float* lm = lam + (size_t)bh * chunks * MB_L;
    const float* dv = dtv + (size_t)bh * chunks * MB_L;
    mb_t* st = states + (size_t)bh * chunks * p * s + (size_t)p0 * s + s0;
    const bool fast = pc == 64 && s0 + 64 * NS <= s && s % 4 == 0 && conv % 8 == 0 &&
                      xcol % 8 == 0 && bcol % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(st) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(xc) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(lm) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dv) % 16 == 0 && blockDim.x == 256;
    float acc[NS][4][4];
    if (!fast) {
        mb_t* xs = mb_tile(mb_raw, 0);
        mb_t* bs = mb_tile(mb_raw, 1);
        float* w = vecs;
        for (int si = 0; si < NS && s0 + 64 * si < s; ++si) {
            const int sc = min(64, s - s0 - 64 * si);
            mb_zero(acc[0]);
            for (int c = 0;; ++c) {
                mb_store_tile16(st + (size_t)c * p * s + 64 * si, s, acc[0], pc, sc);
                if (c + 1 == chunks) break;
                const int r0 = b * t + c * MB_L, r1 = r0 + min(t - c * MB_L, MB_L);
                const float last = lm[c * MB_L + MB_L - 1];
                __syncthreads();  // the last product is done with the tiles and w
                for (int i = threadIdx.x; i < MB_L; i += blockDim.x)
                    w[i] = __expf(last - lm[c * MB_L + i]) * dv[c * MB_L + i];
                __syncthreads();
                mb_load(xs, xc, conv, r0, r1, xcol, pc, w);
                mb_load(bs, xc, conv, r0, r1, bcol + 64 * si, sc, nullptr);
                __syncthreads();
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[0][a][q] *= __expf(last);
                // A(p, i) = xs[i][p], B(i, s) = bs[i][s]
                mb_mm<true, false>(acc[0], xs, bs, MB_L);
            }
        }
        return;
    }
#pragma unroll
    for (int si = 0; si < NS; ++si) mb_zero(acc[si]);
    // Chunk c's copies into stage c % MB_WS (one commit group; an empty one past the last
    // chunk, so that the wait below counts the same groups).
    auto issue = [&](int c) {
        if (c < chunks) {
            const int q = c % MB_WS;
            const int r0 = b * t + c * MB_L, r1 = r0 + min(t - c * MB_L, MB_L);
            mb_t* xs = mb_tile(mb_raw, TS * q);
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                const int e = threadIdx.x + 256 * e2, i = e >> 3, j = (e & 7) * 8;
                const bool in = r0 + i < r1;
                const mb_t* row = xc + (size_t)(in ? r0 + i : r0) * conv;
                mb_cp16(xs + i * MB_LDH + j, row + xcol + j, in);
#pragma unroll
                for (int si = 0; si < NS; ++si)
                    mb_cp16(mb_tile(mb_raw, TS * q + 1 + si) + i * MB_LDH + j,
                            row + bcol + 64 * si + j, in);
            }
            if (threadIdx.x < 32) {
                const int v = threadIdx.x >> 4, j = (threadIdx.x & 15) * 4;
                mb_cp16(vecs + (2 * q + v) * MB_L + j, (v ? dv : lm) + c * MB_L + j, true);
            }
        }
        mb_cp_commit();
    };
    issue(0);
    issue(1);
    for (int c = 0;; ++c) {
        // chunk c's start state out
#pragma unroll
        for (int si = 0; si < NS; ++si)
            mb_store_tile16_quad(st + (size_t)c * p * s + 64 * si, s, acc[si]);
        if (c + 1 == chunks) break;
        mb_cp_wait<1>();  // this thread's copies of chunk c have landed
        __syncthreads();  // everyone's; and chunk c − 1's product is done with its stage
        issue(c + 2);
        const int q = c % MB_WS;
        mb_t* xs = mb_tile(mb_raw, TS * q);
        const float* lv = vecs + 2 * q * MB_L;
        const float last = lv[MB_L - 1];
        // x's rows times exp(lam_last − lam_i)·dtv_i
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int e = threadIdx.x + 256 * e2, i = e >> 3, j = (e & 7) * 8;
            uint4* cell = reinterpret_cast<uint4*>(xs + i * MB_LDH + j);
            mb_store16<mb_t>(xs, i, j, *cell, __expf(last - lv[i]) * lv[MB_L + i], true);
        }
        __syncthreads();
        const float decay = __expf(last);
#pragma unroll
        for (int si = 0; si < NS; ++si) {
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[si][a][e] *= decay;
            // A(p, i) = xs[i][p], B(i, s) = bs[i][s]
            mb_mm<true, false>(acc[si], xs, mb_tile(mb_raw, TS * q + 1 + si), MB_L);
        }
    }
    mb_cp_wait<0>();
}
// The walk's kernels: a state tile a block (mamba_state_walk) and two (mamba_state_walk2).
#define MB_WALK(name, NS)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        name(const bf16_t* __restrict__ xc, const float* __restrict__ dtv,                      \
             const float* __restrict__ lam, mb_t* __restrict__ states, int t, int heads, int p, \
             int s, int groups, int chunks) {                                                  \
        extern __shared__ __align__(16) unsigned char mb_raw[];                                \
        mb_state_walk<NS>(xc, dtv, lam, states, t, heads, p, s, groups, chunks, mb_raw);       \
    }
MB_WALK(mamba_state_walk_bf16, 1)
MB_WALK(mamba_state_walk2_bf16, 2)

// Each chunk's C·Bᵀ per group, which its heads share: cb[b, g, chunk][i][j] = C_i·B_j
// (f32, 64 × 64). Grid (chunks, groups, batch).
extern "C" __global__ void __launch_bounds__(256)
    mamba_chunk_cb_bf16(const bf16_t* __restrict__ xc, float* __restrict__ cb, int t, int heads,
                        int p, int s, int groups) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    mb_t* t1 = mb_tile(mb_raw, 0);
    mb_t* t2 = mb_tile(mb_raw, 1);
    const int c = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    const int conv = heads * p + 2 * groups * s, inner = heads * p;
    const int t0 = c * MB_L, r0 = b * t + t0, r1 = r0 + min(t - t0, MB_L);
    const int bcol = inner + g * s, ccol = inner + groups * s + g * s;
    float acc[4][4];
    mb_zero(acc);
    for (int s0 = 0; s0 < s; s0 += 64) {
        __syncthreads();
        mb_load(t1, xc, conv, r0, r1, ccol + s0, min(64, s - s0), nullptr);
        mb_load(t2, xc, conv, r0, r1, bcol + s0, min(64, s - s0), nullptr);
        __syncthreads();
        // A(i, s) = C[i][s], B(s, j) = B[j][s]
        mb_mm<false, true>(acc, t1, t2, 64);
    }
    float* out = cb + ((size_t)(b * groups + g) * gridDim.x + c) * MB_L * MB_L;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int q = 0; q < 4; ++q) out[mb_row(a, q) * MB_L + mb_col(a, q)] = acc[a][q];
}

// The chunk's C·Bᵀ (mamba_chunk_cb) at this thread's accumulator places.
__device__ __forceinline__ void mb_read_cb(float g[4][4], const float* __restrict__ cb,
                                           const MbChunk& k, int groups) {
    const float* src = cb + ((size_t)(k.b * groups + k.g) * gridDim.x + k.c) * MB_L * MB_L;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) g[a][c] = src[mb_row(a, c) * MB_L + mb_col(a, c)];
}

// A chunk's outputs: y_i[p] = Σ_{j ≤ i} (C_i·B_j)·exp(lam_i − lam_j)·dtv_j·x_j[p]
// + exp(lam_i)·Σ_s C_i[s]·S[p][s] + D·x_i[p], into y [N, inner] (the gated norm's input), for
// the hb heads of a group of the block in turn (grid (chunks, heads / hb, batch)): what they
// share, the chunk's C·Bᵀ and its C tiles (all of the state's columns), is read once a block.
// Each (head, 64 head columns) step copies its x tile and its rows of S by cp.async, building
// the head's M = C·Bᵀ·exp(lam_i − lam_j)·dtv_j (j ≤ i) while they land.
extern "C" __global__ void __launch_bounds__(256, 3)
    mamba_chunk_scan_bf16(const bf16_t* __restrict__ xc, const float* __restrict__ cb,
                          const float* __restrict__ dtv, const float* __restrict__ lam,
                          const mb_t* __restrict__ states, const bf16_t* __restrict__ dskip,
                          bf16_t* __restrict__ y, int t, int heads, int p, int s, int groups,
                          int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    const int ns = (s + 63) / 64, np = (p + 63) / 64, steps = hb * np;
    mb_t* ms = mb_tile(mb_raw, 0);  // M[i][j]
    mb_t* xt = mb_tile(mb_raw, 1);  // x [j][p]
    // tiles 2..: the step's S [p][s] (ns of them), then the chunk's C [i][s] (ns)
    auto st_tile = [&](int q) { return mb_tile(mb_raw, 2 + q); };
    auto c_tile = [&](int q) { return mb_tile(mb_raw, 2 + ns + q); };
    float* vec = mb_vecs(mb_raw, 2 + 2 * ns);  // per head: lam, dtv [2][MB_L]
    const int h0 = blockIdx.y * hb;
    const MbChunk k0 = mb_chunk_of(t, heads, groups, p, s, h0);
    const int conv = heads * p + 2 * groups * s, inner = heads * p;
    const int rows = min(t - k0.t0, MB_L);
    const int r0 = (int)k0.row0, r1 = r0 + rows;
    const int ccol = inner + groups * s + k0.g * s;
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        vec[hh * 2 * MB_L + i] = lam[pos + i];
        vec[hh * 2 * MB_L + MB_L + i] = dtv[pos + i];
    }
    for (int q = 0; q < ns; ++q)
        mb_load_async(c_tile(q), xc, conv, r0, r1, ccol + 64 * q, min(64, s - 64 * q));
    // (committed with the first step's copies)
    float g[4][4];
    mb_read_cb(g, cb, k0, groups);
    for (int u = 0; u < steps; ++u) {
        const int hh = u / np, p0 = 64 * (u % np), pc = min(64, p - p0);
        const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
        const float* lm = vec + hh * 2 * MB_L;
        const float* dv = lm + MB_L;
        __syncthreads();  // the last step is done with its tiles and M; the vectors are in
        mb_load_async(xt, xc, conv, r0, r1, k.h * p + p0, pc);
        for (int q = 0; q < ns; ++q)
            mb_load_async(st_tile(q), states + k.st + (size_t)p0 * s, s, 0, pc, 64 * q,
                          min(64, s - 64 * q));
        mb_cp_commit();
        if (p0 == 0) {
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int i = mb_row(a, c), j = mb_col(a, c);
                    mb_put(ms, i, j, j <= i ? g[a][c] * __expf(lm[i] - lm[j]) * dv[j] : 0.f);
                }
        }
        mb_cp_wait<0>();
        __syncthreads();
        float acc[4][4], off[4][4];
        mb_zero(acc);
        mb_zero(off);
        mb_mm<false, false>(acc, ms, xt, MB_L);
        for (int q = 0; q < ns; ++q)
            // A(i, s) = C[i][s], B(s, p) = S[p][s]
            mb_mm<false, true>(off, c_tile(q), st_tile(q), 64);
        const float dsk = to_f(dskip[k.h]);
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = mb_row(a, c);
                acc[a][c] += __expf(lm[i]) * off[a][c] + dsk * mb_get(xt, i, mb_col(a, c));
            }
        mb_store_tile16(y + k.row0 * inner + k.h * p + p0, inner, acc, rows, pc);
    }
}

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
                    mb_unpack(mb_gn_raw<KEEP>(yq[h][q], y + rr * inner + j), yv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(zq[h][q], zx + rr * ld + j), zv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(dq[h][q], dout + rr * inner + j), dv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(wq[q], w + j), wv,
                              static_cast<const bf16_t*>(nullptr));
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
                    mb_unpack(mb_gn_raw<KEEP>(yq[h][q], y + rr * inner + j), yv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(zq[h][q], zx + rr * ld + j), zv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(dq[h][q], dout + rr * inner + j), dv,
                              static_cast<const bf16_t*>(nullptr));
                    mb_unpack(mb_gn_raw<KEEP>(wq[q], w + j), wv,
                              static_cast<const bf16_t*>(nullptr));
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

// x[r, c0 + c] = 0 for r < rows, c < cols (row stride ld): the B | C columns of dxc, which the
// chunk kernels' backward add into (its x columns are stored).
extern "C" __global__ void mamba_zero_cols_f32(float* __restrict__ x, int rows, int ld, int c0,
                                               int cols) {
    const size_t n = (size_t)rows * cols;
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < n;
         q += (size_t)gridDim.x * blockDim.x)
        x[(q / cols) * ld + c0 + q % cols] = 0.f;
}

// The backward of a chunk's outputs (mamba_chunk_scan) from dy [N, inner] (16-bit), for the hb
// heads of the block in turn: dx into dxc's x columns (stored: with the D skip's), ddt and dlam
// of the chunk's positions (stored) and D's gradient (+=); dB and dC, which a group's heads
// share, added into dxc's B and C columns once a block (the gradient of the chunk's start state
// is mamba_state_walk_bwd's):
//   dC_i = Σ_j dGΣ[i][j]·B_j + Σ_h exp(lam_h,i)·Σ_p dy_h,i[p]·S_h[p],  dB_j = Σ_i dGΣ[i][j]·C_i,
// where dGΣ = Σ_h dG_h (summed in registers, rounded to the 16-bit type once). The heads' dM, dx
// and dG first, then one pass over them per 64 columns of the state, each keeping its
// Σ_h exp(lam_h)·dy_h·S_h tile in registers. Both walk their (head, 64 head columns) steps with
// the next step's tiles copied by cp.async into a second buffer while this step's products run
// (mb_load_async; shapes without whole 16-byte pieces load synchronously, a step ahead all the
// same).
// With `down` (mamba_state_walk_bwd's R = the gradient of each chunk's own contribution to its
// end state, run before this kernel) the first part also takes mamba_chunk_state_bwd's share
// through x: with w_j = exp(lam_last − lam_j)·dtv_j and v_j[p] = Σ_s R[p][s]·B_j[s], dx_j +=
// w_j·v_j (in the tile before it is stored: dx is written once), and through w_j ddt_j and
// dlam_j (stored with the rest; dlam's last position then adds onto the walk's share, which
// mamba_state_walk_bwd added into a zeroed dlam). The chunk's B tiles stay in shared memory for
// the part; each step's R tiles (its head columns, all of the state's) land in one buffer,
// copied once the step's v is formed. mamba_chunk_state_db then adds dB.
extern "C" __global__ void __launch_bounds__(256, 2)
    mamba_chunk_scan_bwd_bf16(const bf16_t* __restrict__ xc, const float* __restrict__ cb,
                              const float* __restrict__ dtv, const float* __restrict__ lam,
                              const mb_t* __restrict__ states, const mb_t* __restrict__ down,
                              const bf16_t* __restrict__ dskip,
                              const mb_t* __restrict__ dy, float* __restrict__ dxc,
                              float* __restrict__ ddt, float* __restrict__ dlam,
                              float* __restrict__ dd, int t,
                              int heads, int p, int s, int groups, int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    mb_t* ms = mb_tile(mb_raw, 0);  // a head's M[i][j] = G·W·dtv_j, then dGΣ
    mb_t* t1 = mb_tile(mb_raw, 1);  // C [i][s] (the pass's columns)
    // two buffers each: dy [i][p] (in the passes exp(lam_i)·dy), and x [j][p] or S [p][s]; B
    // [j][s] at the pass's end in the first x / S buffer
    auto dyb = [&](int u) { return mb_tile(mb_raw, 2 + (u & 1)); };
    auto xsb = [&](int u) { return mb_tile(mb_raw, 4 + (u & 1)); };
    // with `down`: B [j][s] and the step's R [p][s], a tile per 64 columns of the state each
    const bool fused = down != nullptr;
    const int ns = (s + 63) / 64;
    auto btile = [&](int si) { return mb_tile(mb_raw, 6 + si); };
    auto rtile = [&](int si) { return mb_tile(mb_raw, 6 + ns + si); };
    // per head: lam, dtv, exp(lam), rsum, csum, ddt, w, Σ_p x·v [MB_SV][MB_L]
    float* vec = mb_vecs(mb_raw, fused ? 6 + 2 * ns : 6);
    __shared__ float red[32];
    __shared__ float ddh[MB_HB];  // D's gradient a head: the warps' sums
    const int h0 = blockIdx.y * hb;
    const MbChunk k0 = mb_chunk_of(t, heads, groups, p, s, h0);
    const int conv = heads * p + 2 * groups * s, inner = heads * p;
    const int rows = min(t - k0.t0, MB_L);
    const int r0 = (int)k0.row0, r1 = r0 + rows;
    const int bcol = inner + k0.g * s, ccol = inner + groups * s + k0.g * s;
    const int np = (p + 63) / 64, steps = hb * np;  // (head, 64 head columns) steps
    // dy's tiles come by cp.async (then scaled in place by the thread that copied each piece)
    // where mb_load_async takes its 16-byte path for every head's columns
    const bool dy_async = p % 8 == 0 && inner % 8 == 0 && reinterpret_cast<uintptr_t>(dy) % 16 == 0;
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        float* v = vec + hh * MB_SV * MB_L;
        v[i] = lam[pos + i];
        v[MB_L + i] = dtv[pos + i];
        v[2 * MB_L + i] = __expf(v[i]);
        v[3 * MB_L + i] = v[4 * MB_L + i] = v[5 * MB_L + i] = v[7 * MB_L + i] = 0.f;
        v[6 * MB_L + i] = __expf(lam[pos + MB_L - 1] - v[i]) * v[MB_L + i];
    }
    // Step u's tiles of the first part: dy and x of head u / np, columns 64·(u % np).., and
    // with `down` the head's R rows of those columns (and, with the first, the chunk's B).
    auto load1 = [&](int u) {
        if (u < steps) {
            const int p0 = 64 * (u % np), xcol = (h0 + u / np) * p + p0, pc = min(64, p - p0);
            mb_load_async(dyb(u), dy, inner, r0, r1, xcol, pc);
            mb_load_async(xsb(u), xc, conv, r0, r1, xcol, pc);
            if (fused) {
                const size_t st = mb_chunk_of(t, heads, groups, p, s, h0 + u / np).st;
                for (int si = 0; si < ns; ++si) {
                    const int sc = min(64, s - 64 * si);
                    if (u == 0) mb_load_async(btile(si), xc, conv, r0, r1, bcol + 64 * si, sc);
                    mb_load_async(rtile(si), down + st, s, p0, p, 64 * si, sc);
                }
            }
        }
        mb_cp_commit();
    };
    // First each head's dM, dx and dG (dGΣ summed in registers, then rounded into ms).
    float g[4][4], dgs[4][4], dm[4][4];  // C·Bᵀ; dGΣ; the head's dM
    mb_read_cb(g, cb, k0, groups);
    mb_zero(dgs);
    float ddsum = 0.f;
    if (threadIdx.x < MB_HB) ddh[threadIdx.x] = 0.f;  // (first read after the loop's barriers)
    load1(0);
    for (int u = 0; u < steps; ++u) {
        const int hh = u / np, p0 = 64 * (u % np), pc = min(64, p - p0);
        const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
        float* hv = vec + hh * MB_SV * MB_L;
        const float* lm = hv;
        const float* dv = hv + MB_L;
        const int xcol = k.h * p;
        __syncthreads();  // step u − 1's products are done with ms and its buffers
        if (p0 == 0) {
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int i = mb_row(a, c), j = mb_col(a, c);
                    mb_put(ms, i, j, j <= i ? g[a][c] * __expf(lm[i] - lm[j]) * dv[j] : 0.f);
                }
            mb_zero(dm);
            ddsum = 0.f;
        }
        float acc[4][4];
        mb_zero(acc);
        if (fused) {
            // Step u's tiles have landed (its R buffer is the only one): v = B·Rᵀ ([j][p]),
            // Σ_p x_j[p]·v_j[p] into the head's sums, dx's tile starts at w_j·v_j; then step
            // u + 1's copies go.
            mb_cp_wait<0>();
            __syncthreads();
            // A(j, s) = B[j][s], B(s, p) = R[p][s]
            for (int si = 0; si < ns; ++si) mb_mm<false, true>(acc, btile(si), rtile(si), 64);
            const float* w = hv + 6 * MB_L;
            float xv[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = mb_row(a, c);
                    xv[a][c] = mb_get(xsb(u), j, mb_col(a, c)) * acc[a][c];
                    acc[a][c] *= w[j];
                }
            mb_row_sums(xv, hv + 7 * MB_L);
            __syncthreads();  // (every thread is done with the R buffer)
            load1(u + 1);
        } else {
            load1(u + 1);
            mb_cp_wait<1>();
            __syncthreads();
        }
        const mb_t* t3 = dyb(u);
        const mb_t* t2 = xsb(u);
        // dM += dy·xᵀ ([i][j]); dx_j[p] = Σ_i M[i][j]·dy_i[p] + D·dy_j[p]; D's gradient Σ dy·x.
        // A(i, p) = dy[i][p], B(p, j) = x[j][p]
        mb_mm<false, true>(dm, t3, t2, 64);
        // A(j, i) = M[i][j], B(i, p) = dy[i][p]
        mb_mm<true, false>(acc, ms, t3, MB_L);
        const float dsk = to_f(dskip[k.h]);
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = mb_row(a, c), pp = mb_col(a, c);
                const float dyv = mb_get(t3, j, pp);
                ddsum += dyv * mb_get(t2, j, pp);
                acc[a][c] += dsk * dyv;
            }
        mb_store_tile(dxc + k.row0 * conv + xcol + p0, conv, acc, rows, pc);
        if (p0 + 64 < p) continue;
        // The head's last step. Per (i, j ≤ i): W = exp(lam_i − lam_j); dG = dM·W·dtv_j (into
        // dGΣ); ddt_j += dM·G·W; q = dM·G·W·dtv_j: dlam_i += q, dlam_j −= q.
        float* rsum = hv + 3 * MB_L;  // dlam from the rows' sums
        float* csum = rsum + MB_L;     // dlam from the columns' sums
        float* dts = csum + MB_L;      // ddt [j]
        float dmgw[4][4], q[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = mb_row(a, c), j = mb_col(a, c);
                dmgw[a][c] = q[a][c] = 0.f;
                if (j <= i) {
                    const float wgt = __expf(lm[i] - lm[j]);
                    dgs[a][c] += dm[a][c] * wgt * dv[j];
                    dmgw[a][c] = dm[a][c] * g[a][c] * wgt;
                    q[a][c] = dmgw[a][c] * dv[j];
                }
            }
        mb_col_sums(dmgw, dts);
        mb_row_sums(q, rsum);
        mb_col_sums(q, csum);
        ddsum = warp_sum(ddsum);
        if ((threadIdx.x & 31) == 0) atomicAdd(&ddh[hh], ddsum);
    }
    __syncthreads();
    // The pass over the state's columns: with `down` (the chunk's B tiles kept), heads of at
    // most 64 columns and at most two tiles of state columns, one pass over the heads with
    // each head's exp(lam)·dy copied once for both tiles of S (dGΣ stays in registers, ms takes
    // C's second tile); else a pass per 64 columns of the state over the heads again, each
    // copying dy anew.
    if (fused && ns <= 2 && np == 1 && dy_async) {
        // step v's S tiles: the x buffers for the first, the R buffers for the second
        auto s_tile = [&](int v, int si) { return si == 0 ? xsb(v) : rtile(v & 1); };
        auto c_tile = [&](int si) { return si == 0 ? t1 : ms; };
        auto load3 = [&](int v) {
            if (v < steps) {
                const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + v);
                for (int si = 0; si < ns; ++si) {
                    const int sc = min(64, s - 64 * si);
                    if (v == 0) mb_load_async(c_tile(si), xc, conv, r0, r1, ccol + 64 * si, sc);
                    mb_load_async(s_tile(v, si), states + k.st, s, 0, p, 64 * si, sc);
                }
                mb_load_async(dyb(v), dy, inner, r0, r1, k.h * p, p);
            }
            mb_cp_commit();
        };
        float dco[2][4][4];
        mb_zero(dco[0]);
        mb_zero(dco[1]);
        load3(0);
        for (int v = 0; v < steps; ++v) {  // (a step a head: p ≤ 64)
            const float* el = vec + v * MB_SV * MB_L + 2 * MB_L;
            if (v > 0) __syncthreads();  // step v − 1's products are done with its buffers
            load3(v + 1);
            mb_cp_wait<1>();
            mb_t* t4 = dyb(v);
            // this thread's own pieces of dy (mb_load_async's: 16 bytes, threads in turn)
            for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x) {
                const int i = e >> 3, j = (e & 7) * 8;
                mb_store16<mb_t>(t4, i, j, *reinterpret_cast<const uint4*>(t4 + i * MB_LDH + j),
                                 el[i], true);
            }
            __syncthreads();
            // o = Σ_p exp(lam_i)·dy_i[p]·S[p][s] per tile of state columns (dC's share, and
            // Σ_s C_i[s]·o_i[s] is dlam_i's share from the state).
            float co[4][4];
            mb_zero(co);
#pragma unroll
            for (int si = 0; si < 2; ++si) {
                if (si == ns) break;
                float off[4][4];
                mb_zero(off);
                // A(i, p) = exp(lam_i)·dy[i][p], B(p, s) = S[p][s]
                mb_mm<false, false>(off, t4, s_tile(v, si), 64);
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        co[a][c] += mb_get(c_tile(si), mb_row(a, c), mb_col(a, c)) * off[a][c];
                        dco[si][a][c] += off[a][c];
                    }
            }
            mb_row_sums(co, vec + v * MB_SV * MB_L + 3 * MB_L);
        }
        // The heads' dB and dC: dC = dGΣ·B + Σ_h o_h, dB = dGΣᵀ·C, dGΣ through dy's first buffer.
        __syncthreads();
        mb_t* gt = dyb(0);
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) mb_put(gt, mb_row(a, c), mb_col(a, c), dgs[a][c]);
        __syncthreads();
#pragma unroll
        for (int si = 0; si < 2; ++si) {
            if (si == ns) break;
            const int sc = min(64, s - 64 * si);
            // A(i, j) = dGΣ[i][j], B(j, s) = B[j][s]
            mb_mm<false, false>(dco[si], gt, btile(si), MB_L);
            mb_red_tile(dxc + k0.row0 * conv + ccol + 64 * si, conv, dco[si], rows, sc, nullptr);
            float db[4][4];
            mb_zero(db);
            // A(j, i) = dGΣ[i][j], B(i, s) = C[i][s]
            mb_mm<true, false>(db, gt, c_tile(si), MB_L);
            mb_red_tile(dxc + k0.row0 * conv + bcol + 64 * si, conv, db, rows, sc, nullptr);
        }
    } else {
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) mb_put(ms, mb_row(a, c), mb_col(a, c), dgs[a][c]);
        // Step v's tiles of a pass over the state's columns s0..: exp(lam_i)·dy of head v / np and
        // the head's state S, columns 64·(v % np)..; with the first, the pass's C tile.
        auto load2 = [&](int v, int s0, int sc) {
            if (v < steps) {
                const int hh = v / np, p0 = 64 * (v % np), pc = min(64, p - p0);
                const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
                if (v == 0) mb_load_async(t1, xc, conv, r0, r1, ccol + s0, sc);
                if (dy_async)
                    mb_load_async(dyb(v), dy, inner, r0, r1, k.h * p + p0, pc);
                else
                    mb_load(dyb(v), dy, inner, r0, r1, k.h * p + p0, pc,
                            vec + hh * MB_SV * MB_L + 2 * MB_L);
                mb_load_async(xsb(v), states + k.st + (size_t)p0 * s, s, 0, pc, s0, sc);
            }
            mb_cp_commit();
        };
        // Then a pass per 64 columns of the state over the heads again.
        for (int s0 = 0; s0 < s; s0 += 64) {
            const int sc = min(64, s - s0);
            float dco[4][4], off[4][4];
            mb_zero(dco);
            __syncthreads();  // the last pass's B and C tiles, and ms (first pass), are done
            load2(0, s0, sc);
            for (int v = 0; v < steps; ++v) {
                const int hh = v / np, p0 = 64 * (v % np), pc = min(64, p - p0);
                const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
                const float* el = vec + hh * MB_SV * MB_L + 2 * MB_L;
                if (v > 0) __syncthreads();  // step v − 1's products are done with its buffers
                if (p0 == 0) mb_zero(off);
                load2(v + 1, s0, sc);
                mb_cp_wait<1>();
                mb_t* t4 = dyb(v);
                if (dy_async) {
                    // this thread's own pieces of dy (mb_load_async's: 16 bytes, threads in turn)
                    for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x) {
                        const int i = e >> 3, j = (e & 7) * 8;
                        const uint4 u = *reinterpret_cast<const uint4*>(t4 + i * MB_LDH + j);
                        mb_store16<mb_t>(t4, i, j, u, el[i], true);
                    }
                }
                __syncthreads();
                const mb_t* t2 = xsb(v);
                // The pass's state columns: o = Σ_p exp(lam_i)·dy_i[p]·S[p][s] (dC's share, and
                // Σ_s C_i[s]·o_i[s] is dlam_i's share from the state).
                // A(i, p) = exp(lam_i)·dy[i][p], B(p, s) = S[p][s]
                mb_mm<false, false>(off, t4, t2, 64);
                if (p0 + 64 < p) continue;
                float* rsum = vec + hh * MB_SV * MB_L + 3 * MB_L;
                float co[4][4];
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        co[a][c] = mb_get(t1, mb_row(a, c), mb_col(a, c)) * off[a][c];
                        dco[a][c] += off[a][c];
                    }
                mb_row_sums(co, rsum);
            }
            // The heads' dB and dC of the pass's columns: dC = dGΣ·B + Σ_h o_h, dB = dGΣᵀ·C.
            __syncthreads();
            // (B kept from the first part with `down`)
            mb_t* bt = fused ? btile(s0 / 64) : xsb(0);
            if (!fused) mb_load(bt, xc, conv, r0, r1, bcol + s0, sc, nullptr);
            __syncthreads();
            // A(i, j) = dGΣ[i][j], B(j, s) = B[j][s]
            mb_mm<false, false>(dco, ms, bt, MB_L);
            mb_red_tile(dxc + k0.row0 * conv + ccol + s0, conv, dco, rows, sc, nullptr);
            float db[4][4];
            mb_zero(db);
            // A(j, i) = dGΣ[i][j], B(i, s) = C[i][s]
            mb_mm<true, false>(db, ms, t1, MB_L);
            mb_red_tile(dxc + k0.row0 * conv + bcol + s0, conv, db, rows, sc, nullptr);
        }
    }
    mb_cp_wait<0>();
    __syncthreads();
    if (fused) {
        // Σ_j q_j (q_j = w_j·Σ_p x_j[p]·v_j[p]: dlam_last's share through w), a warp a head,
        // into red[head].
        for (int hh = threadIdx.x >> 5; hh < hb; hh += blockDim.x >> 5) {
            const float* v = vec + hh * MB_SV * MB_L;
            float q = 0.f;
            for (int j = threadIdx.x & 31; j < MB_L; j += 32)
                q += v[6 * MB_L + j] * v[7 * MB_L + j];
            q = warp_sum(q);
            if ((threadIdx.x & 31) == 0) red[hh] = q;
        }
        __syncthreads();
    }
    if (dd && threadIdx.x < hb) atomicAdd(&dd[h0 + threadIdx.x], ddh[threadIdx.x]);
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        const float* v = vec + hh * MB_SV * MB_L;
        float dd = v[5 * MB_L + i], dl = v[3 * MB_L + i] - v[4 * MB_L + i];
        if (fused) {
            // through w_j = exp(lam_last − lam_j)·dtv_j: ddt_j += dw_j·exp(lam_last − lam_j),
            // dlam_j −= q_j, dlam_last += Σ q (onto the walk's share there)
            const float dw = v[7 * MB_L + i];
            dd += dw * __expf(v[MB_L - 1] - v[i]);
            dl -= dw * v[6 * MB_L + i];
            if (i == MB_L - 1) dl += red[hh] + dlam[pos + i];
        }
        ddt[pos + i] = dd;
        dlam[pos + i] = dl;
    }
}

// The state passing's backward in one walk over the chunks from the last. With dS_{c+1} the
// gradient of the state at chunk c's end (0 past the last chunk) and L_c = lam_last(c):
// down[c] = dS_{c+1} (the gradient of chunk c's own contribution, in the 16-bit type its only
// reader's tiles round to: mamba_chunk_state_bwd), dlam at chunk c's last position +=
// exp(L_c)·Σ dS_{c+1}·S_c (the decay's share; S_c the chunk's start state), and
// dS_c = exp(L_c)·dS_{c+1} + Σ_i exp(lam_i)·dy_i[p]·C_i[s] (the chunk's outputs' share). A
// block per (64 head columns, NS·64 state columns, batch row · head) carries dS in f32
// accumulators, its dy tile shared by the NS products; each chunk's dy, C and S tiles come by
// cp.async a chunk ahead, dy's rows scaled by exp(lam_i) by the thread that copied them once
// they land. Shapes whose tiles are not whole 16-byte rows walk each of the block's state
// tiles in turn, loading each chunk's tiles when it comes (mb_load).
template <int NS>
__device__ __forceinline__ void mb_state_walk_bwd(const bf16_t* __restrict__ xc,
                                                  const mb_t* __restrict__ dy,
                                                  const float* __restrict__ lam,
                                                  const mb_t* __restrict__ states,
                                                  float* __restrict__ dlam,
                                                  mb_t* __restrict__ down, int t, int heads,
                                                  int p, int s, int groups, int chunks,
                                                  unsigned char* mb_raw) {
    // stage q: exp(lam_i)·dy [i][p] (tile TS·q), C [i][s] (TS·q + 1 + si), S [p][s]
    // (TS·q + 1 + NS + si)
    constexpr int TS = 1 + 2 * NS;
    float* el = mb_vecs(mb_raw, 2 * TS);  // exp(lam_i) [i] (where the tiles load synchronously)
    const int p0 = blockIdx.x * 64, s0 = blockIdx.y * 64 * NS, bh = blockIdx.z;
    const int b = bh / heads, h = bh % heads, g = h / (heads / groups);
    const int conv = heads * p + 2 * groups * s, inner = heads * p;
    const int xcol = h * p + p0, ccol = inner + groups * s + g * s + s0;
    const int pc = min(64, p - p0);
    const float* lm = lam + (size_t)bh * chunks * MB_L;
    float* dl = dlam + (size_t)bh * chunks * MB_L + MB_L - 1;
    const size_t at = (size_t)bh * chunks * p * s + (size_t)p0 * s + s0;
    const mb_t* st = states + at;
    mb_t* dn = down + at;
    const bool fast = pc == 64 && s0 + 64 * NS <= s && inner % 8 == 0 && conv % 8 == 0 &&
                      xcol % 8 == 0 && ccol % 8 == 0 && s % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(xc) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dy) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(st) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(dn) % 8 == 0 && blockDim.x == 256;
    float acc[NS][4][4];
    // Chunk c for the block's first n state tiles: the decay's share of dlam from S_c (tiles
    // stt(si)), then dS_c from exp(lam)·dy (dyt) and C (ct(si)).
    auto chunk = [&](int c, const mb_t* dyt, auto ct, auto stt, float last, int n) {
        const float d = __expf(last);
        float share = 0.f;
#pragma unroll
        for (int si = 0; si < NS; ++si) {
            if (si >= n) break;
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    share += acc[si][a][e] * mb_get(stt(si), mb_row(a, e), mb_col(a, e));
                    acc[si][a][e] *= d;
                }
        }
        share = warp_sum(share);
        if ((threadIdx.x & 31) == 0) atomicAdd(&dl[c * MB_L], share * d);
#pragma unroll
        for (int si = 0; si < NS; ++si) {
            if (si >= n) break;
            // A(p, i) = exp(lam_i)·dy[i][p], B(i, s) = C[i][s]
            mb_mm<true, false>(acc[si], dyt, ct(si), MB_L);
        }
    };
    if (!fast) {
        mb_t* dyt = mb_tile(mb_raw, 0);
        mb_t* ct = mb_tile(mb_raw, 1);
        mb_t* stt = mb_tile(mb_raw, 2);
        for (int si = 0; si < NS && s0 + 64 * si < s; ++si) {
            const int sc = min(64, s - s0 - 64 * si);
            mb_zero(acc[0]);
            for (int c = chunks - 1;; --c) {
                mb_store_tile16(dn + (size_t)c * p * s + 64 * si, s, acc[0], pc, sc);
                if (c == 0) break;
                const int r0 = b * t + c * MB_L, r1 = r0 + min(t - c * MB_L, MB_L);
                __syncthreads();  // the last chunk's product is done with the tiles and el
                for (int i = threadIdx.x; i < MB_L; i += blockDim.x)
                    el[i] = __expf(lm[c * MB_L + i]);
                __syncthreads();
                mb_load(dyt, dy, inner, r0, r1, xcol, pc, el);
                mb_load(ct, xc, conv, r0, r1, ccol + 64 * si, sc, nullptr);
                mb_load_state(stt, st + (size_t)c * p * s, 0, pc, s, 64 * si, sc);
                __syncthreads();
                chunk(
                    c, dyt, [&](int) { return ct; }, [&](int) { return stt; },
                    lm[c * MB_L + MB_L - 1], 1);
            }
        }
        return;
    }
#pragma unroll
    for (int si = 0; si < NS; ++si) mb_zero(acc[si]);
    // Chunk c's copies into stage c % 2, with exp(lam) of this thread's rows of dy (rows
    // (threadIdx.x + 256e) / 8, as mb_load_async copies them) and lam at the chunk's end.
    float erow[2], last = 0.f;
    auto issue = [&](int c) {
        const int q = c & 1;
        const int r0 = b * t + c * MB_L, r1 = r0 + min(t - c * MB_L, MB_L);
        mb_load_async(mb_tile(mb_raw, TS * q), dy, inner, r0, r1, xcol, 64);
#pragma unroll
        for (int si = 0; si < NS; ++si) {
            mb_load_async(mb_tile(mb_raw, TS * q + 1 + si), xc, conv, r0, r1, ccol + 64 * si, 64);
            mb_load_async(mb_tile(mb_raw, TS * q + 1 + NS + si), st + (size_t)c * p * s, s, 0,
                          64, 64 * si, 64);
        }
        mb_cp_commit();
#pragma unroll
        for (int e = 0; e < 2; ++e) erow[e] = __expf(lm[c * MB_L + ((threadIdx.x + 256 * e) >> 3)]);
        last = lm[c * MB_L + MB_L - 1];
    };
    issue(chunks - 1);
    for (int c = chunks - 1;; --c) {
#pragma unroll
        for (int si = 0; si < NS; ++si)
            mb_store_tile16_quad(dn + (size_t)c * p * s + 64 * si, s, acc[si]);
        if (c == 0) break;
        const int q = c & 1;
        mb_t* dyt = mb_tile(mb_raw, TS * q);
        mb_cp_wait<0>();
        // this thread's own pieces of dy times exp(lam_i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = (threadIdx.x + 256 * e) >> 3, j = (threadIdx.x & 7) * 8;
            mb_store16<mb_t>(dyt, i, j, *reinterpret_cast<const uint4*>(dyt + i * MB_LDH + j),
                             erow[e], true);
        }
        const float lc = last;
        // chunk c's tiles are in; chunk c + 1's product is done with the other stage
        __syncthreads();
        if (c > 1) issue(c - 1);
        chunk(
            c, dyt, [&](int si) { return mb_tile(mb_raw, TS * q + 1 + si); },
            [&](int si) { return mb_tile(mb_raw, TS * q + 1 + NS + si); }, lc, NS);
    }
}
// Its kernels: a state tile a block (three blocks an SM) and two (two: 123 registers).
#define MB_WALK_BWD(name, NS, BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS)                                  \
        name(const bf16_t* __restrict__ xc, const mb_t* __restrict__ dy,                        \
             const float* __restrict__ lam, const mb_t* __restrict__ states,                    \
             float* __restrict__ dlam, mb_t* __restrict__ down, int t, int heads, int p, int s, \
             int groups, int chunks) {                                                         \
        extern __shared__ __align__(16) unsigned char mb_raw[];                                \
        mb_state_walk_bwd<NS>(xc, dy, lam, states, dlam, down, t, heads, p, s, groups, chunks, \
                              mb_raw);                                                         \
    }
MB_WALK_BWD(mamba_state_walk_bwd_bf16, 1, 3)
MB_WALK_BWD(mamba_state_walk2_bwd_bf16, 2, 2)

// The backward of a chunk's own contribution to its end state (mamba_state_walk) from its
// gradient R = down[c] (mamba_state_walk_bwd's, 16-bit), for the hb heads of the block in turn:
// with w_j = exp(lam_last − lam_j)·dtv_j and v_j[p] = Σ_s R[p][s]·B_j[s], dx_j += w_j·v_j,
// dB_j[s] += w_j·Σ_p x_j[p]·R[p][s], and through w_j: ddt_j, dlam_j and dlam_last. Where hb > 1,
// dB is summed over the block's heads in shared memory (f32, rows of s + 4) and added into dxc
// once; with hb = 1 (a GPU without the shared memory for that sum) each tile is added as it
// comes. The block walks (head, 64 columns of the head, 64 of the state) with the next step's
// tiles copied (cp.async) into the other of two buffers while it multiplies this step's; B's
// tiles are copied once where the state has at most two. (Where the scan's backward takes the
// share through x, mamba_chunk_state_db takes dB instead.)
extern "C" __global__ void __launch_bounds__(256, 2)
    mamba_chunk_state_bwd_bf16(const bf16_t* __restrict__ xc, const float* __restrict__ dtv,
                               const float* __restrict__ lam, const mb_t* __restrict__ down,
                               float* __restrict__ dxc, float* __restrict__ ddt,
                               float* __restrict__ dlam, int t, int heads, int p, int s,
                               int groups, int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    // tiles 0, 1: x [j][p]; 2, 3: B [j][s]; 4, 5: R [p][s]
    float* vec = mb_vecs(mb_raw, 6);   // per head: w_j, Σ_p x_j[p]·v_j[p] [2][MB_L]
    float* dbs = vec + hb * 2 * MB_L;  // Σ_h dB_h [j][s], rows of s + 4 (hb > 1)
    const int lds = s + 4;
    const int h0 = blockIdx.y * hb;
    const MbChunk k0 = mb_chunk_of(t, heads, groups, p, s, h0);
    const int conv = heads * p + 2 * groups * s;
    const int rows = min(t - k0.t0, MB_L);
    const int r0 = (int)k0.row0, r1 = r0 + rows;
    const int bcol = heads * p + k0.g * s;
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        vec[hh * 2 * MB_L + i] = __expf(lam[pos + MB_L - 1] - lam[pos + i]) * dtv[pos + i];
        vec[hh * 2 * MB_L + MB_L + i] = 0.f;
    }
    if (hb > 1)
        for (int e = threadIdx.x; e < MB_L * lds; e += blockDim.x) dbs[e] = 0.f;
    // Step `it`: head it / (np·ns), the head's columns p0 = 64·((it / ns) % np), the state's
    // s0 = 64·(it % ns); x's tile changes with it / ns, the other two with it.
    const int np = (p + 63) / 64, ns = (s + 63) / 64, steps = hb * np * ns;
    const bool keep_b = ns <= 2;
    auto copy = [&](int it) {
        const int hh = it / (np * ns), p0 = 64 * ((it / ns) % np), si = it % ns, s0 = 64 * si;
        const int xcol = (h0 + hh) * p;
        if (si == 0)
            mb_load_async(mb_tile(mb_raw, (it / ns) & 1), xc, conv, r0, r1, xcol + p0,
                          min(64, p - p0));
        if (!keep_b || it < ns)
            mb_load_async(mb_tile(mb_raw, 2 + (keep_b ? si : it & 1)), xc, conv, r0, r1,
                          bcol + s0, min(64, s - s0));
        mb_load_async(mb_tile(mb_raw, 4 + (it & 1)),
                      down + mb_chunk_of(t, heads, groups, p, s, h0 + hh).st, s, p0, p, s0,
                      min(64, s - s0));
        mb_cp_commit();
    };
    copy(0);
    float v[4][4];
    mb_zero(v);
    for (int it = 0; it < steps; ++it) {
        if (it + 1 < steps) {
            copy(it + 1);
            mb_cp_wait<1>();
        } else {
            mb_cp_wait<0>();
        }
        __syncthreads();
        const int hh = it / (np * ns), p0 = 64 * ((it / ns) % np), si = it % ns, s0 = 64 * si;
        const int pc = min(64, p - p0), sc = min(64, s - s0);
        const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
        const int xcol = k.h * p;
        const float* w = vec + hh * 2 * MB_L;
        float* dw = vec + hh * 2 * MB_L + MB_L;
        const mb_t* t1 = mb_tile(mb_raw, (it / ns) & 1);
        const mb_t* t2 = mb_tile(mb_raw, 2 + (keep_b ? si : it & 1));
        const mb_t* t3 = mb_tile(mb_raw, 4 + (it & 1));
        // A(j, s) = B[j][s], B(s, p) = R[p][s]
        mb_mm<false, true>(v, t2, t3, 64);
        float db[4][4];
        mb_zero(db);
        // A(j, p) = x[j][p], B(p, s) = R[p][s]; dB_j += w_j·(…)
        mb_mm<false, false>(db, t1, t3, 64);
        if (hb == 1) {
            mb_red_tile(dxc + k.row0 * conv + bcol + s0, conv, db, rows, sc, w);
        } else {
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = mb_row(a, c), ss = mb_col(a, c);
                    if (ss < sc) dbs[j * lds + s0 + ss] += w[j] * db[a][c];
                }
        }
        if (si == ns - 1) {
            // v is whole: dx_j += w_j·v_j (dxc's 16 values a thread all loaded before any is
            // stored back) and Σ_p x_j[p]·v_j[p].
            float xv[4][4], old[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = mb_row(a, c), pp = mb_col(a, c);
                    xv[a][c] = mb_get(t1, j, pp) * v[a][c];
                    old[a][c] =
                        j < rows && pp < pc ? dxc[(k.row0 + j) * conv + xcol + p0 + pp] : 0.f;
                }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int j = mb_row(a, c), pp = mb_col(a, c);
                    if (j < rows && pp < pc)
                        dxc[(k.row0 + j) * conv + xcol + p0 + pp] = old[a][c] + w[j] * v[a][c];
                }
            mb_row_sums(xv, dw);
            mb_zero(v);
        }
        __syncthreads();  // (this step's buffers are the next step's copy's)
    }
    // dB of the block's heads into dxc's B columns: 16-byte reductions where aligned.
    if (hb > 1) {
        float* dst = dxc + k0.row0 * conv + bcol;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (s % 4 == 0 && conv % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
            for (int e = threadIdx.x; e < rows * (s / 4); e += blockDim.x) {
                const int j = e / (s / 4), c = 4 * (e % (s / 4));
                const float4 q = *reinterpret_cast<const float4*>(&dbs[j * lds + c]);
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                                 dst + (size_t)j * conv + c),
                             "f"(q.x), "f"(q.y), "f"(q.z), "f"(q.w)
                             : "memory");
            }
        } else
#endif
            for (int e = threadIdx.x; e < rows * s; e += blockDim.x) {
                const int j = e / s, c = e % s;
                atomicAdd(&dst[(size_t)j * conv + c], dbs[j * lds + c]);
            }
    }
    // w_j = exp(last − lam_j)·dtv_j: ddt_j += dw_j·exp(last − lam_j); q_j = dw_j·w_j goes to
    // dlam_last (+) and dlam_j (−). A warp a head.
    for (int hh = threadIdx.x >> 5; hh < hb; hh += blockDim.x >> 5) {
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        const float* w = vec + hh * 2 * MB_L;
        const float* dw = w + MB_L;
        const float last = lam[pos + MB_L - 1];
        float qs = 0.f;
        for (int j = threadIdx.x & 31; j < MB_L; j += 32) {
            const float q = dw[j] * w[j];
            ddt[pos + j] += dw[j] * __expf(last - lam[pos + j]);
            dlam[pos + j] -= q;
            qs += q;
        }
        qs = warp_sum(qs);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) dlam[pos + MB_L - 1] += qs;
    }
}

// dB's share of a chunk's own contribution to its end state, where the scan's backward took
// the rest of mamba_chunk_state_bwd's (its `down`): dB_j[s] += Σ_h w_h,j·Σ_p x_h,j[p]·R_h[p][s]
// (w_j = exp(lam_last − lam_j)·dtv_j, R = down[c]) for the hb heads of the block. Per 64
// columns of the state, the heads' products (K: a head's columns) are scaled by w and summed
// in registers, then added into dxc's B columns once (16-byte reductions on sm_90). The block
// walks (64 state columns, head, 64 head columns) with the next step's x and R tiles copied
// (cp.async) into the other of two buffers while it multiplies this step's; where a head is
// one tile and the state two (`pair`: kernels.rs's state_db_smem), it walks the heads once,
// each head's x tile copied once for both of its R tiles and its rows scaled by w in shared
// memory (six tiles of shared memory).
extern "C" __global__ void __launch_bounds__(256, 3)
    mamba_chunk_state_db_bf16(const bf16_t* __restrict__ xc, const float* __restrict__ dtv,
                              const float* __restrict__ lam, const mb_t* __restrict__ down,
                              float* __restrict__ dxc, int t, int heads, int p, int s,
                              int groups, int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    const int np = (p + 63) / 64, ns = (s + 63) / 64;
    const bool pair = np == 1 && ns == 2;
    // tiles 2q: x [j][p], 2q + 1: R [p][s] (buffer q); with `pair` 3q: x, 3q + 1..: R's two
    float* wv = mb_vecs(mb_raw, pair ? 6 : 4);  // per head: w_j [MB_L]
    const int h0 = blockIdx.y * hb;
    const MbChunk k0 = mb_chunk_of(t, heads, groups, p, s, h0);
    const int conv = heads * p + 2 * groups * s;
    const int rows = min(t - k0.t0, MB_L);
    const int r0 = (int)k0.row0, r1 = r0 + rows;
    const int bcol = heads * p + k0.g * s;
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        wv[e] = __expf(lam[pos + MB_L - 1] - lam[pos + i]) * dtv[pos + i];
    }
    if (pair) {
        // Step hh: head hh's x tile and its two R tiles.
        auto copy2 = [&](int hh) {
            if (hh < hb) {
                const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
                const int q = 3 * (hh & 1);
                mb_load_async(mb_tile(mb_raw, q), xc, conv, r0, r1, k.h * p, p);
                for (int si = 0; si < 2; ++si)
                    mb_load_async(mb_tile(mb_raw, q + 1 + si), down + k.st, s, 0, p, 64 * si,
                                  min(64, s - 64 * si));
            }
            mb_cp_commit();
        };
        copy2(0);
        float acc[2][4][4];  // Σ_h w·(x·R) of each tile of the state's columns
        mb_zero(acc[0]);
        mb_zero(acc[1]);
        for (int hh = 0; hh < hb; ++hh) {
            copy2(hh + 1);
            mb_cp_wait<1>();
            __syncthreads();
            // x's rows times w_j in the tile (then the products sum straight into acc)
            const int q = 3 * (hh & 1);
            const float* w = wv + hh * MB_L;
            mb_t* xt = mb_tile(mb_raw, q);
            for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x) {
                const int i = e >> 3, j = (e & 7) * 8;
                const uint4 u = *reinterpret_cast<const uint4*>(xt + i * MB_LDH + j);
                mb_store16<mb_t>(xt, i, j, u, w[i], true);
            }
            __syncthreads();
            // A(j, p) = w_j·x[j][p], B(p, s) = R[p][s]
            mb_mm<false, false>(acc[0], xt, mb_tile(mb_raw, q + 1), 64);
            mb_mm<false, false>(acc[1], xt, mb_tile(mb_raw, q + 2), 64);
            __syncthreads();  // (this step's buffer is step hh + 2's copy's)
        }
#pragma unroll
        for (int si = 0; si < 2; ++si)
            mb_red_tile(dxc + k0.row0 * conv + bcol + 64 * si, conv, acc[si], rows,
                        min(64, s - 64 * si), nullptr);
        return;
    }
    // Step `it`: the state's columns s0 = 64·(it / (hb·np)), head (it / np) % hb, its columns
    // p0 = 64·(it % np).
    const int steps = ns * hb * np;
    auto copy = [&](int it) {
        if (it < steps) {
            const int s0 = 64 * (it / (hb * np)), hh = (it / np) % hb, p0 = 64 * (it % np);
            const MbChunk k = mb_chunk_of(t, heads, groups, p, s, h0 + hh);
            mb_load_async(mb_tile(mb_raw, 2 * (it & 1)), xc, conv, r0, r1, k.h * p + p0,
                          min(64, p - p0));
            mb_load_async(mb_tile(mb_raw, 2 * (it & 1) + 1), down + k.st, s, p0, p, s0,
                          min(64, s - s0));
        }
        mb_cp_commit();
    };
    copy(0);
    float acc[4][4], hd[4][4];  // Σ_h w·(x·R) of the state's columns; this head's x·R
    mb_zero(acc);
    for (int it = 0; it < steps; ++it) {
        copy(it + 1);
        mb_cp_wait<1>();
        __syncthreads();
        const int s0 = 64 * (it / (hb * np)), hh = (it / np) % hb, pi = it % np;
        if (pi == 0) mb_zero(hd);
        // A(j, p) = x[j][p], B(p, s) = R[p][s]
        mb_mm<false, false>(hd, mb_tile(mb_raw, 2 * (it & 1)), mb_tile(mb_raw, 2 * (it & 1) + 1),
                            64);
        if (pi == np - 1) {
            const float* w = wv + hh * MB_L;
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[a][c] += w[mb_row(a, c)] * hd[a][c];
            if (hh == hb - 1) {
                mb_red_tile(dxc + k0.row0 * conv + bcol + s0, conv, acc, rows, min(64, s - s0),
                            nullptr);
                mb_zero(acc);
            }
        }
        __syncthreads();  // (this step's buffer is step it + 2's copy's)
    }
}

// dt's backward: da_j = Σ_{i ≥ j in the chunk} dlam_i (a warp's suffix scan over its lanes'
// pairs); ddtv_j = ddt_j + da_j·A; through the limits and softplus into dzx's dt column (bf16);
// dt_bias's gradient += Σ, A_log's += A·Σ da·dtv (a warp sum, one atomic each).
extern "C" __global__ void __launch_bounds__(128)
    mamba_dt_bwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                      const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ a_log,
                      const float* __restrict__ dtv, const float* __restrict__ ddt,
                      const float* __restrict__ dlam, bf16_t* __restrict__ dzx,
                      float* __restrict__ dbias, float* __restrict__ da_log, int b, int t, int h,
                      int chunks, int clamp, float lo, float hi) {
    MbDtLane d;
    if (!mb_dt_lane(d, b, h, chunks)) return;
    const int lane = threadIdx.x & 31;
    const float a = -__expf(to_f(a_log[d.hh])), bias = to_f(dt_bias[d.hh]);
    const float2 dl = *reinterpret_cast<const float2*>(&dlam[d.base + 2 * lane]);
    float run = dl.x + dl.y;  // inclusive suffix scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_down_sync(0xffffffffu, run, o);
        if (lane + o < 32) run += u;
    }
    const float da[2] = {run, run - dl.x};
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int i = 2 * lane + e, tt = d.c * MB_L + i;
        if (tt >= t) continue;
        sa += da[e] * dtv[d.base + i];
        float g = ddt[d.base + i] + da[e] * a;
        const size_t at = (size_t)(d.bb * t + tt) * ld + off + d.hh;
        const float u = to_f(zx[at]) + bias;
        if (clamp) {
            const float raw = softplus_f(u);
            if (raw < lo || raw > hi) g = 0.f;
        }
        g *= sigmoid_f(u);
        dzx[at] = from_f<bf16_t>(g);
        sb += g;
    }
    sa = warp_sum(sa);
    sb = warp_sum(sb);
    if (lane == 0) {
        if (dbias) atomicAdd(&dbias[d.hh], sb);
        if (da_log) atomicAdd(&da_log[d.hh], sa * a);
    }
}

// The conv's backward in one pass, from dxc (d of the SiLU's output, f32 [N, conv]): d of its
// inputs into dzx's x | B | C columns (bf16), the weight's and bias's gradients (+=, where not
// null). A thread per V channels walks ROWS rows plus KW − 1 ahead: at row q it recomputes the
// conv's output (the input window as in the forward), takes dpre_q = dxc_q·silu'(pre_q) into a
// window of the last KW, adds dpre_q's weight and bias terms (q in the block's rows; GRADS), and
// finishes d of input q − KW + 1, which feeds outputs q − KW + 1 … q of its sequence; U rows'
// loads are issued before the first of them is used. Sums added once. The walk reads its rows
// through `x` (row r0's input of channel ch, rows ldx apart, the KW − 1 before it readable
// where they are in r0's sequence) and `dx_in` (row r0's dxc, rows ldd apart), and writes d of
// the inputs from row r0 at `dst` (rows ld apart): global memory (mb_conv_bwd) or the rows a
// block copied into shared memory (mamba_conv4s_bwd).
template <int KW, int V, int U, bool GRADS>
__device__ __forceinline__ void mb_conv_bwd_walk(const bf16_t* __restrict__ x, int ldx,
                                                 const float* __restrict__ dx_in, int ldd,
                                                 bf16_t* __restrict__ dst, int ld,
                                                 const bf16_t* __restrict__ w,
                                                 const bf16_t* __restrict__ cb,
                                                 float* __restrict__ dw, float* __restrict__ db,
                                                 int ch, int r0, int r_end, int n, int t, int k) {
    MbConvTaps<KW> taps[V];
    const int q_end = min(n, r_end + k - 1);  // rows whose dpre the block's inputs feed
    float win[V][KW], dwin[V][KW], dwk[V][KW], dbs[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
        taps[v] = mb_conv_taps<KW>(w, cb, ch + v, k);
        mb_conv_prefill<KW>(win[v], x + v, ldx, r0 % t, k);
        dbs[v] = 0.f;
#pragma unroll
        for (int j = 0; j < KW; ++j) dwin[v][j] = dwk[v][j] = 0.f;
    }
    // Row pointers and positions within the sequence (of row q and of row r = q − KW + 1) step
    // with the walk: no 64-bit multiply or integer division a row.
    int tq = r0 % t, tr = ((r0 - (KW - 1)) % t + t) % t;
    const int q_stop = r_end + KW - 1;
    for (int q0 = r0; q0 < q_stop; q0 += U, x += (size_t)U * ldx, dx_in += (size_t)U * ldd) {
        float xs[U][V], ds[U][V];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (q0 + u < q_end) {
                mb_ldv<V>(x + (size_t)u * ldx, xs[u]);
                mb_ldv<V>(dx_in + (size_t)u * ldd, ds[u]);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int q = q0 + u;
            if (q >= q_stop) break;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float d = 0.f;
                if (q < q_end) d = ds[u][v] * dsilu_f(mb_conv_push<KW>(win[v], taps[v], xs[u][v], tq == 0));
#pragma unroll
                for (int j = 0; j < KW - 1; ++j) dwin[v][j] = dwin[v][j + 1];
                dwin[v][KW - 1] = d;
                if (GRADS && q < r_end) {
                    dbs[v] += d;
#pragma unroll
                    for (int j = 0; j < KW; ++j) dwk[v][j] += d * win[v][j];
                }
            }
            tq = tq + 1 == t ? 0 : tq + 1;
            if (q - (KW - 1) >= r0) {
                // input r = q − KW + 1 feeds output r + KW − 1 − j (dwin[KW − 1 − j]) through
                // tap j, within its sequence
                const int left = t - 1 - tr;
                float dx[V];
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    dx[v] = 0.f;
#pragma unroll
                    for (int j = 0; j < KW; ++j)
                        if (KW - 1 - j <= left) dx[v] += taps[v].w[j] * dwin[v][KW - 1 - j];
                }
                mb_stv<V>(dst, dx);
                dst += ld;
            }
            tr = tr + 1 == t ? 0 : tr + 1;
        }
    }
    if constexpr (GRADS) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            if (dw) {
#pragma unroll
                for (int j = 0; j < KW; ++j)
                    if (j >= KW - k) atomicAdd(&dw[(ch + v) * k + j - (KW - k)], dwk[v][j]);
            }
            if (db) atomicAdd(&db[ch + v], dbs[v]);
        }
    }
}
// KW 4 and 8 as in the forward, a channel a thread (MB_CONV_ROWS), straight from global memory.
template <int KW, int V, int ROWS, int U>
__device__ __forceinline__ void mb_conv_bwd(const bf16_t* __restrict__ zx, int ld, int off,
                                            const bf16_t* __restrict__ w,
                                            const bf16_t* __restrict__ cb,
                                            const float* __restrict__ dxc,
                                            bf16_t* __restrict__ dzx, float* __restrict__ dw,
                                            float* __restrict__ db, int n, int t, int conv,
                                            int k) {
    const int ch = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (ch >= conv) return;
    const int r0 = blockIdx.y * ROWS, r_end = min(n, r0 + ROWS);
    const size_t at = (size_t)r0 * ld + off + ch;
    mb_conv_bwd_walk<KW, V, U, true>(zx + at, ld, dxc + (size_t)r0 * conv + ch, conv, dzx + at,
                                     ld, w, cb, dw, db, ch, r0, r_end, n, t, k);
}
#define MB_CONV_BWD(name, KW, V, THREADS, ROWS, U)                                               \
    extern "C" __global__ void __launch_bounds__(THREADS)                                       \
        name(const bf16_t* __restrict__ zx, int ld, int off, const bf16_t* __restrict__ w,     \
             const bf16_t* __restrict__ cb, const float* __restrict__ dxc,                     \
             bf16_t* __restrict__ dzx, float* __restrict__ dw, float* __restrict__ db, int n,  \
             int t, int conv, int k) {                                                         \
        mb_conv_bwd<KW, V, ROWS, U>(zx, ld, off, w, cb, dxc, dzx, dw, db, n, t, conv, k);       \
    }
MB_CONV_BWD(mamba_conv_bwd_bf16, 8, 1, 128, MB_CONV_ROWS, 4)
MB_CONV_BWD(mamba_conv4_bwd_bf16, 4, 1, 128, MB_CONV_ROWS, 4)

// KW 4 through shared memory: a block of MB_CONV_SCH channels and MB_CONV_SROWS rows first
// copies the rows it reads — its rows' inputs with the KW − 1 before and after them, their dxc
// with the KW − 1 after — by cp.async in one go (52 KB in flight a block, where a warp of the
// vector build it replaced, 4 channels a thread, had its next 4 rows' 3 KB), then walks them
// there, MB_CONV_SPLIT threads a
// channel, each over its share of the rows (one walker a channel left too few warps an SM to
// hide the walk's dependent steps: 107 µs a call against the vector build's 109). Gradients of
// the weight and bias only where they train (a LoRA run's conv is frozen). Where the shapes
// allow (mamba.rs's conv_vec) and the GPU gives a block the shared memory (kernels.rs's
// CONV_SMEM).
#define MB_CONV_SCH 128
#define MB_CONV_SROWS 64
#define MB_CONV_SPLIT 2
// Rows r_lo .. r_lo + rows − 1 of columns c0 .. c0 + MB_CONV_SCH − 1 of `src` (row stride ld)
// into dst [rows][MB_CONV_SCH] by cp.async (the caller commits), zeros for rows outside
// [0, n) and columns past `cols`; 16-byte pieces (cols, ld and c0 multiples of 16 bytes).
template <typename T>
__device__ __forceinline__ void mb_conv_rows_async(T* dst, const T* __restrict__ src, int ld,
                                                   int c0, int r_lo, int rows, int n, int cols) {
    constexpr int P = MB_CONV_SCH * (int)sizeof(T) / 16, E = 16 / (int)sizeof(T);
    for (int e = threadIdx.x; e < rows * P; e += blockDim.x) {
        const int i = e / P, j = e % P * E, r = r_lo + i;
        const bool in = r >= 0 && r < n && c0 + j < cols;
        mb_cp16(dst + i * MB_CONV_SCH + j, in ? src + (size_t)r * ld + c0 + j : src, in);
    }
}
extern "C" __global__ void __launch_bounds__(MB_CONV_SCH * MB_CONV_SPLIT)
    mamba_conv4s_bwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                          const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                          const float* __restrict__ dxc, bf16_t* __restrict__ dzx,
                          float* __restrict__ dw, float* __restrict__ db, int n, int t, int conv,
                          int k) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    constexpr int KW = 4, H = KW - 1, SCH = MB_CONV_SCH, XR = MB_CONV_SROWS + 2 * H;
    constexpr int DR = MB_CONV_SROWS + H;
    bf16_t* xs = reinterpret_cast<bf16_t*>(mb_raw);                // [XR][SCH]: rows r0 − H ..
    float* ds = reinterpret_cast<float*>(mb_raw + XR * SCH * 2);  // [DR][SCH]: rows r0 ..
    const int c0 = blockIdx.x * SCH, r0 = blockIdx.y * MB_CONV_SROWS;
    const int r_end = min(n, r0 + MB_CONV_SROWS);
    mb_conv_rows_async(xs, zx + off, ld, c0, r0 - H, XR, n, conv);
    mb_conv_rows_async(ds, dxc, conv, c0, r0, DR, n, conv);
    mb_cp_commit();
    mb_cp_wait<0>();
    __syncthreads();
    constexpr int PART = MB_CONV_SROWS / MB_CONV_SPLIT;
    const int c = threadIdx.x % SCH, i0 = threadIdx.x / SCH * PART, ch = c0 + c;
    const int w0 = r0 + i0, w_end = min(r_end, w0 + PART);  // this walker's rows
    if (ch >= conv || w0 >= w_end) return;
    const bf16_t* x = xs + (H + i0) * SCH + c;
    const float* d = ds + i0 * SCH + c;
    bf16_t* dst = dzx + (size_t)w0 * ld + off + ch;
    if (dw != nullptr || db != nullptr)
        mb_conv_bwd_walk<KW, 1, 4, true>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, ch, w0, w_end,
                                         n, t, k);
    else
        mb_conv_bwd_walk<KW, 1, 4, false>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, ch, w0, w_end,
                                          n, t, k);
}

// The conv's forward (KW 4) through shared memory, as mamba_conv4s_bwd: a block of
// MB_CONV_SCH channels × MB_CONV_SROWS rows copies its rows' inputs and the KW − 1 before them
// by cp.async in one go, then each thread walks its channel there (mb_conv_fwd's walk).
extern "C" __global__ void __launch_bounds__(MB_CONV_SCH)
    mamba_conv4s_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                          const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                          bf16_t* __restrict__ xc, int n, int t, int conv, int k) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    constexpr int KW = 4, H = KW - 1, SCH = MB_CONV_SCH;
    bf16_t* xs = reinterpret_cast<bf16_t*>(mb_raw);  // [SROWS + H][SCH]: rows r0 − H ..
    const int c0 = blockIdx.x * SCH, r0 = blockIdx.y * MB_CONV_SROWS;
    const int r_end = min(n, r0 + MB_CONV_SROWS);
    mb_conv_rows_async(xs, zx + off, ld, c0, r0 - H, MB_CONV_SROWS + H, n, conv);
    mb_cp_commit();
    mb_cp_wait<0>();
    __syncthreads();
    const int ch = c0 + threadIdx.x;
    if (ch >= conv) return;
    mb_conv_walk<KW>(xs + H * SCH + threadIdx.x, SCH, w, cb, xc + (size_t)r0 * conv + ch, conv,
                     ch, r0, r_end, t, k);
}
