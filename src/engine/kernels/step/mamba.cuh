// The Mamba-2 mixer of a hybrid's Mamba layers (launched by mamba.rs): the depthwise causal
// conv1d + SiLU, dt's softplus and its cumulative sum × A per chunk, the selective scan by
// state-space duality in chunks of MB_L positions (a chunk's own outputs as masked, decayed
// C·Bᵀ products; the state carried between chunks in fp32), and the gated RMSNorm; forward and
// backward. Part of the whole-model step's kernels: included by ../kernels.cu after swiglu.cuh
// and qk_norm.cuh (sigmoid_f, qkw_block_sum).
//
// This file holds what the family shares — the layouts below, the tiles and their products, the
// loads, the chunk grid; the kernels are in the files ../kernels.cu includes after it, in this
// order: mamba_conv.cuh (the conv, forward and backward), mamba_dt.cuh (dt and lam, forward and
// backward), mamba_scan.cuh (a chunk's C·Bᵀ and outputs, and their backward), mamba_state.cuh
// (the states passed between chunks, their backward, and dB's share of them) and
// mamba_gnorm.cuh (the gated RMSNorm, forward and backward).
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

// Packed rows (`starts`: each slot's sample start within its row, [B·T], as flash attention
// reads them; null where the rows are not packed): each sample's conv window and scan state
// begin again at its first position, so that no position reads another sample's inputs (the
// per-op model's ssd::SampleResets). For a chunk that starts at position t0 of row b,
// mb_from(…, i) is where chunk position i's sample starts relative to t0, −1 where it starts
// before the chunk (always, unpacked; positions past T continue the last sample). Of what the
// scan's products carry, the chunk kernels keep:
// - within the chunk, source j's input in position i's output where j ≥ from(i);
// - the state before the chunk in position i's output where from(i) < 0;
// - position j's input in the chunk's end state where j ≥ from(MB_L − 1);
// - the state before the chunk past its end where from(MB_L − 1) < 0;
// and their backward the same terms (a dropped term's gradients are dropped with it).
__device__ __forceinline__ int mb_from(const int* __restrict__ starts, int b, int t, int t0,
                                       int i) {
    return starts ? max(starts[(size_t)b * t + min(t0 + i, t - 1)] - t0, -1) : -1;
}

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
