// Causal flash attention (FlashAttention-2 style) for head dims 64, 128 and 256, bf16 in/out,
// fp32 accumulate; at 256 (Gemma's heads) with Gemma 2's attention soft-cap.
// Tensor cores through mma.sync.m16n8k16 (bf16 or fp16), ldmatrix and cp.async (built as PTX
// for compute_80, JIT-ed on Hopper); the fp16 build for compute_75 (T4) replaces the last two
// (see fa_cp_async16 and fa_mma).
//
// One file on purpose (about 1,600 lines): one kernel family — the forward and backward at every
// head dim share the tile loaders, the mma wrappers, the forward's per-tile softmax and epilogue
// (FaFwdRows, which flash_sm90.cu's forward uses too) and the launch contract below.
//
// ============================== LAUNCH CONTRACT ==============================================
// Head dim D = 64 (the kernels without a suffix), 128 (the `_d128` kernels) or 256 (`_d256`),
// same arguments (their dynamic shared memory is given below). scale (the score scale, 1/sqrt(D)
// or the model's) is passed in. T may be any value >= 1. cap: the attention soft-cap (scores ->
// cap·tanh(scale·s/cap) before the softmax) where cap > 0, read by the D = 256 kernels only (the
// others take 0).
// Grouped-query attention: H query heads share KVH key/value heads (KVH divides H; query head h
// reads key/value head h / (H / KVH)); KVH = H is plain multi-head attention.
// Layouts (row-major, contiguous):
//   qkv  [B, T, H + 2·KVH, D] bf16 (q heads, then k heads, then v heads)
//   o, dout [B, T, H, D] bf16     lse [B, H, T] f32 (natural log)
//   dqkv like qkv (every element written by the backward)
// Let NB = ceil(T / 64). The D = 64 kernels use static shared memory only (<= 48 KB, dynamic
// shared memory bytes = 0). The D = 128 forward and main backward kernel use dynamic shared
// memory above 48 KB: the launcher sets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first.
//
// FORWARD (one launch):
//   flash_fwd_bf16(const bf16* qkv, bf16* o, float* lse, int B, int T, int H, int KVH, float scale,
//                  const u64* seed, u32 site, u32 thr, float dscale, u16* mbits,
//                  const int* starts, float cap)
//     Dropout of the probabilities where thr > 0 (kernels.cu's attention layout, the seed read
//     from the device): the kept-flags go to mbits, one u64 per (query row, 64-key tile),
//     [B·H·T, ceil(T/64)], bit 16·t4 + 2·nt + e of key 8·nt + 2·t4 + e; lse is of the
//     undropped probabilities. thr = 0: no dropout, seed and mbits unused (may be null).
//     grid = (B*H, NB, 1), block = (128, 1, 1), dynamic smem = 0   (static smem 40 KB)
//     flash_fwd[_drop]_d128_bf16: same grid and block, dynamic smem = FA_FWD_D128_SMEM (80 KB)
//     flash_fwd[_drop]_d256_bf16: same grid and block, dynamic smem = FA_FWD_D256_SMEM (160 KB)
//     (lse of the capped scores where cap > 0)
//
// BACKWARD (three launches, in this order, same stream):
//   scratch: one f32 buffer of B*T16*H*D + B*H*T floats (T16 = T rounded up to 16); need NOT
//   be zeroed (kernel 1 does it).
//     dq_acc = scratch                      (B*T16*H*D floats: layout [B, T, H, D] here, Hopper's
//                                            slabs in flash_sm90.cu's flash_bwd_ws)
//     delta  = scratch + B*T16*H*D          (B*H*T floats,   layout [B, H, T])
//   1. flash_bwd_preprocess_bf16(const bf16* o, const bf16* dout, float* delta, float* dq_acc,
//                                int B, int T, int H)
//        grid = (ceil(B*T16*H / 32), 1, 1), block = (256, 1, 1), dynamic smem = 0
//        delta = rowsum(o * dout); zeroes dq_acc's B*T16*H*D floats.
//   2. flash_bwd_bf16(const bf16* qkv, const bf16* dout, const float* lse, const float* delta,
//                     float* dq_acc, bf16* dqkv, int B, int T, int H, int KVH, float scale,
//                     u32 thr, float dscale, const u64* mbits, const int* starts,
//                     float cap, bf16* kv_part)
//        (dropout: the forward's kept-flags; delta stays rowsum(o * dout))
//        grid = (B*KVH, NB, 1), block = (128, 1, 1), dynamic smem = 0   (static smem 40 KB)
//        parallel over key blocks of 64 of one key/value head, looping over the H/KVH query
//        heads that share it (dk, dv summed in registers, no atomics); writes dk, dv into dqkv;
//        dq accumulated by fp32 atomics into dq_acc. (This is the default build, FA_BWD_NW = 4. Built with -DFA_BWD_NW=8 the
//        contract becomes grid = (B*H, ceil(T/128), 1), block = (256, 1, 1), static smem 48 KB.)
//        flash_bwd_d128_bf16: grid = (B*KVH, NB, 1), block = (128, 1, 1), dynamic smem =
//        FA_BWD_D128_SMEM (104 KB); K and V stay in shared memory (see the kernel).
//        flash_bwd_d256_bf16: grid = (B*H, NB, 1) (one query head a block), block = (256, 1, 1),
//        dynamic smem = FA_BWD_D256_SMEM (200 KB). Where KVH < H its dK, dV shares go to
//        kv_part (bf16 [B, T, H, 2, D]) and
//   2b. flash_bwd_kv_sum_d256_bf16(const bf16* kv_part, bf16* dqkv, int B, int T, int H, int KVH)
//        grid = (ceil(B*T*KVH*2*D/8 / 256), 1, 1), block = (256, 1, 1), dynamic smem = 0
//        sums them per key/value head into dqkv. (kv_part: the last argument of every main
//        backward kernel; read by the D = 256 one only, where KVH < H.)
//   3. flash_bwd_dq_convert_bf16(const float* dq_acc, bf16* dqkv, int B, int T, int H, int KVH,
//                                float scale)
//        grid = (ceil(B*T*H*D/4 / 256), 1, 1), block = (256, 1, 1), dynamic smem = 0
//        dq = scale * dq_acc -> bf16 into the q slot of dqkv. (After flash_bwd_ws:
//        flash_bwd_dq_convert_ws[_d128]_bf16, grid = (B*H*(T16/16)*(D/64), 1, 1), same block.)
// Sizes: row offsets are computed in size_t; kernel 3 indexes float4s with int, so
// B*T*H*D/4 < 2^31 (B*H*T < 1.3e8 at D = 64, 6.7e7 at D = 128). Grid y = NB <= 65535 (T <= 4M).
// Grid x = b*H + h runs fastest so that the heaviest tiles (blockIdx.y == 0) are all issued first.
// Alignment: every pointer must be 16-byte aligned (16-byte vector loads/stores and cp.async);
// cudarc allocations are; sub-slices must start at multiples of 8 bf16 / 4 f32 elements.
// The backward needs o and lse exactly as written by flash_fwd_bf16 with the same scale.
// Resources (sm_90, ptxas 13.0): fwd 128 regs (launch bounds 128x4); bwd 255 regs (launch bounds
// 128x2, 2 blocks/SM), no spills. D = 128: fwd 225 regs (drop 252), bwd 255, no spills; two
// blocks per SM (launch bounds 128x2).
// Measured on H100 (B=8, T=1024, H=12, PTX JIT): fwd 0.058 ms; bwd (3 kernels) 0.203 ms =
// preprocess 0.024 + main 0.167 + dq_convert 0.015 (was 0.265 = 0.025 + 0.228 + 0.015).
// =============================================================================================

#ifndef COCKPIT_FLASH_CU
#define COCKPIT_FLASH_CU

#include <cuda_bf16.h>
#include <stdint.h>

#include "flash_smem.h"

// The operand type of the mma: bf16, or fp16 in kernels.cu's COCKPIT_F16 build (where
// __nv_bfloat16 names __half).
#ifdef COCKPIT_F16
#define FA_AB "f16"
#else
#define FA_AB "bf16"
#endif

#define FA_D 64        // head dim (compile-time; the kernels are written for exactly 64)
#define FA_BM 64       // query rows per tile
#define FA_BN 64       // key rows per tile
#define FA_THREADS 128 // 4 warps, 16 rows each

static_assert(FA_D == 64 && FA_BM == 64 && FA_BN == 64, "flash.cu is written for 64x64 tiles, D=64");

// ---------------------------------------------------------------------------------------------
// helpers
__device__ __forceinline__ uint32_t fa_smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// byte offset of element (row, col) in a tile of D bf16 columns: 2D-byte rows, 16-byte chunks
// XOR-swizzled (the low three chunk bits with the row's low three bits: the 8 rows an ldmatrix
// reads hit 8 different 16-byte bank groups)
template <int D = 64>
__device__ __forceinline__ uint32_t fa_swz(int row, int col) {
    return (uint32_t)(row * (2 * D) + ((((col >> 3) ^ (row & 7))) << 4) + ((col & 7) << 1));
}

// The module is also built for compute_75 (T4-class GPUs), which has no cp.async and no bf16
// mma: there a copy is a plain 16-byte load and shared store (done when the call returns, so
// commit and wait have nothing left to do: every wait is followed by the barrier that makes the
// tile visible to the other warps, as cp.async needs too), and the fp16 build (COCKPIT_F16) runs
// its m16n8k16 products as two m16n8k8 ones (fa_mma). The bf16 build's flash kernels trap there;
// nothing launches them below compute capability 8.0.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FA_SM75 1
#else
#define FA_SM75 0
#endif

__device__ __forceinline__ void fa_cp_async16(uint32_t dst, const void* src, bool pred) {
#if FA_SM75
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (pred) v = *reinterpret_cast<const uint4*>(src);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
#else
    const int sz = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz)
                 : "memory");
#endif
}
__device__ __forceinline__ void fa_cp_commit() {
#if !FA_SM75
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void fa_cp_wait_all() {
#if !FA_SM75
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void fa_ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void fa_ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                             uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// c[4] += a[4] (16x16 bf16, row) * b (16x8 bf16, col)
// compute_75 (fp16 only): the same product as two m16n8k8 over the halves of k — A's registers
// {a0, a1} hold k 0–7 of rows g and g+8 and {a2, a3} k 8–15, B's b0 and b1 the same halves, and
// the accumulator's layout is the same for both shapes.
__device__ __forceinline__ void fa_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if FA_SM75 && defined(COCKPIT_F16)
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[2]), "r"(a[3]), "r"(b1));
#elif FA_SM75
    __trap();
#else
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32." FA_AB "." FA_AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of element (row, col) in a 64-row tile of D columns: fa_swz's layout, or with
// PANELS the tile as D / 64 panels of 64 columns (8 KB each, one after the other), each in
// fa_swz<64>'s — the layout Hopper's wgmma reads with its 128-byte swizzle (the same for D = 64).
template <int D, bool PANELS>
__device__ __forceinline__ uint32_t fa_tile_off(int row, int col) {
    if (PANELS) return (uint32_t)(col >> 6) * (64 * 64 * 2) + fa_swz<64>(row, col & 63);
    return fa_swz<D>(row, col);
}

// Load a 64-row x D-col bf16 tile (rows row0..row0+63 of a matrix with leading dim ld, whose
// column 0 is at g) into a swizzled smem tile (fa_tile_off's layout); rows >= T are zero-filled.
// 128 threads.
// A thread keeps its 16-byte column and steps FA_THREADS / (D / 8) rows a copy, its source one
// add from the last (a 64-bit multiply and select a copy before: about 50 of the forward's ~330
// instructions a key tile at head dim 64). U: how far the loop unrolls — 1 for flash_bwd_ws's
// copy warpgroup, whose 24–32 registers the unrolled loop's addresses spilled out of.
template <int D = 64, bool PANELS = false, int U = 64 * D / 8 / FA_THREADS>
__device__ __forceinline__ void fa_load_tile(uint32_t s, const __nv_bfloat16* g, int ld, int row0,
                                             int T, int tid) {
    constexpr int CH = D / 8, RS = FA_THREADS / CH;  // 16-byte chunks a row; rows a pass
    const int c = tid % CH, r0 = tid / CH;
    const __nv_bfloat16* src = g + (size_t)(row0 + r0) * ld + c * 8;
    const size_t step = (size_t)RS * ld;
    if (row0 + 64 <= T) {  // (every tile but a sequence's last: no row tests)
#pragma unroll U
        for (int k = 0; k < 64 / RS; ++k) {
            fa_cp_async16(s + fa_tile_off<D, PANELS>(r0 + k * RS, c * 8), src, true);
            src += step;
        }
        return;
    }
#pragma unroll U
    for (int k = 0; k < 64 / RS; ++k) {
        const bool ok = row0 + r0 + k * RS < T;
        fa_cp_async16(s + fa_tile_off<D, PANELS>(r0 + k * RS, c * 8), ok ? src : g, ok);
        src += step;
    }
}

// A fragments (16 rows starting at row0, 16 cols starting at col0) of a row-major smem tile.
template <int D = 64>
__device__ __forceinline__ void fa_ldA(uint32_t s, int row0, int col0, int lane, uint32_t* a) {
    fa_ldsm_x4(s + fa_swz<D>(row0 + (lane & 7) + ((lane >> 3) & 1) * 8, col0 + (lane >> 4) * 8), a[0],
               a[1], a[2], a[3]);
}
// B fragments for two n-tiles (n0..n0+15) x k (k0..k0+15) where the smem tile is stored [n][k].
template <int D = 64>
__device__ __forceinline__ void fa_ldB_nk(uint32_t s, int n0, int k0, int lane, uint32_t& b0,
                                          uint32_t& b1, uint32_t& b2, uint32_t& b3) {
    fa_ldsm_x4(s + fa_swz<D>(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8), b0, b1,
               b2, b3);
}
// B fragments for two n-tiles (n0..n0+15) x k (k0..k0+15) where the smem tile is stored [k][n].
template <int D = 64>
__device__ __forceinline__ void fa_ldB_kn(uint32_t s, int k0, int n0, int lane, uint32_t& b0,
                                          uint32_t& b1, uint32_t& b2, uint32_t& b3) {
    fa_ldsm_x4_t(s + fa_swz<D>(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8), b0,
                 b1, b2, b3);
}
// A fragments (16 rows m0.., 16 cols k0..) of A where the smem tile stores A^T, i.e. [k][m].
template <int D = 64>
__device__ __forceinline__ void fa_ldA_t(uint32_t s, int m0, int k0, int lane, uint32_t* a) {
    fa_ldsm_x4_t(s + fa_swz<D>(k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8), a[0],
                 a[1], a[2], a[3]);
}

// O's accumulator rows rescaled by a new running maximum (al0 for a thread's first row, al1 for
// its second: the forward's online softmax).
template <int N>
__device__ __forceinline__ void fa_rescale(float (&oacc)[N][4], float al0, float al1) {
#pragma unroll
    for (int nt = 0; nt < N; ++nt) {
        oacc[nt][0] *= al0;
        oacc[nt][1] *= al0;
        oacc[nt][2] *= al1;
        oacc[nt][3] *= al1;
    }
}

// The 16-bit A fragments (mma.sync's layout) of k-step kc (columns 16kc..16kc+15) of an
// accumulator tile: a 16-row block of P (the forward's P V) or of P^T or dS^T (the backward's
// dV += P^T dO, dK += dS^T Q) as an A operand.
template <int N>
__device__ __forceinline__ void fa_frag(const float (&x)[N][4], int kc, uint32_t (&a)[4]) {
    a[0] = fa_pack(x[2 * kc][0], x[2 * kc][1]);
    a[1] = fa_pack(x[2 * kc][2], x[2 * kc][3]);
    a[2] = fa_pack(x[2 * kc + 1][0], x[2 * kc + 1][1]);
    a[3] = fa_pack(x[2 * kc + 1][2], x[2 * kc + 1][3]);
}

// Stores the A fragments `a` (fa_frag's) of a 16-row block into a swizzled 64-column tile
// (generic pointer): rows lr0 and lr1 = lr0 + 8, columns c, c + 1 and c + 8, c + 9 (c: the
// fragment's first column plus 2·t4) — dS^T on its way to dQ's product.
__device__ __forceinline__ void fa_store_frag(char* tile, const uint32_t (&a)[4], int lr0, int lr1,
                                              int c) {
    *reinterpret_cast<uint32_t*>(tile + fa_swz(lr0, c)) = a[0];
    *reinterpret_cast<uint32_t*>(tile + fa_swz(lr1, c)) = a[1];
    *reinterpret_cast<uint32_t*>(tile + fa_swz(lr0, c + 8)) = a[2];
    *reinterpret_cast<uint32_t*>(tile + fa_swz(lr1, c + 8)) = a[3];
}

// The forward's products on mma.sync (every build): the warp's Q fragments are read from shared
// memory once, at the first key tile, and kept in registers; K and V fragments through ldmatrix.
struct FaFwdSync {
    static constexpr bool PANELS = false;  // fa_swz's tiles, for ldmatrix
    // (Head dim 256: the 16 x 256 accumulator of O takes 128 registers a thread, so the Q
    // fragments are read from shared memory at each tile instead of kept.)
    template <int D>
    static constexpr bool KEEP_Q = D <= 128;
    template <int D>
    struct State {
        uint32_t qf[KEEP_Q<D> ? D / 16 : 1][4];
    };
    // s = Q K^T: the warp's 16 query rows x the tile's 64 keys (mma.sync's accumulator layout);
    // j: the tile's place in the block's loop (0: the first, which loads the Q fragments)
    template <int D>
    static __device__ __forceinline__ void scores(State<D>& st, float (&s)[8][4], uint32_t sQa,
                                                  uint32_t kb, int j, int warp, int lane) {
        constexpr int KC = D / 16;
        if (KEEP_Q<D> && j == 0) {
#pragma unroll
            for (int kc = 0; kc < (KEEP_Q<D> ? KC : 0); ++kc)
                fa_ldA<D>(sQa, warp * 16, kc * 16, lane, st.qf[kc]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            uint32_t qa[4];
            if constexpr (!KEEP_Q<D>) fa_ldA<D>(sQa, warp * 16, kc * 16, lane, qa);
            const uint32_t* q = KEEP_Q<D> ? st.qf[KEEP_Q<D> ? kc : 0] : qa;
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t b0, b1, b2, b3;
                fa_ldB_nk<D>(kb, np * 16, kc * 16, lane, b0, b1, b2, b3);
                fa_mma(s[2 * np], q, b0, b1);
                fa_mma(s[2 * np + 1], q, b2, b3);
            }
        }
    }
    // oacc += P V (P: the probabilities in s, packed to 16 bits)
    template <int D>
    static __device__ __forceinline__ void values(float (&oacc)[D / 8][4], const float (&s)[8][4],
                                                  uint32_t vb, int lane) {
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
            uint32_t pa[4];
            fa_frag(s, kc, pa);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t b0, b1, b2, b3;
                fa_ldB_kn<D>(vb, kc * 16, dp * 16, lane, b0, b1, b2, b3);
                fa_mma(oacc[2 * dp], pa, b0, b1);
                fa_mma(oacc[2 * dp + 1], pa, b2, b3);
            }
        }
    }
    // (synchronous products: nothing in flight, nothing to publish)
    template <int N>
    static __device__ __forceinline__ void settle(float (&)[N][4]) {}
    static __device__ __forceinline__ void publish() {}
};

// A forward block's head: its query block qb (the grid's last first: the heaviest causal blocks
// start first), (b, h) = bh, the qkv row stride ld = HD + 2 KD, the head's q columns of batch b
// (qg) and its key/value head's k columns from them (koff; v: + KD). flash_fwd's and
// flash_fwd_ws's (flash_sm90.cu).
struct FaFwdBlock {
    int qb, bh, b, h, HD, KD, ld, koff;
    const __nv_bfloat16* qg;
    __device__ __forceinline__ FaFwdBlock(const __nv_bfloat16* qkv, int T, int H, int KVH, int D) {
        qb = gridDim.y - 1 - blockIdx.y;
        bh = blockIdx.x;
        b = bh / H;
        h = bh - b * H;
        HD = H * D;
        KD = KVH * D;
        ld = HD + 2 * KD;
        qg = qkv + (size_t)b * T * ld + h * D;
        koff = HD + (h / (H / KVH) - h) * D;
    }
};

// A thread's two query rows of the forward (row0, and row1 = row0 + 8, of its warp's 16) over
// the key tiles: their online softmax's running max m (score units) and sum l, and what the
// mask and dropout read. flash_fwd's and flash_fwd_ws's (flash_sm90.cu) per-tile softmax and
// epilogue.
struct FaFwdRows {
    int row0, row1, T, t4, bh, st0, st1;
    float scale, sl2, cap;
    uint32_t site;
    unsigned long long sd;
    uint32_t thr;
    float dscale;
    uint16_t* mbits;
    int nkt;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    // Key tile j's scores s (the warp's 16 x 64 accumulator block) into probabilities in place:
    // the soft-cap (CAP), the mask where `edge` (the diagonal tile, the sequence's last, or one
    // reaching below a row's lowest key), the running max and sum, dropout (DROP). Returns
    // whether a row of the warp moved its max; O is then scaled by al0 / al1 (1 elsewhere).
    template <bool DROP, bool CAP>
    __device__ __forceinline__ bool probs(float (&s)[8][4], int j, bool edge, float& al0,
                                          float& al1) {
        if (CAP && cap > 0.f) {
            const float in = scale / cap, out = cap / scale;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = out * tanhf(s[nt][e] * in);
        }
        const int kbase = j * FA_BN;
        if (edge) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = kbase + nt * 8 + t4 * 2 + e;
                    if (col > row0 || col >= T || col < st0) s[nt][e] = -INFINITY;
                    if (col > row1 || col >= T || col < st1) s[nt][2 + e] = -INFINITY;
                }
        }

        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // The running max moves only when the tile's rises past it by more than 2^8 in the
        // exponentials (log2 units): below that P stays <= 256 (bf16 keeps its relative
        // precision, O and l their fp32 range) and O, l need no rescale — on most tiles of a long
        // row none does, and the warp skips the rescale below (FlashAttention-4's trick; O / l
        // and lse = m + log l are the same either way).
        const bool up0 = mx0 * sl2 > m0 * sl2 + 8.f, up1 = mx1 * sl2 > m1 * sl2 + 8.f;
        al0 = 1.f;
        al1 = 1.f;
        if (up0) {
            al0 = exp2f((m0 - mx0) * sl2);
            m0 = mx0;
            l0 *= al0;
        }
        if (up1) {
            al1 = exp2f((m1 - mx1) * sl2);
            m1 = mx1;
            l1 *= al1;
        }
        const bool rescale = __any_sync(0xffffffffu, up0 || up1);
        const float ms0 = (m0 == -INFINITY) ? 0.f : m0 * sl2;
        const float ms1 = (m1 == -INFINITY) ? 0.f : m1 * sl2;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            s[nt][0] = exp2f(fmaf(s[nt][0], sl2, -ms0));
            s[nt][1] = exp2f(fmaf(s[nt][1], sl2, -ms0));
            s[nt][2] = exp2f(fmaf(s[nt][2], sl2, -ms1));
            s[nt][3] = exp2f(fmaf(s[nt][3], sl2, -ms1));
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
        if (DROP) {  // dropout after the row sums: the normaliser is of the undropped row
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const unsigned long long r = (unsigned long long)bh * T + (hf ? row1 : row0);
                const Philox4 c0 = philox4x32_10((uint32_t)r, (uint32_t)(r >> 32),
                                                 8 * j + 2 * t4, site, (uint32_t)sd,
                                                 (uint32_t)(sd >> 32));
                const Philox4 c1 = philox4x32_10((uint32_t)r, (uint32_t)(r >> 32),
                                                 8 * j + 2 * t4 + 1, site, (uint32_t)sd,
                                                 (uint32_t)(sd >> 32));
                uint32_t bits = 0;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const uint32_t u = philox_u16(nt < 4 ? c0 : c1, 2 * (nt & 3) + e);
                        const bool keep = u >= thr;
                        bits |= (keep ? 1u : 0u) << (2 * nt + e);
                        s[nt][2 * hf + e] = keep ? s[nt][2 * hf + e] * dscale : 0.f;
                    }
                if ((hf ? row1 : row0) < T) mbits[((size_t)r * nkt + j) * 4 + t4] = (uint16_t)bits;
            }
        }

        return rescale;
    }

    // The end: lse of the rows, and O / l (bf16) into o ([B, T, H·D]; batch b, head h, the
    // warpgroup's first query qw), staged through the warp's 16 rows of the tile at stage
    // (fa_tile_off's layout) for 16-byte stores.
    template <int D, bool PANELS>
    __device__ __forceinline__ void store(const float (&oacc)[D / 8][4], float* __restrict__ lse,
                                          __nv_bfloat16* __restrict__ o, int b, int h, int HD,
                                          int qw, char* stage, int warp, int lane) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const float inv0 = 1.f / l0, inv1 = 1.f / l1;
        if (t4 == 0) {
            if (row0 < T) lse[(size_t)bh * T + row0] = m0 * scale + logf(l0);
            if (row1 < T) lse[(size_t)bh * T + row1] = m1 * scale + logf(l1);
        }
        const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<uint32_t*>(stage + fa_tile_off<D, PANELS>(lr0, nt * 8 + t4 * 2)) =
                fa_pack(oacc[nt][0] * inv0, oacc[nt][1] * inv0);
            *reinterpret_cast<uint32_t*>(stage + fa_tile_off<D, PANELS>(lr1, nt * 8 + t4 * 2)) =
                fa_pack(oacc[nt][2] * inv1, oacc[nt][3] * inv1);
        }
        __syncwarp();
        constexpr int CH = D / 8;  // 16-byte chunks per row
#pragma unroll
        for (int k = 0; k < 16 * CH / 32; ++k) {
            const unsigned idx = lane + k * 32;
            const int r = idx / CH, c = idx % CH;
            const int grow = qw + warp * 16 + r;
            if (grow < T)
                *reinterpret_cast<uint4*>(o + ((size_t)b * T + grow) * HD + h * D + c * 8) =
                    *reinterpret_cast<const uint4*>(stage +
                                                    fa_tile_off<D, PANELS>(warp * 16 + r, c * 8));
        }
    }
};

// ---------------------------------------------------------------------------------------------
// Forward. Block = 64 query rows of one (b, h); warp w owns rows 16w..16w+15. K/V tiles of 64
// keys are double-buffered through shared memory with cp.async; tiles above the diagonal are
// skipped. Heavy (late) query blocks are scheduled first. Head dim D (64 or 128); shared memory
// `sm` holds Q [64][D], K [2][64][D] and V [2][64][D] (5·64·D bf16). MM runs the two products of a
// tile, S = Q K^T and O += P V: FaFwdSync below (mma.sync, every build), or flash_sm90.cu's
// FaFwdWg (Hopper's wgmma, head dims 64 and 128); the rest (mask, online softmax, dropout, epilogue) is
// this function's for both.
// Pipelined (MM::PIPELINED, head dim 128 without dropout: flash_sm90.cu's products are
// asynchronous): a tile's S = Q K^T is issued together with the previous tile's O += P V, the
// softmax's exponentials run while P V is in flight, and O is rescaled once it lands; V is loaded
// a tile behind K. Measured on H200, T = 16384 (12 layers): 11.77 -> 11.31 ms at head dim 128;
// at head dim 64 (four blocks an SM, which already overlap each other's phases) 46.7 -> 50.8 ms
// at T = 32768, so head dim 64 keeps the plain loop.
// CAP (the head-dim-256 kernels): with cap > 0, Gemma 2's attention soft-cap — each score s
// becomes (cap / scale) · tanh(scale · s / cap) before the mask and the softmax, so that the
// softmax of scale times it is that of cap · tanh(scale · s / cap); lse is of the capped scores.
template <int D, bool DROP, class MM, bool CAP = false>
__device__ __forceinline__ void flash_fwd(const __nv_bfloat16* __restrict__ qkv, __nv_bfloat16* __restrict__ o,
               float* __restrict__ lse, int B, int T, int H, int KVH, float scale,
               const unsigned long long* __restrict__ seed, uint32_t site, uint32_t thr,
               float dscale, uint16_t* __restrict__ mbits, const int* __restrict__ starts,
               float cap, __nv_bfloat16* sm) {
    constexpr int KC = D / 16;  // k16 chunks of the head dim
    __nv_bfloat16* sQ = sm;
    const __nv_bfloat16* sK = sm + FA_BM * D;
    const __nv_bfloat16* sV = sK + 2 * FA_BN * D;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const FaFwdBlock blk(qkv, T, H, KVH, D);
    const int qb = blk.qb, bh = blk.bh, b = blk.b, h = blk.h, HD = blk.HD, KD = blk.KD, ld = blk.ld;
    const __nv_bfloat16* qg = blk.qg;
    const int koff = blk.koff;
    const int q0 = qb * FA_BM;
    const uint32_t sQa = fa_smem_u32(sQ), sKa = fa_smem_u32(sK), sVa = fa_smem_u32(sV);
    const uint32_t TILE = FA_BN * D * 2;

    // Packed rows or a sliding window (starts: each query's lowest key, rising with the
    // query): the key tiles below the block's first query's lowest key are skipped.
    const int j0 = starts != nullptr ? __ldg(starts + (size_t)b * T + q0) / FA_BN : 0;
    fa_load_tile<D, MM::PANELS>(sQa, qg, ld, q0, T, tid);
    fa_load_tile<D, MM::PANELS>(sKa + (j0 & 1) * TILE, qg + koff, ld, j0 * FA_BN, T, tid);
    fa_load_tile<D, MM::PANELS>(sVa + (j0 & 1) * TILE, qg + koff + KD, ld, j0 * FA_BN, T, tid);
    fa_cp_commit();

    const int nkt = (T + FA_BN - 1) / FA_BN;
    const int nkv = qb + 1;
    const float sl2 = scale * 1.4426950408889634f;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    const unsigned long long sd = DROP ? *seed : 0ull;
    // Packed rows or a sliding window (starts: each query's lowest key, rising with the query,
    // or null): a query attends from its lowest key on.
    // (A row past T takes its partner's: st1 >= st0 must hold, the tile test below reads st1
    // for both rows.)
    const int st0 = starts != nullptr && row0 < T ? __ldg(starts + (size_t)b * T + row0) : 0;
    const int st1 = starts != nullptr && row1 < T ? __ldg(starts + (size_t)b * T + row1) : st0;

    typename MM::template State<D> mm;
    float oacc[2 * KC][4];
#pragma unroll
    for (int i = 0; i < 2 * KC; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) oacc[i][e] = 0.f;
    FaFwdRows fr{row0, row1, T, t4, bh, st0, st1, scale, sl2, cap, site, sd, thr, dscale, mbits, nkt};

    for (int j = j0; j < nkv; ++j) {
        // (the last tile's products done: the prefetch below reuses its buffers)
        MM::settle(oacc);
        fa_cp_wait_all();
        MM::publish();
        __syncthreads();
        if (j + 1 < nkv) {
            const uint32_t nb = ((j + 1) & 1) * TILE;
            fa_load_tile<D, MM::PANELS>(sKa + nb, qg + koff, ld, (j + 1) * FA_BN, T, tid);
            fa_load_tile<D, MM::PANELS>(sVa + nb, qg + koff + KD, ld, (j + 1) * FA_BN, T, tid);
            fa_cp_commit();
        }
        const uint32_t kb = sKa + (j & 1) * TILE, vb = sVa + (j & 1) * TILE;

        float s[8][4];
        MM::template scores<D>(mm, s, sQa, kb, j - j0, warp, lane);  // (0: the first tile)

        float al0, al1;
        const bool rescale =
            fr.template probs<DROP, CAP>(s, j, j == qb || j * FA_BN + FA_BN > T || j * FA_BN < st1,
                                         al0, al1);
        if (rescale) fa_rescale(oacc, al0, al1);
        MM::template values<D>(oacc, s, vb, lane);
    }
    MM::settle(oacc);

    // (this warp's own rows of sQ stage O: only this warp ever read them)
    fr.template store<D, MM::PANELS>(oacc, lse, o, b, h, HD, q0, reinterpret_cast<char*>(sQ), warp,
                                     lane);
}

// Two entry points, so that the plain forward keeps its registers (the dropout variant spills
// a few): the launcher picks flash_fwd_drop_bf16 when thr > 0.
#define FA_FWD_ARGS                                                                              \
    const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ o, float *__restrict__ lse, \
        int B, int T, int H, int KVH, float scale, const unsigned long long *__restrict__ seed,  \
        uint32_t site, uint32_t thr, float dscale, uint16_t *__restrict__ mbits,            \
        const int *__restrict__ starts, float cap
#define FA_FWD_PASS qkv, o, lse, B, T, H, KVH, scale, seed, site, thr, dscale, mbits, starts, cap
extern "C" __global__ void __launch_bounds__(FA_THREADS, 4) flash_fwd_bf16(FA_FWD_ARGS) {
    __shared__ __align__(128) __nv_bfloat16 sm[5 * 64 * 64];
    flash_fwd<64, false, FaFwdSync>(FA_FWD_PASS, sm);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS, 4) flash_fwd_drop_bf16(FA_FWD_ARGS) {
    __shared__ __align__(128) __nv_bfloat16 sm[5 * 64 * 64];
    flash_fwd<64, true, FaFwdSync>(FA_FWD_PASS, sm);
}
// Head dim 128: 80 KB of dynamic shared memory (FA_FWD_D128_SMEM; the launcher raises the
// function's dynamic shared memory limit), two blocks per SM.
extern "C" __global__ void __launch_bounds__(FA_THREADS, 2) flash_fwd_d128_bf16(FA_FWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_fwd[];
    flash_fwd<128, false, FaFwdSync>(FA_FWD_PASS, reinterpret_cast<__nv_bfloat16*>(fa_dyn_fwd));
}
extern "C" __global__ void __launch_bounds__(FA_THREADS, 2) flash_fwd_drop_d128_bf16(FA_FWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_fwd[];
    flash_fwd<128, true, FaFwdSync>(FA_FWD_PASS, reinterpret_cast<__nv_bfloat16*>(fa_dyn_fwd));
}
// Head dim 256 (Gemma): 160 KB of dynamic shared memory (FA_FWD_D256_SMEM), one block per SM;
// the attention soft-cap where cap > 0.
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) flash_fwd_d256_bf16(FA_FWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_fwd[];
    flash_fwd<256, false, FaFwdSync, true>(FA_FWD_PASS, reinterpret_cast<__nv_bfloat16*>(fa_dyn_fwd));
}
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1) flash_fwd_drop_d256_bf16(FA_FWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_fwd[];
    flash_fwd<256, true, FaFwdSync, true>(FA_FWD_PASS, reinterpret_cast<__nv_bfloat16*>(fa_dyn_fwd));
}

// ---------------------------------------------------------------------------------------------
// Backward 1: delta[b, h, t] = sum_d o * dout; dq_acc = 0. 8 threads per (b, t, h) row.
template <int D>
__device__ __forceinline__ void flash_bwd_preprocess(const __nv_bfloat16* __restrict__ o,
                                                     const __nv_bfloat16* __restrict__ dout,
                                                     float* __restrict__ delta,
                                                     float* __restrict__ dq_acc, int B, int T, int H) {
    const int rows = B * T * H;
    const int r = blockIdx.x * 32 + (threadIdx.x >> 3);
    const int sub = threadIdx.x & 7;
    float s = 0.f;
    if (r < rows) {
#pragma unroll
        for (int part = 0; part < D / 64; ++part) {
            const size_t at = (size_t)r * D + part * 64 + sub * 8;
            const uint4 ov = *reinterpret_cast<const uint4*>(o + at);
            const uint4 dv = *reinterpret_cast<const uint4*>(dout + at);
            const __nv_bfloat162* op = reinterpret_cast<const __nv_bfloat162*>(&ov);
            const __nv_bfloat162* dp = reinterpret_cast<const __nv_bfloat162*>(&dv);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 a = __bfloat1622float2(op[i]);
                const float2 c = __bfloat1622float2(dp[i]);
                s = fmaf(a.x, c.x, s);
                s = fmaf(a.y, c.y, s);
            }
        }
    }
    {  // zero this warp's 4 rows of dq_acc with lane-contiguous 16-byte stores (its rows padded
       // to T rounded up to 16: Hopper's slabs; the launch covers zrows / 32 blocks)
        const int lane = threadIdx.x & 31;
        const int zrows = B * H * ((T + 15) & ~15);
        const int r0 = blockIdx.x * 32 + (threadIdx.x >> 5) * 4;
        float4* z = reinterpret_cast<float4*>(dq_acc + (size_t)r0 * D);
#pragma unroll
        for (int k = 0; k < D / 32; ++k) {
            const int idx = lane + 32 * k;  // float4 index in the 4 rows
            if (r0 + idx / (D / 4) < zrows) z[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    if (r < rows && sub == 0) {
        const int bt = r / H, h = r - bt * H;
        const int b = bt / T, t = bt - b * T;
        delta[((size_t)b * H + h) * T + t] = s;
    }
}
#define FA_PRE_ARGS                                                                             \
    const __nv_bfloat16 *__restrict__ o, const __nv_bfloat16 *__restrict__ dout,               \
        float *__restrict__ delta, float *__restrict__ dq_acc, int B, int T, int H
extern "C" __global__ void __launch_bounds__(256) flash_bwd_preprocess_bf16(FA_PRE_ARGS) {
    flash_bwd_preprocess<64>(o, dout, delta, dq_acc, B, T, H);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_preprocess_d128_bf16(FA_PRE_ARGS) {
    flash_bwd_preprocess<128>(o, dout, delta, dq_acc, B, T, H);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_preprocess_d256_bf16(FA_PRE_ARGS) {
    flash_bwd_preprocess<256>(o, dout, delta, dq_acc, B, T, H);
}

// ---------------------------------------------------------------------------------------------
// Backward 2: block = FA_BWD_BN (= 16 * FA_BWD_NW) keys of one (b, h); warp w owns keys 16w..16w+15
// and keeps its K and V rows (A fragments), its dK, dV rows (fp32) and the K^T slice it needs for
// dQ (B fragments) in registers for the whole loop, so shared memory holds only Q, dO (double
// buffered through cp.async) and dS^T. Per 64-query tile: S^T = K Q^T, P^T, dP^T = V dO^T, dS^T,
// dV += P^T dO, dK += dS^T Q; dS^T goes to smem; after one barrier warp w computes a
// (16*FA_BWD_DQMT queries) x (FA_BWD_DQN head-dim columns) block of dQ over all keys of the block
// (K^T from registers, dS from smem) and adds it into dq_acc with fp32 atomics staged through the
// tile's (now free) Q/dO buffer so that each atomic instruction covers whole 128-byte row
// segments (this matters: 32-byte segments cost ~25% of the kernel). lse/delta come straight from
// global memory (two values per lane, shuffled out). Two block barriers per tile.
// Build knobs (defaults measured fastest on H100: NW 4 / DQMT 2 = main 0.167 ms; 4/4 0.172;
// 8/2 0.170; 8/4 0.195). All four pass the harness.
#ifndef FA_BWD_NW
#define FA_BWD_NW 4                        // warps per block (4: 64 keys; 8: 128 keys, see header)
#endif
#define FA_BWD_BN (16 * FA_BWD_NW)         // keys per block
#define FA_BWD_THREADS (32 * FA_BWD_NW)
#ifndef FA_BWD_DQMT
#define FA_BWD_DQMT 2                      // dQ: query m16-tiles per warp (4: 64 rows, 2: 32 rows)
#endif
#define FA_BWD_DQN (FA_BM * FA_D / (FA_BWD_NW * FA_BWD_DQMT * 16))  // dQ head-dim columns per warp
#define FA_BWD_DQNT (FA_BWD_DQN / 8)       // ... as n8 tiles
static_assert(FA_BWD_NW == 4 || FA_BWD_NW == 8, "FA_BWD_NW must be 4 or 8");
static_assert(FA_BWD_DQMT == 2 || FA_BWD_DQMT == 4, "FA_BWD_DQMT must be 2 or 4");

// staging swizzle for a warp's [rows][DQN] fp32 dQ block (conflict-free float2 writes, float reads)
template <int DQN>
__device__ __forceinline__ int fa_dq_swz(int r) {
    return DQN == 8 ? 0 : DQN == 16 ? ((r >> 1) & 1) << 3 : (r & 3) << 3;
}

// dq[m][n] += dS[m-tile rows][keys 0..16*NK) K[keys][n-tiles], dS^T read from smem ([key][query])
template <int NK, int MT, int NTL, int NKC>
__device__ __forceinline__ void fa_dq_mma(float (&dq)[MT][NTL][4], uint32_t sdSa, int mrow0,
                                          const uint32_t (&kq)[NKC][2 * NTL], int lane) {
#pragma unroll
    for (int kc = 0; kc < NK; ++kc) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            uint32_t a4[4];
            fa_ldA_t(sdSa, mrow0 + m * 16, kc * 16, lane, a4);
#pragma unroll
            for (int n = 0; n < NTL; ++n) fa_mma(dq[m][n], a4, kq[kc][2 * n], kq[kc][2 * n + 1]);
        }
    }
}

// R rows x D cols bf16 (rows row0.. of a matrix with leading dim ld) -> swizzled smem; rows >= T zeroed
template <int R, int NT, int D = 64>
__device__ __forceinline__ void fa_load_rows(uint32_t s, const __nv_bfloat16* g, int ld, int row0,
                                             int T, int tid) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int k = 0; k < R * CH / NT; ++k) {
        const unsigned idx = tid + k * NT;
        const int r = idx / CH, c = idx % CH;
        const int gr = row0 + r;
        const bool ok = gr < T;
        const __nv_bfloat16* src = g + (size_t)(ok ? gr : 0) * ld + c * 8;
        fa_cp_async16(s + fa_swz<D>(r, c * 8), src, ok);
    }
}

// ---------------------------------------------------------------------------------------------
// What the backward's main kernels share (launch 2 of 3: flash_bwd_bf16 and flash_bwd_d128_bf16
// here, flash_bwd_ws_bf16 and flash_bwd_ws_d128_bf16 in flash_sm90.cu).

// A block's work: keys k0..k0+BN-1 (key block blockIdx.y; block 0 has the most work and is issued
// first) of one (b, key/value head) (blockIdx.x), against the query tiles i0.. that see them
// (ntile a head) of each query head h0..h0+rep-1 sharing that key/value head; this batch row's
// rows in qkv (row stride ld: Q at column h·D, K at kg, V at vg) and in dout (row stride HD).
// PER_HEAD: blockIdx.x = b·H + h, one query head a block (rep = 1, h0 = h): its dK, dV are that
// head's share, summed over the group by flash_bwd_kv_sum.
template <int D, int BN, bool PER_HEAD = false>
struct FaBwdBlock {
    int k0, i0, b, kvh, HD, KD, ld, rep, h0, nq, ntile;
    const __nv_bfloat16* qkv_b;
    const __nv_bfloat16* kg;
    const __nv_bfloat16* vg;
    const __nv_bfloat16* dout_b;
    __device__ __forceinline__ FaBwdBlock(const __nv_bfloat16* qkv, const __nv_bfloat16* dout,
                                          int T, int H, int KVH, const int* __restrict__ lows) {
        k0 = blockIdx.y * BN;
        i0 = k0 / FA_BM;
        if (PER_HEAD) {
            b = blockIdx.x / H;
            h0 = blockIdx.x - b * H;
            kvh = h0 / (H / KVH);
            rep = 1;
        } else {
            b = blockIdx.x / KVH;
            kvh = blockIdx.x - b * KVH;
            rep = H / KVH;
            h0 = kvh * rep;
        }
        HD = H * D;
        KD = KVH * D;
        ld = HD + 2 * KD;
        qkv_b = qkv + (size_t)b * T * ld;
        kg = qkv_b + HD + kvh * D;
        vg = kg + KD;
        dout_b = dout + (size_t)b * T * HD;
        nq = (T + FA_BM - 1) / FA_BM;
        ntile = nq - i0;
        if (lows != nullptr) {
            // Each query's lowest key (its sample's start, or its window's) rises with the
            // query: the last query that reaches this block's last key, by bisection; the tiles
            // past it are skipped.
            const int* lo = lows + (size_t)b * T;
            const int klast = min(k0 + BN, T) - 1;
            int a = klast, z = T - 1;  // lo[a] <= klast holds (lo[q] <= q)
            while (a < z) {
                const int m = (a + z + 1) >> 1;
                if (__ldg(lo + m) <= klast) a = m; else z = m - 1;
            }
            ntile = a / FA_BM - i0 + 1;
        }
    }
    // How many (query head, query tiles) steps the block takes, QT 64-query tiles a step (the
    // last of a head's may reach past T): the tiles of head h0, then of h0 + 1, ...
    template <int QT = 1>
    __device__ __forceinline__ int steps() const {
        return rep * ((ntile + QT - 1) / QT);
    }
    // Step `it`'s query head and first query tile.
    template <int QT = 1>
    __device__ __forceinline__ void at(int it, int& h, int& i) const {
        const int n = (ntile + QT - 1) / QT;
        const int hq = it / n;
        h = h0 + hq;
        i = i0 + QT * (it - hq * n);
    }
};

template <int N>
__device__ __forceinline__ void fa_zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[i][e] = 0.f;
}
// acc (a warp's 16 rows x 64 columns) = A B^T over k = 64: A the warp's rows as mma.sync A
// fragments (a[kc]: k 16kc..), B 64 rows of k from the swizzled tile at s (fa_ldB_nk).
__device__ __forceinline__ void fa_mm_nk(float (&acc)[8][4], const uint32_t (&a)[4][4], uint32_t s,
                                         int lane) {
    fa_zero(acc);
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b0, b1, b2, b3;
            fa_ldB_nk(s, np * 16, kc * 16, lane, b0, b1, b2, b3);
            fa_mma(acc[2 * np], a[kc], b0, b1);
            fa_mma(acc[2 * np + 1], a[kc], b2, b3);
        }
    }
}

// Lane l's lse (log2 units; +inf past T) and delta of queries q0 + 2l and q0 + 2l + 1 of query
// head row bh = b·H + h (fa_bwd_probs and fa_bwd_dscores shuffle them out).
__device__ __forceinline__ void fa_bwd_row_stats(const float* __restrict__ lse,
                                                 const float* __restrict__ delta, size_t bh,
                                                 int q0, int T, int lane, float& lsa, float& lsb,
                                                 float& dla, float& dlb) {
    const float L2E = 1.4426950408889634f;
    const float* lseg = lse + bh * T;
    const float* dlg = delta + bh * T;
    const int qa = q0 + 2 * lane;
    lsa = qa < T ? __ldg(lseg + qa) * L2E : INFINITY;
    lsb = qa + 1 < T ? __ldg(lseg + qa + 1) * L2E : INFINITY;
    dla = qa < T ? __ldg(dlg + qa) : 0.f;
    dlb = qa + 1 < T ? __ldg(dlg + qa + 1) : 0.f;
}

// Lane l's sample starts (packed rows: st_b, this batch row's) of queries q0 + 2l and q0 + 2l + 1
// (0 past T), for fa_bwd_probs<true>.
__device__ __forceinline__ void fa_bwd_row_starts(const int* __restrict__ st_b, int q0, int T,
                                                  int lane, int& sqa, int& sqb) {
    const int qa = q0 + 2 * lane;
    sqa = qa < T ? __ldg(st_b + qa) : 0;
    sqb = qa + 1 < T ? __ldg(st_b + qa + 1) : 0;
}
// Lane l's dropout flag words (query head row bh, nkt 64-key tiles a row, key tile kt) of queries
// q0 + 2l and q0 + 2l + 1 (0 past T), for fa_bwd_dscores<true>.
__device__ __forceinline__ void fa_bwd_row_mbits(const unsigned long long* __restrict__ mbits,
                                                 size_t bh, int T, int nkt, int kt, int q0,
                                                 int lane, unsigned long long& ma,
                                                 unsigned long long& mb) {
    const int qa = q0 + 2 * lane;
    ma = qa < T ? __ldg(mbits + (bh * T + qa) * nkt + kt) : 0ull;
    mb = qa + 1 < T ? __ldg(mbits + (bh * T + qa + 1) * nkt + kt) : 0ull;
}

// ---------------------------------------------------------------------------------------------
// The elementwise middle and the epilogue of the head-dim-64 backward's main kernel, shared by
// flash_bwd_bf16 (mma.sync) and flash_sm90.cu's flash_bwd_ws_bf16 (wgmma): both hold S^T and
// dP^T of a warp's 16 keys x the tile's 64 queries in mma.sync's accumulator layout (rows g and
// g + 8 of the warp's block, columns 8·nt + 2·t4 + e).

// P^T = exp(scale*S^T - lse[q]) in place, the causal mask where the warp's keys (first wk0,
// this thread's kr0 and kr0 + 8) reach the tile's queries (q0..). Lane l holds lse (log2
// units) of queries q0 + 2l and q0 + 2l + 1 in lsa, lsb.
// Packed rows (st_b: this batch row's sample starts, or null): keys before a query's start are
// another sample's. PRE: lane l holds the starts of its two queries in sqa, sqb
// (fa_bwd_row_starts; st_b only says whether rows are packed) — a warp's 16 loads instead of
// every thread's 16, which the 128-query tiles' registers cannot hold in flight.
// MASK: 2 applies the causal mask where `diag` (one loop: ptxas turns the mask into selects
// that run on every tile, about half the loop's instructions); 1 always, 0 never — two loops
// for a caller that branches on diag itself (flash_bwd_ws's plain loop; the other kernels keep
// one loop, whose registers the second would push into spills).
template <bool PRE, int MASK>
__device__ __forceinline__ void fa_bwd_probs_rows(float (&st)[8][4], float lsa, float lsb,
                                                  float sl2, int q0, int kr0, int t4,
                                                  const int* __restrict__ st_b, int T, int sqa,
                                                  int sqb, bool diag = true) {
    const int kr1 = kr0 + 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int q = q0 + nt * 8 + t4 * 2 + e;
            const float lq = __shfl_sync(0xffffffffu, e ? lsb : lsa, nt * 4 + t4);
            float p0 = exp2f(fmaf(st[nt][e], sl2, -lq));
            float p1 = exp2f(fmaf(st[nt][2 + e], sl2, -lq));
            if (MASK == 1 || (MASK == 2 && diag)) {
                if (kr0 > q) p0 = 0.f;
                if (kr1 > q) p1 = 0.f;
            }
            if (st_b != nullptr) {
                const int sq = PRE ? __shfl_sync(0xffffffffu, e ? sqb : sqa, nt * 4 + t4)
                                   : (q < T ? __ldg(st_b + q) : 0);
                if (kr0 < sq) p0 = 0.f;
                if (kr1 < sq) p1 = 0.f;
            }
            st[nt][e] = p0;
            st[nt][2 + e] = p1;
        }
}
template <bool PRE = false>
__device__ __forceinline__ void fa_bwd_probs(float (&st)[8][4], float lsa, float lsb, float sl2,
                                             int q0, int wk0, int kr0, int t4,
                                             const int* __restrict__ st_b, int T, int sqa = 0,
                                             int sqb = 0) {
    fa_bwd_probs_rows<PRE, 2>(st, lsa, lsb, sl2, q0, kr0, t4, st_b, T, sqa, sqb, wk0 + 15 > q0);
}

// dS^T = P^T * (dP^T - delta[q]) into dpt (lane l holds delta of queries q0 + 2l, + 1 in dla,
// dlb). With dropout (thr > 0) dP is the dropped one's gradient through the forward's kept-flags
// (mbits of query head bh = b·H + h, nkt 64-key tiles a row) and P^T becomes the dropped one,
// which dV takes. PRE: lane l holds its two queries' flag words in ma, mb (fa_bwd_row_mbits).
template <bool PRE = false>
__device__ __forceinline__ void fa_bwd_dscores(float (&st)[8][4], float (&dpt)[8][4], float dla,
                                               float dlb, int q0, int kr0, int t4, int T,
                                               uint32_t thr, float dscale,
                                               const unsigned long long* __restrict__ mbits,
                                               size_t bh, int nkt, unsigned long long ma = 0,
                                               unsigned long long mb = 0) {
    const int jk = kr0 & 63;  // this thread's first key in its 64-key tile (kr0 + 8: +8)
    const int kbit = ((jk >> 1) & 3) * 16 + (jk >> 3) * 2 + (jk & 1);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float dl = __shfl_sync(0xffffffffu, e ? dlb : dla, nt * 4 + t4);
            if (thr) {
                const int q = q0 + nt * 8 + t4 * 2 + e;
                unsigned long long m;
                if (PRE) {
                    const unsigned long long mine = e ? mb : ma;
                    const int src = nt * 4 + t4;
                    m = (unsigned long long)__shfl_sync(0xffffffffu, (uint32_t)mine, src) |
                        ((unsigned long long)__shfl_sync(0xffffffffu, (uint32_t)(mine >> 32), src)
                         << 32);
                } else {
                    m = q < T ? __ldg(mbits + (bh * T + q) * nkt + (kr0 >> 6)) : 0ull;
                }
                const float m0 = (m >> kbit) & 1 ? dscale : 0.f;
                const float m1 = (m >> (kbit + 2)) & 1 ? dscale : 0.f;
                dpt[nt][e] = st[nt][e] * (dpt[nt][e] * m0 - dl);
                dpt[nt][2 + e] = st[nt][2 + e] * (dpt[nt][2 + e] * m1 - dl);
                st[nt][e] *= m0;
                st[nt][2 + e] *= m1;
            } else {
                dpt[nt][e] = st[nt][e] * (dpt[nt][e] - dl);
                dpt[nt][2 + e] = st[nt][2 + e] * (dpt[nt][2 + e] - dl);
            }
        }
}

// Epilogue: warp w's dK (scaled) and dV rows (keys wk0..wk0+15, local rows 16w + g, + 8; N
// n8-tiles: head dim D = 8N) through two swizzled D-column smem tiles (sKc, sVc: generic
// pointers) into dqkv, 16 bytes a store; rows >= T are not written. dst_k: the k slot of key 0 of
// this (b, kv head) in dqkv (row stride ld), the v slot KD further.
// (Columns col0..col0 + 8N − 1 of tiles DT columns wide: a head-dim-256 warp's half.)
template <int N, int DT = 8 * N>
__device__ __forceinline__ void fa_bwd_store_kv(const float (&dk)[N][4], const float (&dv)[N][4],
                                                float scale, char* sKc, char* sVc, int warp,
                                                int lane, int wk0, int T,
                                                __nv_bfloat16* __restrict__ dst_k, int ld, int KD,
                                                int col0 = 0) {
    const int g = lane >> 2, t4 = lane & 3;
    const int lr0 = warp * 16 + g, lr1 = lr0 + 8;
#pragma unroll
    for (int nt = 0; nt < N; ++nt) {
        const int c = col0 + nt * 8 + t4 * 2;
        *reinterpret_cast<uint32_t*>(sKc + fa_swz<DT>(lr0, c)) =
            fa_pack(dk[nt][0] * scale, dk[nt][1] * scale);
        *reinterpret_cast<uint32_t*>(sKc + fa_swz<DT>(lr1, c)) =
            fa_pack(dk[nt][2] * scale, dk[nt][3] * scale);
        *reinterpret_cast<uint32_t*>(sVc + fa_swz<DT>(lr0, c)) = fa_pack(dv[nt][0], dv[nt][1]);
        *reinterpret_cast<uint32_t*>(sVc + fa_swz<DT>(lr1, c)) = fa_pack(dv[nt][2], dv[nt][3]);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 16 * N / 32; ++k) {
        const int idx = lane + k * 32;
        const int r = idx / N, c = col0 + (idx % N) * 8;
        const int key = wk0 + r;
        if (key < T) {
            __nv_bfloat16* dst = dst_k + (size_t)key * ld + c;
            *reinterpret_cast<uint4*>(dst) =
                *reinterpret_cast<const uint4*>(sKc + fa_swz<DT>(warp * 16 + r, c));
            *reinterpret_cast<uint4*>(dst + KD) =
                *reinterpret_cast<const uint4*>(sVc + fa_swz<DT>(warp * 16 + r, c));
        }
    }
}

extern "C" __global__ void __launch_bounds__(FA_BWD_THREADS, (FA_BWD_NW == 8 ? 1 : 2))
flash_bwd_bf16(const __nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ delta,
               float* __restrict__ dq_acc, __nv_bfloat16* __restrict__ dqkv, int B, int T, int H,
               int KVH, float scale, uint32_t thr, float dscale,
               const unsigned long long* __restrict__ mbits, const int* __restrict__ starts,
               float /* cap: no soft-cap at this head dim */, __nv_bfloat16* /* kv_part */) {
    constexpr int BN = FA_BWD_BN, NT = FA_BWD_THREADS;
    constexpr int DQN = FA_BWD_DQN, DQNT = FA_BWD_DQNT, NKC = BN / 16, DQMT = FA_BWD_DQMT;
    constexpr int DQR = DQMT * 16;  // dQ rows per warp
    __shared__ __align__(128) __nv_bfloat16 sQD[2][2][FA_BM * FA_D];  // [buffer][Q, dO]
    __shared__ __align__(128) __nv_bfloat16 sdS[BN * FA_BM];          // dS^T: [key][query]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const FaBwdBlock<FA_D, BN> blk(qkv, dout, T, H, KVH, starts);
    const int k0 = blk.k0, i0 = blk.i0, HD = blk.HD, ld = blk.ld;
    const float sl2 = scale * 1.4426950408889634f;

    const uint32_t sbase = fa_smem_u32(sQD), sdSa = fa_smem_u32(sdS);
    constexpr uint32_t BUF = 2 * FA_BM * FA_D * 2, DOFF = FA_BM * FA_D * 2;

    // prologue: K -> sdS, V -> buffer 1 (BN rows), Q and dO of the first tile -> buffer 0
    fa_load_rows<BN, NT>(sdSa, blk.kg, ld, k0, T, tid);
    fa_load_rows<BN, NT>(sbase + BUF, blk.vg, ld, k0, T, tid);
    fa_load_rows<FA_BM, NT>(sbase, blk.qkv_b + blk.h0 * FA_D, ld, i0 * FA_BM, T, tid);
    fa_load_rows<FA_BM, NT>(sbase + DOFF, blk.dout_b + blk.h0 * FA_D, HD, i0 * FA_BM, T, tid);
    fa_cp_commit();
    fa_cp_wait_all();
    __syncthreads();
    uint32_t ka[4][4], va[4][4], kq[NKC][2 * DQNT];
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        fa_ldA(sdSa, warp * 16, kc * 16, lane, ka[kc]);
        fa_ldA(sbase + BUF, warp * 16, kc * 16, lane, va[kc]);
    }
    // dQ work split: warp -> query rows dqm0.. (DQR of them) x head-dim columns dqc0.. (DQN)
    const int dqc0 = (warp % (FA_D / DQN)) * DQN, dqm0 = (warp / (FA_D / DQN)) * DQR;
    // kq: B fragments of K (k = key, n = head dim) for head-dim columns dqc0..dqc0+DQN-1
    if constexpr (DQNT == 1) {
#pragma unroll
        for (int j = 0; j < NKC / 2; ++j)
            fa_ldsm_x4_t(sdSa + fa_swz(32 * j + lane, dqc0), kq[2 * j][0], kq[2 * j][1],
                         kq[2 * j + 1][0], kq[2 * j + 1][1]);
    } else {
#pragma unroll
        for (int kc = 0; kc < NKC; ++kc)
#pragma unroll
            for (int np = 0; np < DQNT / 2; ++np)
                fa_ldB_kn(sdSa, kc * 16, dqc0 + np * 16, lane, kq[kc][4 * np], kq[kc][4 * np + 1],
                          kq[kc][4 * np + 2], kq[kc][4 * np + 3]);
    }
    __syncthreads();  // K, V copies consumed

    float dk[8][4], dv[8][4];
    fa_zero(dk);
    fa_zero(dv);
    const int wk0 = k0 + warp * 16;               // first key of this warp
    const int kr0 = wk0 + g;                      // key of this thread's first accumulator row
    const int lr0 = warp * 16 + g, lr1 = lr0 + 8; // ... local rows

    // (query head, query tile) pairs in order: the tiles of head h0, then of h0 + 1, ...
    for (int it = 0; it < blk.steps(); ++it) {
        int h, i;
        blk.at(it, h, i);
        const int bsel = it & 1;
        const uint32_t sQa = sbase + bsel * BUF, sdOa = sQa + DOFF;
        fa_cp_wait_all();
        __syncthreads();  // tile i landed; everybody is done with tile i-1 (its buffer and sdS)
        if (it + 1 < blk.steps()) {
            int hn, in;
            blk.at(it + 1, hn, in);
            const uint32_t nb = sbase + (bsel ^ 1) * BUF;
            fa_load_rows<FA_BM, NT>(nb, blk.qkv_b + hn * FA_D, ld, in * FA_BM, T, tid);
            fa_load_rows<FA_BM, NT>(nb + DOFF, blk.dout_b + hn * FA_D, HD, in * FA_BM, T, tid);
            fa_cp_commit();
        }
        const int q0 = i * FA_BM;

        if (wk0 <= q0 + FA_BM - 1) {  // else every key of this warp is above every query: no work
            float lsa, lsb, dla, dlb;
            fa_bwd_row_stats(lse, delta, (size_t)blk.b * H + h, q0, T, lane, lsa, lsb, dla, dlb);
            // S^T (16 keys x 64 queries per warp)
            float st[8][4];
            fa_mm_nk(st, ka, sQa, lane);
            fa_bwd_probs(st, lsa, lsb, sl2, q0, wk0, kr0, t4,
                         starts ? starts + (size_t)blk.b * T : nullptr, T);
            // dP^T = V dO^T
            float dpt[8][4];
            fa_mm_nk(dpt, va, sdOa, lane);
            fa_bwd_dscores(st, dpt, dla, dlb, q0, kr0, t4, T, thr, dscale, mbits,
                           (size_t)blk.b * H + h, blk.nq);
            // dV += P^T dO ; dK += dS^T Q   (k = query dim); dS^T -> smem for dQ
            char* sdSc = reinterpret_cast<char*>(sdS);
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                uint32_t pa[4], sa[4];
                fa_frag(st, kc, pa);
                fa_frag(dpt, kc, sa);
                fa_store_frag(sdSc, sa, lr0, lr1, kc * 16 + t4 * 2);
#pragma unroll
                for (int dp = 0; dp < 4; ++dp) {
                    uint32_t b0, b1, b2, b3;
                    fa_ldB_kn(sdOa, kc * 16, dp * 16, lane, b0, b1, b2, b3);
                    fa_mma(dv[2 * dp], pa, b0, b1);
                    fa_mma(dv[2 * dp + 1], pa, b2, b3);
                    fa_ldB_kn(sQa, kc * 16, dp * 16, lane, b0, b1, b2, b3);
                    fa_mma(dk[2 * dp], sa, b0, b1);
                    fa_mma(dk[2 * dp + 1], sa, b2, b3);
                }
            }
        }
        __syncthreads();  // dS^T complete; this tile's Q/dO buffer is free

        // dQ[dqm0.. (DQR rows)][dqc0.. (DQN cols)] = dS K over the keys of this block that reach
        // the tile (all of them except on the first tile of an 8-warp block: its first half)
        float dq[DQMT][DQNT][4];
#pragma unroll
        for (int m = 0; m < DQMT; ++m)
#pragma unroll
            for (int n = 0; n < DQNT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq[m][n][e] = 0.f;
        if (NKC == 4 || q0 + FA_BM - k0 >= BN)
            fa_dq_mma<NKC>(dq, sdSa, dqm0, kq, lane);
        else
            fa_dq_mma<NKC / 2>(dq, sdSa, dqm0, kq, lane);
        // stage the dQ block in the free buffer, then coalesced fp32 atomics. With 16 columns per
        // warp, warps w and w^1 (same rows, adjacent columns) stage into one [DQR][32] block and each
        // adds half of its rows, so that every atomic instruction covers one full 128-byte row segment.
        constexpr bool PAIR = (DQN == 16);
        constexpr int SW = PAIR ? 32 : DQN;  // staged row width (floats)
        float* stg = reinterpret_cast<float*>(sQD[bsel]) + (PAIR ? (warp >> 1) * (DQR * 32) : warp * (DQR * DQN));
        const int scol = PAIR ? (warp & 1) * 16 : 0;
#pragma unroll
        for (int m = 0; m < DQMT; ++m)
#pragma unroll
            for (int n = 0; n < DQNT; ++n)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = m * 16 + g + hf * 8;
                    const int c = (scol + n * 8 + t4 * 2) ^ fa_dq_swz<SW>(r);
                    *reinterpret_cast<float2*>(stg + r * SW + c) =
                        make_float2(dq[m][n][2 * hf], dq[m][n][2 * hf + 1]);
                }
        if constexpr (PAIR) {  // named barrier of the two warps (ids 1..NW/2, immediates)
            switch (warp >> 1) {
                case 0: asm volatile("bar.sync 1, 64;\n" ::: "memory"); break;
                case 1: asm volatile("bar.sync 2, 64;\n" ::: "memory"); break;
                case 2: asm volatile("bar.sync 3, 64;\n" ::: "memory"); break;
                default: asm volatile("bar.sync 4, 64;\n" ::: "memory"); break;
            }
        } else {
            __syncwarp();
        }
        {
            constexpr int RPI = 32 / SW;                      // rows per atomic instruction
            constexpr int NI = (PAIR ? DQR / 2 : DQR) / RPI;  // atomic instructions per thread
            const int rr = (PAIR ? (warp & 1) * (DQR / 2) : 0) + lane / SW, cc = lane % SW;
            const int qr = q0 + dqm0 + rr;
            float* dst = dq_acc + ((size_t)blk.b * T + qr) * HD + h * FA_D + (dqc0 - scol) + cc;
            float v[NI];
#pragma unroll
            for (int k = 0; k < NI; ++k) {
                const int r = k * RPI + rr;
                v[k] = stg[r * SW + (cc ^ fa_dq_swz<SW>(r))];
            }
            if (q0 + FA_BM <= T) {
#pragma unroll
                for (int k = 0; k < NI; ++k) atomicAdd(dst + (size_t)(k * RPI) * HD, v[k]);
            } else {
#pragma unroll
                for (int k = 0; k < NI; ++k)
                    if (qr + k * RPI < T) atomicAdd(dst + (size_t)(k * RPI) * HD, v[k]);
            }
        }
    }

    // epilogue: dK (scaled) -> sdS rows, dV -> buffer 0 as a BN-row tile, then 16-byte stores
    __syncthreads();
    fa_bwd_store_kv(dk, dv, scale, reinterpret_cast<char*>(sdS), reinterpret_cast<char*>(sQD),
                    warp, lane, wk0, T, dqkv + (size_t)blk.b * T * ld + HD + blk.kvh * FA_D, ld, blk.KD);
}

// ---------------------------------------------------------------------------------------------
// Backward 2, head dims 128 and 256: block = 64 keys of one (b, key/value head) and D / 32 warps.
// Warp w takes keys 16(w mod 4)..+15 and head-dim columns 128(w div 4)..+127 of their dK, dV rows
// (16 x 128 fp32 each: 128 registers per thread), accumulated over the query tiles of every query
// head of the group; at head dim 256 the two warps of a key group both compute its S^T and dP^T
// (over all 256 dims) and each keeps half of the columns. The 64-dim kernel's register copies of
// K, V and K^T do not fit beside those accumulators, so K and V stay in shared memory (read as
// fragments per use) and each 64-query tile is taken in two halves of 32 queries (S^T, P^T, dP^T,
// dS^T of a half in registers). dQ = dS K per tile: warp w computes 32 queries x 64 head-dim
// columns in two passes of 32 columns, staged in the tile's free Q/dO buffer for coalesced fp32
// atomics (one 128-byte row segment per instruction).
// Shared memory (dynamic, FA_BWD_D128_SMEM = 104 KB, FA_BWD_D256_SMEM = 200 KB): sK [64][D],
// sV [64][D], Q/dO [2 buffers][2][64][D], dS^T [64 keys][64 queries]. Two blocks per SM at 128,
// one at 256.
// CAP (head dim 256): with cap > 0 the forward's soft-capped scores, recomputed from the raw
// ones (s' = (cap / scale)·t, t = tanh(scale · s / cap)), and dS^T taken through the cap: times
// 1 − t².
template <int D, bool CAP, bool PER_HEAD>
__device__ __forceinline__ void flash_bwd_wide(
    const __nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_acc,
    __nv_bfloat16* __restrict__ dqkv, int B, int T, int H, int KVH, float scale, uint32_t thr,
    float dscale, const unsigned long long* __restrict__ mbits, const int* __restrict__ starts,
    float cap, __nv_bfloat16* __restrict__ kv_part, uint4* smem) {
    static_assert(D == 128 || D == 256, "flash_bwd_wide is written for head dims 128 and 256");
    constexpr int KC = D / 16, BN = 64, NT = D, CW = 128, CWT = CW / 8;
    __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* sV = sK + BN * D;
    __nv_bfloat16* sQD = sV + BN * D;           // [buffer][Q, dO][64][D]
    __nv_bfloat16* sdS = sQD + 4 * FA_BM * D;   // dS^T: [key][query], 64 x 64

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kw = warp & 3, c0w = (warp >> 2) * CW;  // this warp's key group and first column
    const FaBwdBlock<D, BN, PER_HEAD> blk(qkv, dout, T, H, KVH, starts);
    const int k0 = blk.k0, i0 = blk.i0, b = blk.b, HD = blk.HD, ld = blk.ld, nq = blk.nq;
    const float sl2 = scale * 1.4426950408889634f;
    const bool capped = CAP && cap > 0.f;
    const float cin = capped ? scale / cap : 0.f, cout = capped ? cap / scale : 0.f;

    const uint32_t sKa = fa_smem_u32(sK), sVa = fa_smem_u32(sV);
    const uint32_t sbase = fa_smem_u32(sQD), sdSa = fa_smem_u32(sdS);
    constexpr uint32_t BUF = 2 * FA_BM * D * 2, DOFF = FA_BM * D * 2;

    fa_load_rows<BN, NT, D>(sKa, blk.kg, ld, k0, T, tid);
    fa_load_rows<BN, NT, D>(sVa, blk.vg, ld, k0, T, tid);
    fa_load_rows<FA_BM, NT, D>(sbase, blk.qkv_b + blk.h0 * D, ld, i0 * FA_BM, T, tid);
    fa_load_rows<FA_BM, NT, D>(sbase + DOFF, blk.dout_b + blk.h0 * D, HD, i0 * FA_BM, T, tid);
    fa_cp_commit();

    float dk[CWT][4], dv[CWT][4];  // 16 keys x CW columns
    fa_zero(dk);
    fa_zero(dv);
    const int wk0 = k0 + kw * 16;                  // first key of this warp
    const int kr0 = wk0 + g, kr1 = kr0 + 8;        // keys of this thread's accumulator rows
    const int lr0 = kw * 16 + g, lr1 = lr0 + 8;    // ... local rows
    const int jk = kr0 & 63;  // this thread's first key in its 64-key mask tile (kr1: +8)
    const int kbit = ((jk >> 1) & 3) * 16 + (jk >> 3) * 2 + (jk & 1);
    // dQ work split: warp -> 32 query rows (dqm0..) x 64 head-dim columns (dqc0..), two passes
    const int dqm0 = (warp / (D / 64)) * 32, dqc0 = (warp % (D / 64)) * 64;

    for (int it = 0; it < blk.steps(); ++it) {
        int h, i;
        blk.at(it, h, i);
        const int bsel = it & 1;
        const uint32_t sQa = sbase + bsel * BUF, sdOa = sQa + DOFF;
        fa_cp_wait_all();
        __syncthreads();  // tile landed; everybody is done with the previous tile (buffer, sdS)
        if (it + 1 < blk.steps()) {
            int hn, in;
            blk.at(it + 1, hn, in);
            const uint32_t nb = sbase + (bsel ^ 1) * BUF;
            fa_load_rows<FA_BM, NT, D>(nb, blk.qkv_b + hn * D, ld, in * FA_BM, T, tid);
            fa_load_rows<FA_BM, NT, D>(nb + DOFF, blk.dout_b + hn * D, HD, in * FA_BM, T, tid);
            fa_cp_commit();
        }
        const int q0 = i * FA_BM;
        float lsa, lsb, dla, dlb;
        fa_bwd_row_stats(lse, delta, (size_t)b * H + h, q0, T, lane, lsa, lsb, dla, dlb);
        char* sdSc = reinterpret_cast<char*>(sdS);

#pragma unroll 1
        for (int hh = 0; hh < 2; ++hh) {  // queries q0 + 32hh .. + 31
            const int qh = hh * 32;
            float st[4][4], dpt[4][4];
            fa_zero(st);
            fa_zero(dpt);
            // S^T = K Q^T and dP^T = V dO^T (16 keys x 32 queries per warp)
#pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
                uint32_t ka[4], va[4];
                fa_ldA<D>(sKa, kw * 16, kc * 16, lane, ka);
                fa_ldA<D>(sVa, kw * 16, kc * 16, lane, va);
#pragma unroll
                for (int np = 0; np < 2; ++np) {
                    uint32_t b0, b1, b2, b3;
                    fa_ldB_nk<D>(sQa, qh + np * 16, kc * 16, lane, b0, b1, b2, b3);
                    fa_mma(st[2 * np], ka, b0, b1);
                    fa_mma(st[2 * np + 1], ka, b2, b3);
                    fa_ldB_nk<D>(sdOa, qh + np * 16, kc * 16, lane, b0, b1, b2, b3);
                    fa_mma(dpt[2 * np], va, b0, b1);
                    fa_mma(dpt[2 * np + 1], va, b2, b3);
                }
            }
            // P^T = exp(scale*S^T - lse[q]) with the causal mask; dS^T = P^T (dP^T - delta[q]);
            // with dropout dP goes through the forward's mask and dV takes the dropped P^T
            const bool diag = wk0 + 15 > q0 + qh;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int q = q0 + qh + nt * 8 + t4 * 2 + e;
                    const int src = hh * 16 + nt * 4 + t4;
                    const float lq = __shfl_sync(0xffffffffu, e ? lsb : lsa, src);
                    const float dl = __shfl_sync(0xffffffffu, e ? dlb : dla, src);
                    float s0 = st[nt][e], s1 = st[nt][2 + e], c0 = 1.f, c1 = 1.f;
                    if (capped) {  // (d capped / d raw = 1 - t², t = tanh(scale · s / cap))
                        const float t0 = tanhf(s0 * cin), t1 = tanhf(s1 * cin);
                        s0 = cout * t0;
                        s1 = cout * t1;
                        c0 = 1.f - t0 * t0;
                        c1 = 1.f - t1 * t1;
                    }
                    float p0 = exp2f(fmaf(s0, sl2, -lq));
                    float p1 = exp2f(fmaf(s1, sl2, -lq));
                    if (diag) {
                        if (kr0 > q) p0 = 0.f;
                        if (kr1 > q) p1 = 0.f;
                    }
                    if (starts != nullptr) {
                        const int sq = q < T ? __ldg(starts + (size_t)b * T + q) : 0;
                        if (kr0 < sq) p0 = 0.f;
                        if (kr1 < sq) p1 = 0.f;
                    }
                    if (thr) {
                        const unsigned long long m =
                            q < T ? __ldg(mbits + ((size_t)(b * H + h) * T + q) * nq + (kr0 >> 6))
                                  : 0ull;
                        const float m0 = (m >> kbit) & 1 ? dscale : 0.f;
                        const float m1 = (m >> (kbit + 2)) & 1 ? dscale : 0.f;
                        dpt[nt][e] = c0 * p0 * (dpt[nt][e] * m0 - dl);
                        dpt[nt][2 + e] = c1 * p1 * (dpt[nt][2 + e] * m1 - dl);
                        st[nt][e] = p0 * m0;
                        st[nt][2 + e] = p1 * m1;
                    } else {
                        dpt[nt][e] = c0 * p0 * (dpt[nt][e] - dl);
                        dpt[nt][2 + e] = c1 * p1 * (dpt[nt][2 + e] - dl);
                        st[nt][e] = p0;
                        st[nt][2 + e] = p1;
                    }
                }
            // dV += P^T dO ; dK += dS^T Q (k = query), this warp's columns; dS^T -> smem for dQ
            // (written by the warps of the first columns: at head dim 256 their partners hold
            // the same values)
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
                uint32_t pa[4], sa[4];
                fa_frag(st, kc, pa);
                fa_frag(dpt, kc, sa);
                if (c0w == 0) {
                    const int qc = qh + kc * 16 + t4 * 2;
                    fa_store_frag(sdSc, sa, lr0, lr1, qc);
                }
#pragma unroll
                for (int dp = 0; dp < CW / 16; ++dp) {
                    uint32_t b0, b1, b2, b3;
                    fa_ldB_kn<D>(sdOa, qh + kc * 16, c0w + dp * 16, lane, b0, b1, b2, b3);
                    fa_mma(dv[2 * dp], pa, b0, b1);
                    fa_mma(dv[2 * dp + 1], pa, b2, b3);
                    fa_ldB_kn<D>(sQa, qh + kc * 16, c0w + dp * 16, lane, b0, b1, b2, b3);
                    fa_mma(dk[2 * dp], sa, b0, b1);
                    fa_mma(dk[2 * dp + 1], sa, b2, b3);
                }
            }
        }
        __syncthreads();  // dS^T complete; this tile's Q/dO buffer is free

        // dQ[dqm0.. +32][dqc0 + 32p .. +32] = dS K over the block's 64 keys
        float* stg0 = reinterpret_cast<float*>(sQD + bsel * 2 * FA_BM * D) + warp * 2 * (32 * 32);
#pragma unroll 1
        for (int p = 0; p < 2; ++p) {
            const int c0 = dqc0 + p * 32;
            float dq[2][4][4];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq[m][n][e] = 0.f;
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
                uint32_t kb[8];
                fa_ldB_kn<D>(sKa, kc * 16, c0, lane, kb[0], kb[1], kb[2], kb[3]);
                fa_ldB_kn<D>(sKa, kc * 16, c0 + 16, lane, kb[4], kb[5], kb[6], kb[7]);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    uint32_t a4[4];
                    fa_ldA_t(sdSa, dqm0 + m * 16, kc * 16, lane, a4);
#pragma unroll
                    for (int n = 0; n < 4; ++n) fa_mma(dq[m][n], a4, kb[2 * n], kb[2 * n + 1]);
                }
            }
            float* stg = stg0 + p * (32 * 32);  // [32 rows][32 cols], swizzled
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int r = m * 16 + g + hf * 8;
                        const int c = (n * 8 + t4 * 2) ^ fa_dq_swz<32>(r);
                        *reinterpret_cast<float2*>(stg + r * 32 + c) =
                            make_float2(dq[m][n][2 * hf], dq[m][n][2 * hf + 1]);
                    }
            __syncwarp();
            const int qr = q0 + dqm0;
            float* dst = dq_acc + ((size_t)b * T + qr) * HD + h * D + c0 + lane;
#pragma unroll
            for (int k0r = 0; k0r < 32; k0r += 8) {
                float v[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const int r = k0r + k;
                    v[k] = stg[r * 32 + (lane ^ fa_dq_swz<32>(r))];
                }
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (qr + k0r + k < T) atomicAdd(dst + (size_t)(k0r + k) * HD, v[k]);
            }
        }
    }

    // epilogue: dK (scaled) -> sK rows, dV -> sV rows of this warp's keys and columns, then
    // 16-byte stores
    // (per query head with heads sharing a key/value head: this head's share, into kv_part
    // [B, T, H, 2, D], which flash_bwd_kv_sum adds up)
    __syncthreads();
    if (PER_HEAD && H != KVH)
        fa_bwd_store_kv<CWT, D>(dk, dv, scale, reinterpret_cast<char*>(sK),
                                reinterpret_cast<char*>(sV), kw, lane, wk0, T,
                                kv_part + ((size_t)b * T * H + blk.h0) * 2 * D, H * 2 * D, D, c0w);
    else
        fa_bwd_store_kv<CWT, D>(dk, dv, scale, reinterpret_cast<char*>(sK),
                                reinterpret_cast<char*>(sV), kw, lane, wk0, T,
                                dqkv + (size_t)b * T * ld + HD + blk.kvh * D, ld, blk.KD, c0w);
}
#define FA_BWD_ARGS                                                                             \
    const __nv_bfloat16 *__restrict__ qkv, const __nv_bfloat16 *__restrict__ dout,            \
        const float *__restrict__ lse, const float *__restrict__ delta,                         \
        float *__restrict__ dq_acc, __nv_bfloat16 *__restrict__ dqkv, int B, int T, int H,      \
        int KVH, float scale, uint32_t thr, float dscale,                                       \
        const unsigned long long *__restrict__ mbits, const int *__restrict__ starts, float cap, \
        __nv_bfloat16 *__restrict__ kv_part
#define FA_BWD_PASS                                                                             \
    qkv, dout, lse, delta, dq_acc, dqkv, B, T, H, KVH, scale, thr, dscale, mbits, starts, cap,  \
        kv_part
extern "C" __global__ void __launch_bounds__(128, 2) flash_bwd_d128_bf16(FA_BWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_bwd[];
    flash_bwd_wide<128, false, false>(FA_BWD_PASS, fa_dyn_bwd);
}
// Head dim 256: grid = (B*H, ceil(T/64), 1), block = (256, 1, 1), dynamic smem =
// FA_BWD_D256_SMEM; one query head a block (a group's heads in parallel: Gemma 3 1B has one
// key/value head for four), whose dK, dV go to kv_part where heads share a key/value head
// (kv_part: [B, T, H, 2, D] bf16, then flash_bwd_kv_sum_d256_bf16), else straight into dqkv.
extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd_d256_bf16(FA_BWD_ARGS) {
    extern __shared__ __align__(128) uint4 fa_dyn_bwd[];
    flash_bwd_wide<256, true, true>(FA_BWD_PASS, fa_dyn_bwd);
}

// dK, dV of each key/value head = the sum of its query heads' shares in kv_part ([B, T, H, 2, D]
// bf16, summed in f32), into dqkv's k and v slots. One thread per 8 columns: grid =
// (ceil(B*T*KVH*2*D/8 / 256), 1, 1), block = (256, 1, 1).
template <int D>
__device__ __forceinline__ void flash_bwd_kv_sum(const __nv_bfloat16* __restrict__ kv_part,
                                                 __nv_bfloat16* __restrict__ dqkv, int B, int T,
                                                 int H, int KVH) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    constexpr int C8 = D / 8;
    if (i >= (size_t)B * T * KVH * 2 * C8) return;
    const int c8 = (int)(i % C8);
    size_t r = i / C8;
    const int which = (int)(r % 2);  // 0: k, 1: v
    r /= 2;
    const int kvh = (int)(r % KVH);
    const size_t bt = r / KVH;
    const int rep = H / KVH;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int j = 0; j < rep; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(
            kv_part + ((bt * H + kvh * rep + j) * 2 + which) * D + c8 * 8);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(p[e]);
            acc[2 * e] += f.x;
            acc[2 * e + 1] += f.y;
        }
    }
    uint4 out;
    out.x = fa_pack(acc[0], acc[1]);
    out.y = fa_pack(acc[2], acc[3]);
    out.z = fa_pack(acc[4], acc[5]);
    out.w = fa_pack(acc[6], acc[7]);
    const size_t ld = (size_t)(H + 2 * KVH) * D;
    *reinterpret_cast<uint4*>(dqkv + bt * ld + (size_t)(H + which * KVH + kvh) * D + c8 * 8) = out;
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_kv_sum_d256_bf16(
    const __nv_bfloat16* __restrict__ kv_part, __nv_bfloat16* __restrict__ dqkv, int B, int T,
    int H, int KVH) {
    flash_bwd_kv_sum<256>(kv_part, dqkv, B, T, H, KVH);
}

// ---------------------------------------------------------------------------------------------
// Backward 3: dq = scale * dq_acc -> bf16 into the q slot of dqkv. 4 elements per thread.
template <int D>
__device__ __forceinline__ void flash_bwd_dq_convert(const float* __restrict__ dq_acc,
                                                     __nv_bfloat16* __restrict__ dqkv, int B, int T,
                                                     int H, int KVH, float scale) {
    const int n4 = B * T * H * (D / 4);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 v = reinterpret_cast<const float4*>(dq_acc)[i];
    const int r = i / (D / 4);  // (b*T + t)*H + h
    const int d = (i % (D / 4)) * 4;
    const int bt = r / H, h = r - bt * H;
    uint2 out;
    out.x = fa_pack(v.x * scale, v.y * scale);
    out.y = fa_pack(v.z * scale, v.w * scale);
    *reinterpret_cast<uint2*>(dqkv + (size_t)bt * (H + 2 * KVH) * D + h * D + d) = out;
}
#define FA_DQ_ARGS                                                                             \
    const float *__restrict__ dq_acc, __nv_bfloat16 *__restrict__ dqkv, int B, int T, int H, \
        int KVH, float scale
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_convert_bf16(FA_DQ_ARGS) {
    flash_bwd_dq_convert<64>(dq_acc, dqkv, B, T, H, KVH, scale);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_convert_d128_bf16(FA_DQ_ARGS) {
    flash_bwd_dq_convert<128>(dq_acc, dqkv, B, T, H, KVH, scale);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_convert_d256_bf16(FA_DQ_ARGS) {
    flash_bwd_dq_convert<256>(dq_acc, dqkv, B, T, H, KVH, scale);
}

#endif  // COCKPIT_FLASH_CU
