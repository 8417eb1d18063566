// Flash attention on Hopper (sm_90a), its products as warpgroup tensor-core instructions (wgmma,
// m64n64k16 and m64n128k16) instead of mma.sync: the main kernel of flash.cu's backward (launch 2
// of 3) for head dims 64 and 128 (flash_bwd_ws: warp-specialized, 128 keys a block) and, at the
// end of this file, the forward for head dims 64 (flash_fwd's loop on wgmma) and 128
// (flash_fwd_ws: warp-specialized, 128 queries a block). Included by kernels.cu; compiled only
// into the compute_90a builds (cockpit_kernels_sm90[_f16].ptx, loaded on compute capability 9.0).
// One file on purpose (about 1,150 lines): the Hopper kernels share the wgmma wrappers and
// descriptors, the named barriers and setmaxnreg splits of warp specialization, and this launch
// contract; split by direction they would each need all of that.
//
// ============================== LAUNCH CONTRACT ==============================================
//   flash_bwd_ws_bf16 (head dim 64), flash_bwd_ws_d128_bf16 (128): the arguments of
//   flash_bwd_bf16, grid = (B*KVH, ceil(T/128), 1), block = (384, 1, 1), dynamic smem =
//   FA_WS_SMEM bytes (above 48 KB: the launcher raises the function's limit). Same preprocess
//   before and dq_convert after.
//   flash_fwd_wg_bf16, flash_fwd_drop_wg_bf16: the arguments, grid and block of flash_fwd_bf16 /
//   flash_fwd_drop_bf16, dynamic smem = 0 (static 41 KB).
//   flash_fwd_ws_d128_bf16, flash_fwd_drop_ws_d128_bf16: the arguments of flash_fwd_bf16, grid =
//   (B*H, ceil(T/128), 1), block = (384, 1, 1), dynamic smem = FA_FWS_D128_SMEM bytes (the
//   launcher raises the function's limit).
// =============================================================================================
//
// The backward, per 64 keys (one MMA warpgroup's) and tile of queries, its operands in shared
// memory in flash.cu's swizzled layout — 128-byte rows whose 16-byte chunks are XOR-ed with the
// row's low three bits, which is exactly wgmma's 128-byte swizzle once a tile starts on a
// 1024-byte boundary:
//   S^T  = K Q^T     (A = K, B = Q, both K-major from shared memory)
//   dP^T = V dO^T    (A = V, B = dO)
//   P^T, dS^T elementwise in registers (the accumulator layout is mma.sync's, row block 16w of
//   warp w, so this part is flash_bwd_bf16's code)
//   dV  += P^T dO    (A = P^T from registers, B = dO read transposed: MN-major)
//   dK  += dS^T Q    (A = dS^T from registers, B = Q transposed)
//   dQ   = dS K      (A = dS^T from shared memory read transposed, B = K transposed), staged
//                     through shared memory and added into dq_acc by bulk reductions
//                     (cp.reduce.async.bulk), a 16 x 64 slab a warp.
// Shared-memory writes by the threads (cp.async, the dS^T stores) are made visible to the
// tensor cores' asynchronous proxy with fence.proxy.async before the barrier that publishes them.
//
// History: the first wgmma backward was one warpgroup over 64 keys, copying its own tiles and
// adding its own dQ (H100, PTX JIT: B=8, T=1024, H=12, KVH=4: 0.153 ms a launch against
// flash_bwd_bf16's 0.183 on mma.sync). Timed with clock64 per phase, a 64 x 64 tile cost one
// block about 5000 cycles against 640 of tensor-core work at peak: bound by latency (the wait at
// each phase, the barrier before dQ, the next tile's copies and dQ's atomics issuing from the
// same warps), not by the products. Hence flash_bwd_ws: the copies and dQ's atomics on a third
// warpgroup, 128 keys a block, 128 x 128 pairs a step. At head dim 128 that one-warpgroup kernel
// ran until the warp-specialized one took that dim too (one H200: see the README's Long context).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)


// Shared-memory matrix descriptors of tiles in the 128-byte swizzle: start address, leading
// byte offset unused (1: every product's k extent lies inside one 128-byte row for K-major
// operands, and its n / m extent of 64 in one for MN-major ones), 1024 bytes between groups of
// eight rows, swizzle mode 1 (128 bytes). wg_desc_at(wg_desc_lo(addr), off) is the descriptor
// of the tile at addr + off: the low word is computed once for a tile and each product's
// descriptor is one add from it (the address field spans 256 KB, more than a block's shared
// memory, so the add never carries out of it) — computed per product, the mask, shift and or
// were a dependent chain of five instructions before each wgmma.
__device__ __forceinline__ uint32_t wg_desc_lo(uint32_t addr) {
    return ((addr & 0x3FFFFu) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t wg_desc_at(uint32_t lo, uint32_t off) {
    return ((uint64_t)((1024u >> 4) | (1u << 30)) << 32) | (uint64_t)(lo + (off >> 4));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fa_fence_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous
// products that own it until the wait.
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// d (64 x 64, fp32) = A (64 x 16) B (16 x 64) + (acc ? d : 0), both operands in shared memory;
// TA / TB = 1: the operand is stored MN-major (transposed).
template <int TA, int TB>
__device__ __forceinline__ void wg_ss(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." FA_AB "." FA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}
// d += A (registers, mma.sync's A-fragment layout per warp) B (shared memory)
template <int TB>
__device__ __forceinline__ void wg_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." FA_AB "." FA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, %37;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB));
}

// d (64 x 128, fp32) = A (64 x 16) B (16 x 128) + (acc ? d : 0), both operands in shared memory
// (B: 128 rows of a K-major operand, two 64-row tiles one after the other).
template <int TA, int TB>
__device__ __forceinline__ void wg_ss128(float (&d)[16][4], uint64_t da, uint64_t db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." FA_AB "." FA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}

// dq_acc on Hopper: slabs of 16 queries x 64 columns (4 KB), one a warp and step, each slab's
// floats in the order of the wgmma accumulator's fragments — float4 k of lane l's column tile nt
// at (nt * 32 + l) * 4 + k, i.e. rows g and g + 8 (g = l / 4), columns nt * 8 + 2 (l % 4) + 0, 1 —
// so that a warp stages its slab with conflict-free float4 stores and one bulk copy adds it into
// global memory as it lies. Slab (b, h, t / 16, d / 64) starts at float
// (((b * H + h) * ceil(T / 16) + t / 16) * (D / 64) + d / 64) * 1024; flash_bwd_dq_convert_ws
// turns it into dQ. (The rows of a last slab past T are padding the arena allots and nothing
// reads.)
#define FA_SLAB (16 * 64)
__device__ __forceinline__ size_t fa_slab_at(int bh, int t16, int p, int T, int D) {
    return (((size_t)bh * ((T + 15) >> 4) + t16) * (D / 64) + p) * FA_SLAB;
}
// A warp's 16 x 64 tile of dQ added into its slab of dq_acc at `dst`: staged in `stg` (its
// buffer, 4 KB) and added by one bulk reduction (cp.reduce.async.bulk .add.f32: atomic per
// element, as the other key blocks add into the same rows) that lane 0 issues and tracks. The
// buffer is rewritten two calls later: lane 0 first waits until at most one of its reductions
// is still reading shared memory (the last call's, from the other buffer). `dst` null: nothing
// to add (the slab starts past T), an empty group keeps the count.
__device__ __forceinline__ void fa_ws_reduce_dq(const float (&dq)[8][4], float* stg, float* dst,
                                                int lane) {
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<float4*>(stg + (nt * 32 + lane) * 4) =
            make_float4(dq[nt][0], dq[nt][1], dq[nt][2], dq[nt][3]);
    fa_fence_async();  // the stores, visible to the bulk copy (the asynchronous proxy)
    __syncwarp();
    if (lane == 0) {
        if (dst != nullptr)
            asm volatile(
                "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                "r"(fa_smem_u32(stg)), "n"(FA_SLAB * 4)
                : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
}
// The last reductions done (before the block's shared memory goes away).
__device__ __forceinline__ void fa_ws_reduce_drain(int lane) {
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
#define FA_WG_ARGS const __nv_bfloat16* __restrict__ qkv, const __nv_bfloat16* __restrict__ dout, \
                  const float* __restrict__ lse, const float* __restrict__ delta, \
                  float* __restrict__ dq_acc, __nv_bfloat16* __restrict__ dqkv, int B, int T, \
                  int H, int KVH, float scale, uint32_t thr, float dscale, \
                  const unsigned long long* __restrict__ mbits, const int* __restrict__ starts, \
                  float cap /* unused: no soft-cap at these head dims */, \
                  __nv_bfloat16* kv_part /* unused: the group's heads in one block */
#define FA_WG_PASS qkv, dout, lse, delta, dq_acc, dqkv, B, T, H, KVH, scale, thr, dscale, mbits, starts, cap, kv_part

// d (64 x 64) = A B^T for two 64-row tiles of D columns (K-major, as 64-column panels) whose
// descriptors' low words are la and lb (wg_desc_lo): D / 16 k-steps, four in each panel. The
// caller fences and commits.
template <int D>
__device__ __forceinline__ void fa_wg_ss_panels(float (&d)[8][4], uint32_t la, uint32_t lb) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const uint32_t off = (kc >> 2) * (64 * 64 * 2) + (kc & 3) * 32;
        wg_ss<0, 0>(d, wg_desc_at(la, off), wg_desc_at(lb, off), kc);
    }
}
// acc (64 x D, fp32, as 64-column panels) += A B, A the K x 64 register fragments `a` (k-steps of
// 16), B MN-major from shared memory whose descriptor's low word is lb: a 64-column panel of it
// every 8 KB, a k-step every 2048 bytes. The caller fences and commits.
template <int D, int K>
__device__ __forceinline__ void fa_wg_rs_panels(float (&acc)[D / 8][4], const uint32_t (&a)[K][4],
                                                uint32_t lb) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p) {
        float(&ap)[8][4] = *reinterpret_cast<float(*)[8][4]>(&acc[8 * p]);
#pragma unroll
        for (int kc = 0; kc < K; ++kc)
            wg_rs<1>(ap, a[kc], wg_desc_at(lb, p * (64 * 64 * 2) + kc * 2048));
    }
}


// ---------------------------------------------------------------------------------------------
// The Hopper backward (FlashAttention-3's shape): 128 keys a block, three warpgroups, 128 x 128
// (query, key) pairs a step — at head dim 64 a tile of 128 queries, at head dim 128 one of 64
// (QH = 128 / D halves of 64 queries: S^T, dP^T, dK and dV are then 192 registers a thread at
// either dim). WG0 and WG1 own 64 keys each: S^T = K Q^T and dP^T = V dO^T (64 keys x 64·QH
// queries: m64n128k16 products at head dim 64, two 64-column panels of k at 128), P^T and dS^T
// in registers, dV += P^T dO and dK += dS^T Q with k = the step's queries; then, with both
// warpgroups' dS^T in shared memory, each computes a half of the step's dQ over all 128 keys —
// at head dim 64 its 64-query half, at 128 its 64-column panel of the head dim — and each warp
// adds its 16 x 64 slab into dq_acc by one bulk reduction from shared memory (fa_ws_reduce_dq,
// two staging buffers) — in the next step: at head dim 64 after that step's dV and dK products
// (fa_ws_mma_defer), at 128 beside that step's S^T (fa_ws_mma_pipe). WG2 copies — K and V
// once, then each step's (Q, dO) into a two-slot ring. (Before: WG2 added the staged dQ with
// 16-byte vector atomics — which itself had beaten the MMA warps issuing them, 335 -> 362
// TFLOP/s — and published the next step's tiles only after them: the MMA warps waited at FULL
// a fifth of their samples at head dim 128, Nsight Compute.) The plain loops apply the causal
// mask only on the tiles where a warp's keys reach a query (fa_ws_probs_s). Against
// 64-query tiles at head dim 64 (this kernel's previous shape, with WG2 computing dQ): half the
// product instructions for S^T and dP^T (a quarter fewer shared-memory bytes a product), and
// half the steps, barriers, waits and row-stat loads — one H200, the 114M at T32768: the
// backward 293 -> 338 TFLOP/s, 259.9 -> 238.1 ms a step. Shared memory (64 x 64 tiles of 8 KB;
// a D-column tile of 64 rows is D / 64 of them, panel after panel): K0 K1 V0 V1 (64 keys each),
// two ring slots of (Q, dO) — QH tiles of 64 queries each, one after the other, so that a slot's
// Q is one K-major operand of 64·QH rows — two dS^T slots of 2·QH tiles (kh·QH + qh: keys
// 64kh.., queries 64qh..), two dQ staging buffers (160 KB on), and each ring slot's row
// statistics, lse and delta of its queries (1 KB a slot, 224 KB on; 227 KB in all, Hopper's
// most a block: the MMA warps read them with a shared-memory load where they were 8 global
// loads a thread a step, shuffled out to the lanes — waiting on those loads was the largest
// single stall at head dim 64 in Nsight Compute's samples; one H100, T = 16384: 376 -> 420
// TFLOP/s at head dim 64, 459 -> 459 at 128). Barriers:
//   FULL[s]   WG2 -> WG0, WG1 (384): ring slot s landed (its tiles and statistics)
//   EMPTY[s]  WG0, WG1 -> WG2 (384): their products on slot s are done (refill it)
//   DS        WG0 <-> WG1 (256): both halves of this step's dS^T are written (head dim 128:
//             fa_ws_mma_pipe, fa_ws_mma; a dS^T slot is rewritten two steps later, after both
//             warpgroups have passed the DS barrier of the step between — each waits for its
//             dQ products before reaching it)
//   DSR[w][s], FREE[w][s]  WG w -> WG 1-w (256): head dim 64, fa_ws_mma_defer (no DS)
// Registers: FaWs.
// Launch: grid (B*KVH, ceil(T/128)), block 384, dynamic smem FA_WS_SMEM (flash_smem.h).
#define FA_WS_FULL 1
#define FA_WS_EMPTY 3
// named barrier `id` of N threads (the block's 384, or the two MMA warpgroups' 256)
template <int N = 384>
__device__ __forceinline__ void fa_ws_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(N) : "memory");
}
template <int N = 384>
__device__ __forceinline__ void fa_ws_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(N) : "memory");
}

#define FA_WS_DS 5
// floats in one dQ staging buffer: eight warps' 16 x 64 slabs
#define FA_WS_STG (8 * 16 * 64)
// Where the shared-memory regions start (bytes from the 1024-byte-aligned base): the ring, the
// dS^T slots, the staging buffers, the ring slots' statistics — the same 226 KB at both head
// dims (and 1 KB to align them).
template <int D>
struct FaWs {
    static constexpr int QH = 128 / D;            // 64-query halves a step
    static constexpr uint32_t TILE = 64 * 64 * 2; // a 64 x 64 bf16 tile (a panel)
    static constexpr uint32_t TD = 64 * D * 2;    // 64 rows of the head dim
    static constexpr uint32_t RING = 4 * TD, DS = RING + 8 * TILE, STG = DS + 4 * QH * TILE;
    // a ring slot's row statistics: lse, then delta, of its (up to) STAT_Q queries (fp32)
    static constexpr int STAT_Q = 128;
    static constexpr uint32_t STAT = STG + 2 * FA_WS_STG * 4, STAT_SLOT = 2 * STAT_Q * 4;
    // Registers a thread (setmaxnreg) of WG2 and of the MMA warpgroups: 24 + 2 x 240 of the
    // block's 3 x 168 at both head dims (ptxas 13.0 spills 8 bytes of fa_ws_mma_defer's plain
    // loop; at 232 the lockstep loop spilled 148 bytes). At head dim 128 the pipelined loop
    // keeps a step's S^T in flight beside its dK, dV (128 registers) and the last step's dQ:
    // at 32 + 2 x 232 it spilled 68 bytes, at 240 16 (scalars: three loads a step in the MMA
    // loop, one in the copy warpgroup's).
    static constexpr int REGS_COPY = 24, REGS_MMA = 240;
    static_assert(STG == 20 * TILE, "flash_smem.h's FA_WS_SMEM lays out 20 tiles before dQ's");
};

// Step `it`'s (Q, dO) into ring slot `slot` (Q's QH tiles, then dO's) and its queries' lse and
// delta into the slot's statistics at `stat`, by WG2's threads (pt).
template <int D>
__device__ __forceinline__ void fa_ws_load(const FaBwdBlock<D, 128>& blk, int it, uint32_t slot,
                                           uint32_t stat, const float* __restrict__ lse,
                                           const float* __restrict__ delta, int H, int T, int pt) {
    using W = FaWs<D>;
    int h, i;
    blk.template at<W::QH>(it, h, i);
    // the step's lse and delta rows (4 bytes a copy: a row need not start 16-byte aligned; past
    // T zeros, which only padded queries read — their dO rows are zeros, so dS is 0 there)
    const int q = i * FA_BM + pt;
    if (pt < 64 * W::QH) {
        const size_t at = ((size_t)blk.b * H + h) * T + min(q, T - 1);
        const uint32_t n = q < T ? 4 : 0;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(stat + pt * 4),
                     "l"(lse + at), "r"(n)
                     : "memory");
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                         stat + W::STAT_Q * 4 + pt * 4),
                     "l"(delta + at), "r"(n)
                     : "memory");
    }
#pragma unroll
    for (int qh = 0; qh < W::QH; ++qh) {
        fa_load_tile<D, true, 1>(slot + qh * W::TD, blk.qkv_b + h * D, blk.ld, (i + qh) * FA_BM, T,
                           pt);
        fa_load_tile<D, true, 1>(slot + (W::QH + qh) * W::TD, blk.dout_b + h * D, blk.HD,
                           (i + qh) * FA_BM, T, pt);
    }
}

// What a step of flash_bwd_ws's MMA warpgroups computes, piece by piece (fa_ws_mma and
// fa_ws_mma_defer put them in their orders). FaWsStep: the step's place (head h, queries q0..)
// and its ring slot's operand descriptors.
template <int D>
struct FaWsStep {
    int h, q0;
    uint32_t lQa, ldOa;
    const float* srow;  // the ring slot's row statistics (lse, then delta)
    __device__ __forceinline__ FaWsStep(const FaBwdBlock<D, 128>& blk, int it, uint32_t lQD,
                                        const char* smc) {
        srow = reinterpret_cast<const float*>(smc + FaWs<D>::STAT +
                                              (it & 1) * FaWs<D>::STAT_SLOT);
        constexpr int QH = FaWs<D>::QH;
        int i;
        blk.template at<QH>(it, h, i);
        q0 = i * FA_BM;
        lQa = lQD + (it & 1) * (4 * FaWs<D>::TILE >> 4);
        ldOa = lQa + (QH * FaWs<D>::TD >> 4);
    }
};

// A MMA thread's constants over the loop: its warp's first key (wk0) and its own (kr0), its
// column pair (t4), its rows of the dS^T tiles (lr0, lr1), the block's packed-row starts (st_b,
// ANY only) and the softmax scale in log2 units.
struct FaWsLane {
    int wk0, kr0, t4, lr0, lr1;
    const int* st_b;
    float sl2;
};
template <int D, bool ANY>
__device__ __forceinline__ FaWsLane fa_ws_lane(const int* starts, int T, float scale,
                                               const FaBwdBlock<D, 128>& blk, int wg, int warp,
                                               int lane) {
    FaWsLane ln;
    const int g = lane >> 2;
    ln.t4 = lane & 3;
    ln.st_b = ANY && starts != nullptr ? starts + (size_t)blk.b * T : nullptr;
    ln.sl2 = scale * 1.4426950408889634f;
    ln.wk0 = blk.k0 + 64 * wg + warp * 16;
    ln.kr0 = ln.wk0 + g;
    ln.lr0 = warp * 16 + g;
    ln.lr1 = ln.lr0 + 8;
    return ln;
}

// S^T = K Q^T and dP^T = V dO^T of a step issued, one group each (the caller fences).
template <int D>
__device__ __forceinline__ void fa_ws_issue_sdp(float (&st)[8 * FaWs<D>::QH][4],
                                                float (&dpt)[8 * FaWs<D>::QH][4], uint32_t lKc,
                                                uint32_t lVc, const FaWsStep<D>& sp) {
    if constexpr (FaWs<D>::QH == 2) {  // 64 keys x 128 queries, k = the head dim
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
            wg_ss128<0, 0>(st, wg_desc_at(lKc, kc * 32), wg_desc_at(sp.lQa, kc * 32), kc);
        wg_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
            wg_ss128<0, 0>(dpt, wg_desc_at(lVc, kc * 32), wg_desc_at(sp.ldOa, kc * 32), kc);
        wg_commit();
    } else {  // 64 keys x 64 queries, k = the head dim: four k-steps in each of its panels
        fa_wg_ss_panels<D>(st, lKc, sp.lQa);
        wg_commit();
        fa_wg_ss_panels<D>(dpt, lVc, sp.ldOa);
        wg_commit();
    }
}

// P^T of a 64-query part of a step (queries q0..) from its S^T, the queries' lse in shared
// memory (lrow: their 64, natural-log units, as the forward stored them); MASK: the causal mask.
// A thread reads its column pair's two values a tile (every lane of a column pair the same
// 8 bytes), where fa_bwd_probs_rows shuffles them out of the lanes' registers. (Read before
// the wait for S^T instead, the backward ran 426 / 427 -> 409 / 406 TFLOP/s at head dim 64.)
template <int MASK>
__device__ __forceinline__ void fa_ws_probs_s(float (&st)[8][4], const float* lrow, float sl2,
                                              int q0, int kr0, int t4) {
    const float L2E = 1.4426950408889634f;
    const int kr1 = kr0 + 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 l = *reinterpret_cast<const float2*>(lrow + nt * 8 + t4 * 2);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int q = q0 + nt * 8 + t4 * 2 + e;
            const float lq = (e ? l.y : l.x) * L2E;
            float p0 = exp2f(fmaf(st[nt][e], sl2, -lq));
            float p1 = exp2f(fmaf(st[nt][2 + e], sl2, -lq));
            if (MASK) {
                if (kr0 > q) p0 = 0.f;
                if (kr1 > q) p1 = 0.f;
            }
            st[nt][e] = p0;
            st[nt][2 + e] = p1;
        }
    }
}
// dS^T = P^T ∘ (dP^T − delta) of a 64-query part, the queries' delta in shared memory (drow).
__device__ __forceinline__ void fa_ws_dscores_s(const float (&st)[8][4], float (&dpt)[8][4],
                                                const float* drow, int t4) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(drow + nt * 8 + t4 * 2);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float dl = e ? d.y : d.x;
            dpt[nt][e] = st[nt][e] * (dpt[nt][e] - dl);
            dpt[nt][2 + e] = st[nt][2 + e] * (dpt[nt][2 + e] - dl);
        }
    }
}

// P^T and dS^T of a step from its S^T and dP^T (the two groups fa_ws_issue_sdp issued, the
// only ones in flight: waited for here), packed as the A fragments of dV += P^T dO (pa) and of
// dK += dS^T Q (sa). ANY: packed rows or attention dropout (see fa_ws_mma); the plain loop
// reads the queries' row statistics from the ring slot (sp.srow), the ANY loop from global
// memory, shuffled out with its sample starts and flag words.
template <int D, bool ANY>
__device__ __forceinline__ void fa_ws_grads(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                            const FaWsStep<D>& sp, const FaWsLane& ln,
                                            int lane, float (&st)[8 * FaWs<D>::QH][4],
                                            float (&dpt)[8 * FaWs<D>::QH][4],
                                            uint32_t (&pa)[4 * FaWs<D>::QH][4],
                                            uint32_t (&sa)[4 * FaWs<D>::QH][4]) {
    constexpr int QH = FaWs<D>::QH;
    const int wk0 = ln.wk0, kr0 = ln.kr0, t4 = ln.t4;
    const int* st_b = ln.st_b;
    const float sl2 = ln.sl2;
    const size_t bh = (size_t)blk.b * H + sp.h;
    // (the ANY loop's) lane's queries' lse and delta, sample starts and dropout flag words
    float ls[QH][2], dl[QH][2];
    int sq[QH][2] = {};
    unsigned long long mw[QH][2] = {};
#pragma unroll
    for (int qh = 0; qh < QH && ANY; ++qh) {
        fa_bwd_row_stats(lse, delta, bh, sp.q0 + 64 * qh, T, lane, ls[qh][0], ls[qh][1],
                         dl[qh][0], dl[qh][1]);
        if (st_b != nullptr)
            fa_bwd_row_starts(st_b, sp.q0 + 64 * qh, T, lane, sq[qh][0], sq[qh][1]);
        if (thr)
            fa_bwd_row_mbits(mbits, bh, T, blk.nq, kr0 >> 6, sp.q0 + 64 * qh, lane, mw[qh][0],
                             mw[qh][1]);
    }
    wg_wait<1>();
    wg_pin(st);
#pragma unroll
    for (int qh = 0; qh < QH; ++qh) {
        float(&sth)[8][4] = *reinterpret_cast<float(*)[8][4]>(&st[8 * qh]);
        const int qq = sp.q0 + 64 * qh;
        if (ANY)
            fa_bwd_probs<true>(sth, ls[qh][0], ls[qh][1], sl2, qq, wk0, kr0, t4, st_b, T,
                               sq[qh][0], sq[qh][1]);
        else if (wk0 + 15 > qq)  // the causal mask only where the warp's keys reach a query
            fa_ws_probs_s<1>(sth, sp.srow + 64 * qh, sl2, qq, kr0, t4);
        else
            fa_ws_probs_s<0>(sth, sp.srow + 64 * qh, sl2, qq, kr0, t4);
    }
    wg_wait<0>();
    wg_pin(dpt);
#pragma unroll
    for (int qh = 0; qh < QH; ++qh) {
        float(&sth)[8][4] = *reinterpret_cast<float(*)[8][4]>(&st[8 * qh]);
        float(&dph)[8][4] = *reinterpret_cast<float(*)[8][4]>(&dpt[8 * qh]);
        if (ANY)
            fa_bwd_dscores<true>(sth, dph, dl[qh][0], dl[qh][1], sp.q0 + 64 * qh, kr0, t4, T, thr,
                                 dscale, mbits, bh, blk.nq, mw[qh][0], mw[qh][1]);
        else
            fa_ws_dscores_s(sth, dph, sp.srow + FaWs<D>::STAT_Q + 64 * qh, t4);
    }
#pragma unroll
    for (int kc = 0; kc < 4 * QH; ++kc) {
        fa_frag(st, kc, pa[kc]);
        fa_frag(dpt, kc, sa[kc]);
    }
}

// dS^T of this warpgroup's 64 keys -> its tiles of dS^T slot s (the caller fences and
// publishes them).
template <int D>
__device__ __forceinline__ void fa_ws_store_ds(char* smc, int s, int wg, const FaWsLane& ln,
                                               const uint32_t (&sa)[4 * FaWs<D>::QH][4]) {
    constexpr int QH = FaWs<D>::QH;
    const int lr0 = ln.lr0, lr1 = ln.lr1, t4 = ln.t4;
#pragma unroll
    for (int qh = 0; qh < QH; ++qh) {
        char* sdSc = smc + FaWs<D>::DS + (2 * QH * s + QH * wg + qh) * FaWs<D>::TILE;
#pragma unroll
        for (int k4 = 0; k4 < 4; ++k4)
            fa_store_frag(sdSc, sa[4 * qh + k4], lr0, lr1, k4 * 16 + t4 * 2);
    }
}

// This warpgroup's half of a step's dQ = dS K over the block's 128 keys (A = dS^T slot s's
// tiles read transposed, B = K's tiles read transposed), issued as one group.
template <int D>
__device__ __forceinline__ void fa_ws_issue_dq(float (&dq)[8][4], uint32_t lSw, uint32_t lKw,
                                               int s) {
    constexpr int QH = FaWs<D>::QH;
    constexpr uint32_t TILE = FaWs<D>::TILE, TD = FaWs<D>::TD;
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
            wg_ss<1, 1>(dq, wg_desc_at(lSw, (2 * QH * s + QH * kh) * TILE + kc * 2048),
                        wg_desc_at(lKw, kh * TD + kc * 2048), kh | kc);
    wg_commit();
}

// A step's dQ (this warp's 16 x 64 slab) into dq_acc through staging buffer s.
template <int D>
__device__ __forceinline__ void fa_ws_dq_out(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                             const FaWsStep<D>& sp, const float (&dq)[8][4],
                                             float* stg, int s, int wg, int warp, int lane) {
    constexpr int QH = FaWs<D>::QH;
    const int qw = sp.q0 + (QH == 2 ? 64 * wg : 0) + warp * 16;
    fa_ws_reduce_dq(dq, stg + s * FA_WS_STG,
                    qw < T ? dq_acc + fa_slab_at(blk.b * H + sp.h, qw >> 4, QH == 2 ? 0 : wg, T, D)
                           : nullptr,
                    lane);
}

// The products' shared-memory descriptors, each one add from these (wg_desc_at): warpgroup
// wg's K and V tiles; the ring's first slot; dQ's A (the dS^T tiles of its query half) and B (K,
// or its head-dim panel of K).
template <int D>
struct FaWsDesc {
    uint32_t lKc, lVc, lQD, lSw, lKw;
    __device__ __forceinline__ FaWsDesc(uint32_t base, int wg) {
        using W = FaWs<D>;
        lKc = wg_desc_lo(base + wg * W::TD);
        lVc = wg_desc_lo(base + (2 + wg) * W::TD);
        lQD = wg_desc_lo(base + W::RING);
        lSw = wg_desc_lo(base + W::DS + (W::QH == 2 ? wg * W::TILE : 0));
        lKw = wg_desc_lo(base + (W::QH == 2 ? 0 : wg * W::TILE));
    }
};

// dV += P^T dO and dK += dS^T Q issued as one group (k = the step's 64·QH queries, 2048 bytes a
// k-step; a product per 64-column panel of dO and Q into the matching part of dV and dK), left
// in flight.
template <int D>
__device__ __forceinline__ void fa_ws_issue_dkv(const FaWsStep<D>& sp,
                                                const uint32_t (&pa)[4 * FaWs<D>::QH][4],
                                                const uint32_t (&sa)[4 * FaWs<D>::QH][4],
                                                float (&dk)[D / 8][4], float (&dv)[D / 8][4]) {
    wg_fence();
    fa_wg_rs_panels<D>(dv, pa, sp.ldOa);
    fa_wg_rs_panels<D>(dk, sa, sp.lQa);
    wg_commit();
}

// A step's first part in fa_ws_mma and fa_ws_mma_defer: once ring slot s has landed, S^T and
// dP^T, then P^T and dS^T (into pa and sa), then dV and dK issued (fa_ws_issue_dkv), left in
// flight.
template <int D, bool ANY>
__device__ __forceinline__ void fa_ws_front(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                            const FaWsStep<D>& sp, const FaWsLane& ln,
                                            const FaWsDesc<D>& dc, int s, int lane,
                                            uint32_t (&pa)[4 * FaWs<D>::QH][4],
                                            uint32_t (&sa)[4 * FaWs<D>::QH][4],
                                            float (&dk)[D / 8][4], float (&dv)[D / 8][4]) {
    constexpr int QH = FaWs<D>::QH;
    fa_ws_sync(FA_WS_FULL + s);
    float st[8 * QH][4], dpt[8 * QH][4];
    wg_fence();
    fa_ws_issue_sdp<D>(st, dpt, dc.lKc, dc.lVc, sp);
    fa_ws_grads<D, ANY>(FA_WG_PASS, blk, sp, ln, lane, st, dpt, pa, sa);
    fa_ws_issue_dkv<D>(sp, pa, sa, dk, dv);
}

// The two MMA warpgroups of flash_bwd_ws (warpgroup wg: keys 64wg.. of the block), a step
// per 128 x 128 pairs; dK and dV left in registers. ANY: packed rows (starts) or attention
// dropout (thr) — a loop of its own, so that the plain one carries neither; there each lane
// loads its two queries' sample starts and flag words once a half and the middle shuffles them
// out (loaded per element, the 128-query tile's registers spilled). At head dim 128 only the
// ANY loop runs here: the plain one is fa_ws_mma_pipe (below), and head dim 64 takes
// fa_ws_mma_defer.
template <int D, bool ANY>
__device__ __forceinline__ void fa_ws_mma(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                          int steps, uint32_t base, char* smc, int wg, int warp,
                                          int lane, float (&dk)[D / 8][4], float (&dv)[D / 8][4]) {
    using W = FaWs<D>;
    constexpr int QH = W::QH;
    if (!ANY) thr = 0;
    const FaWsLane ln = fa_ws_lane<D, ANY>(starts, T, scale, blk, wg, warp, lane);
    float* stg = reinterpret_cast<float*>(smc + W::STG) + (4 * wg + warp) * FA_SLAB;
    const FaWsDesc<D> dc(base, wg);
    for (int it = 0; it < steps; ++it) {
        const int s = it & 1;
        const FaWsStep<D> sp(blk, it, dc.lQD, smc);
        uint32_t pa[4 * QH][4], sa[4 * QH][4];
        fa_ws_front<D, ANY>(FA_WG_PASS, blk, sp, ln, dc, s, lane, pa, sa, dk, dv);
        // dS^T -> this warpgroup's tiles of dS^T slot s, while those run
        fa_ws_store_ds<D>(smc, s, wg, ln, sa);
        fa_fence_async();
        fa_ws_sync<256>(FA_WS_DS);
        float dq[8][4];
        wg_fence();
        fa_ws_issue_dq<D>(dq, dc.lSw, dc.lKw, s);
        wg_wait<1>();  // dV, dK done reading slot s
        wg_pin(dv);
        wg_pin(dk);
        if (it + 2 < steps) fa_ws_arrive(FA_WS_EMPTY + s);
        wg_wait<0>();
        wg_pin(dq);
        fa_ws_dq_out<D>(FA_WG_PASS, blk, sp, dq, stg, s, wg, warp, lane);
    }
    fa_ws_reduce_drain(lane);
}

// Barriers of fa_ws_mma_defer (ids past FA_WS_EMPTY's two), each between the two MMA
// warpgroups (256: one arrives, the other syncs): DSR + 2w + s, warpgroup w's half of dS^T slot
// s is written; FREE + 2w + s, warpgroup w's dQ product is done reading slot s.
#define FA_WS_DSR 5
#define FA_WS_FREE 9

// The head-dim-64 loop: fa_ws_mma with each step's dQ product issued in the next step, after
// that step's dV and dK products. In fa_ws_mma both MMA warpgroups meet at the DS barrier every
// step and so run in lockstep, their exponentials (16 a cycle an SM) and the products never
// overlapping; here nothing makes them meet: each publishes its half of a step's dS^T (DSR) and
// waits only for the other's half of the step before, which the other wrote a phase earlier,
// and rewrites a dS^T slot once the other's dQ product has read it (FREE). Each dQ is staged
// and added as in fa_ws_mma, a step later. One H100, `--profile` at T = 16384: the backward
// 368 / 370 -> 383 / 378 TFLOP/s (the lockstep loop's build beside it, one call); taking turns
// to issue the products (FlashAttention-3's forward's ping-pong, two more barriers) ran 379 /
// 378 against 382 / 383 without, and at head dim 128 this loop ran 443 against 461.
template <int D, bool ANY>
__device__ __forceinline__ void fa_ws_mma_defer(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                                int steps, uint32_t base, char* smc, int wg,
                                                int warp, int lane, float (&dk)[D / 8][4],
                                                float (&dv)[D / 8][4]) {
    using W = FaWs<D>;
    constexpr int QH = W::QH;
    if (!ANY) thr = 0;
    const FaWsLane ln = fa_ws_lane<D, ANY>(starts, T, scale, blk, wg, warp, lane);
    const int other = wg ^ 1;
    float* stg = reinterpret_cast<float*>(smc + W::STG) + (4 * wg + warp) * FA_SLAB;
    const FaWsDesc<D> dc(base, wg);
    for (int it = 0; it < steps; ++it) {
        const int s = it & 1;
        const FaWsStep<D> sp(blk, it, dc.lQD, smc);
        uint32_t pa[4 * QH][4], sa[4 * QH][4];
        fa_ws_front<D, ANY>(FA_WG_PASS, blk, sp, ln, dc, s, lane, pa, sa, dk, dv);
        // this step's dS^T -> slot s once the other's dQ product of step it - 2 is done with it
        if (it >= 2) fa_ws_sync<256>(FA_WS_FREE + 2 * other + s);
        fa_ws_store_ds<D>(smc, s, wg, ln, sa);
        fa_fence_async();
        fa_ws_arrive<256>(FA_WS_DSR + 2 * wg + s);
        // the last step's dQ, once the other's half of its dS^T is in (at the first step a
        // product of the slot's stale tiles that nothing reads: issued under a branch, ptxas
        // keeps the loop's products apart less well — it spilled 500 bytes)
        float dq[8][4];
        if (it >= 1) fa_ws_sync<256>(FA_WS_DSR + 2 * other + (s ^ 1));
        wg_fence();
        fa_ws_issue_dq<D>(dq, dc.lSw, dc.lKw, s ^ 1);
        wg_wait<1>();  // dV, dK done reading ring slot s
        wg_pin(dv);
        wg_pin(dk);
        if (it + 2 < steps) fa_ws_arrive(FA_WS_EMPTY + s);
        wg_wait<0>();
        wg_pin(dq);
        if (it >= 1) {
            // (the other rewrites slot s ^ 1 at step it + 1)
            if (it + 1 < steps) fa_ws_arrive<256>(FA_WS_FREE + 2 * wg + (s ^ 1));
            fa_ws_dq_out<D>(FA_WG_PASS, blk, FaWsStep<D>(blk, it - 1, dc.lQD, smc), dq, stg,
                            s ^ 1, wg, warp, lane);
        }
    }
    if (steps > 0) {
        const int s = (steps - 1) & 1;
        float dq[8][4];
        fa_ws_sync<256>(FA_WS_DSR + 2 * other + s);
        wg_fence();
        fa_ws_issue_dq<D>(dq, dc.lSw, dc.lKw, s);
        wg_wait<0>();
        wg_pin(dq);
        fa_ws_dq_out<D>(FA_WG_PASS, blk, FaWsStep<D>(blk, steps - 1, dc.lQD, smc), dq, stg, s,
                        wg, warp, lane);
    }
    fa_ws_reduce_drain(lane);
}

// The part of a fa_ws_mma_pipe step after its S^T is issued (and the last step's dQ added):
// dP^T, P^T and dS^T, dV and dK; dS^T into its slot for the two warpgroups' dQ products, which
// the next step issues; ring slot s released once dV and dK are done. Nothing is left in
// flight.
template <int D>
__device__ __forceinline__ void fa_ws_pipe_body(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                                const FaWsStep<D>& sp, int it, int steps,
                                                const FaWsLane& ln, const FaWsDesc<D>& dc,
                                                char* smc, int wg, int lane, float (&st)[8][4],
                                                float (&dk)[D / 8][4], float (&dv)[D / 8][4]) {
    const int s = it & 1;
    float dpt[8][4];
    uint32_t pa[4][4], sa[4][4];
    wg_fence();
    fa_wg_ss_panels<D>(dpt, dc.lVc, sp.ldOa);
    wg_commit();
    fa_ws_grads<D, false>(FA_WG_PASS, blk, sp, ln, lane, st, dpt, pa, sa);
    fa_ws_issue_dkv<D>(sp, pa, sa, dk, dv);
    fa_ws_store_ds<D>(smc, s, wg, ln, sa);
    fa_fence_async();
    fa_ws_sync<256>(FA_WS_DS);
    wg_wait<0>();  // dV, dK done reading slot s
    wg_pin(dv);
    wg_pin(dk);
    if (it + 2 < steps) fa_ws_arrive(FA_WS_EMPTY + s);
}

// The head-dim-128 plain loop pipelined inside each warpgroup, as the forward's flash_fwd_ws
// pairs a tile's S with the last one's P V: each step issues the step before's dQ product and
// its own S^T = K Q^T as two groups, stages and adds that dQ slab while S^T runs, then issues
// dP^T — so the tensor cores take dQ and S^T back to back, and the exponentials start as soon
// as dP^T is issued. Every product is waited for in the step that issues it (with one in flight
// across the loop's back edge ptxas serialized them all, remark C7514); the first step, which
// has no dQ before it, is peeled (steps >= 1 on this path: a block's first query tile is its
// own) and the last dQ follows the loop. One H100, `--profile` at T = 16384, six heads of 128:
// the backward 463–468 -> 487–497 TFLOP/s (fa_ws_mma's loop beside it, alternated, two calls).
// Measured and dropped beside it: this loop without the per-step DS barrier (DSR / FREE as in
// fa_ws_mma_defer) 474–478; with dV += P^T dO issued before dS^T's arithmetic (FlashAttention-
// 3's order) 423–424, its 136 bytes of spills in the loop.
template <int D>
__device__ __forceinline__ void fa_ws_mma_pipe(FA_WG_ARGS, const FaBwdBlock<D, 128>& blk,
                                               int steps, uint32_t base, char* smc, int wg,
                                               int warp, int lane, float (&dk)[D / 8][4],
                                               float (&dv)[D / 8][4]) {
    using W = FaWs<D>;
    static_assert(W::QH == 1, "one 64-query tile a step");
    thr = 0;
    const FaWsLane ln = fa_ws_lane<D, false>(starts, T, scale, blk, wg, warp, lane);
    float* stg = reinterpret_cast<float*>(smc + W::STG) + (4 * wg + warp) * FA_SLAB;
    const FaWsDesc<D> dc(base, wg);
    {
        const FaWsStep<D> sp(blk, 0, dc.lQD, smc);
        float st[8][4];
        fa_ws_sync(FA_WS_FULL);
        wg_fence();
        fa_wg_ss_panels<D>(st, dc.lKc, sp.lQa);
        wg_commit();
        fa_ws_pipe_body<D>(FA_WG_PASS, blk, sp, 0, steps, ln, dc, smc, wg, lane, st, dk, dv);
    }
    for (int it = 1; it < steps; ++it) {
        const int s = it & 1;
        const FaWsStep<D> sp(blk, it, dc.lQD, smc);
        float st[8][4], dq[8][4];
        fa_ws_sync(FA_WS_FULL + s);
        wg_fence();
        fa_ws_issue_dq<D>(dq, dc.lSw, dc.lKw, s ^ 1);
        fa_wg_ss_panels<D>(st, dc.lKc, sp.lQa);
        wg_commit();
        wg_wait<1>();  // the dQ (S^T still running)
        wg_pin(dq);
        fa_ws_dq_out<D>(FA_WG_PASS, blk, FaWsStep<D>(blk, it - 1, dc.lQD, smc), dq, stg, s ^ 1,
                        wg, warp, lane);
        fa_ws_pipe_body<D>(FA_WG_PASS, blk, sp, it, steps, ln, dc, smc, wg, lane, st, dk, dv);
    }
    float dq[8][4];
    const int s = (steps - 1) & 1;
    wg_fence();
    fa_ws_issue_dq<D>(dq, dc.lSw, dc.lKw, s);
    wg_wait<0>();
    wg_pin(dq);
    fa_ws_dq_out<D>(FA_WG_PASS, blk, FaWsStep<D>(blk, steps - 1, dc.lQD, smc), dq, stg, s, wg,
                    warp, lane);
    fa_ws_reduce_drain(lane);
}

template <int D>
__device__ __forceinline__ void flash_bwd_ws(FA_WG_ARGS, unsigned char* smem) {
    using W = FaWs<D>;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const FaBwdBlock<D, 128> blk(qkv, dout, T, H, KVH, starts);
    const uint32_t raw = fa_smem_u32(smem);
    const uint32_t base = (raw + 1023u) & ~1023u;
    char* smc = reinterpret_cast<char*>(smem) + (base - raw);  // generic view of `base`
    const int steps = blk.template steps<W::QH>();

    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::REGS_COPY) : "memory");
        const int pt = tid - 256;
#pragma unroll
        for (int c = 0; c < 4; ++c)
            fa_load_tile<D, true, 1>(base + c * W::TD, c < 2 ? blk.kg : blk.vg, blk.ld,
                               blk.k0 + 64 * (c & 1), T, pt);
        fa_ws_load<D>(blk, 0, base + W::RING, base + W::STAT, lse, delta, H, T, pt);
        fa_cp_commit();
        for (int it = 0; it < steps; ++it) {
            const int s = it & 1;
            fa_cp_wait_all();
            fa_fence_async();
            fa_ws_arrive(FA_WS_FULL + s);
            if (it + 1 < steps) {  // the next tile into the other slot, once step it - 1 is done
                if (it >= 1) fa_ws_sync(FA_WS_EMPTY + (s ^ 1));
                fa_ws_load<D>(blk, it + 1, base + W::RING + (s ^ 1) * 4 * W::TILE,
                              base + W::STAT + (s ^ 1) * W::STAT_SLOT, lse, delta, H, T, pt);
                fa_cp_commit();
            }
        }
        __syncthreads();  // the consumers' epilogue reuses K and V
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(W::REGS_MMA) : "memory");
    float dk[D / 8][4], dv[D / 8][4];
    fa_zero(dk);
    fa_zero(dv);
    // (head dim 64: dQ a step later; at 128 that loop ran 461 -> 443 TFLOP/s, one H100)
    if constexpr (D == 64) {
        if (starts != nullptr || thr)
            fa_ws_mma_defer<D, true>(FA_WG_PASS, blk, steps, base, smc, wg, warp, lane, dk, dv);
        else
            fa_ws_mma_defer<D, false>(FA_WG_PASS, blk, steps, base, smc, wg, warp, lane, dk, dv);
    } else {
        if (starts != nullptr || thr)
            fa_ws_mma<D, true>(FA_WG_PASS, blk, steps, base, smc, wg, warp, lane, dk, dv);
        else
            fa_ws_mma_pipe<D>(FA_WG_PASS, blk, steps, base, smc, wg, warp, lane, dk, dv);
    }
    __syncthreads();  // every dQ product done reading K and V's tiles
    fa_bwd_store_kv(dk, dv, scale, smc + wg * W::TD, smc + (2 + wg) * W::TD, warp, lane,
                    blk.k0 + 64 * wg + warp * 16, T,
                    dqkv + (size_t)blk.b * T * blk.ld + blk.HD + blk.kvh * D, blk.ld, blk.KD);
}

extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_ws_bf16(FA_WG_ARGS) {
    extern __shared__ __align__(1024) unsigned char fa_wg_smem[];
    flash_bwd_ws<64>(FA_WG_PASS, fa_wg_smem);
}
extern "C" __global__ void __launch_bounds__(384, 1) flash_bwd_ws_d128_bf16(FA_WG_ARGS) {
    extern __shared__ __align__(1024) unsigned char fa_wg_smem[];
    flash_bwd_ws<128>(FA_WG_PASS, fa_wg_smem);
}

// Backward 3 after flash_bwd_ws: dQ = scale * dq_acc's slabs (fa_slab_at) -> bf16 into the q
// slot of dqkv. A block of 256 threads a slab: each reads one float4 of it (coalesced), shared
// memory turns the fragments into rows, and each thread writes four columns of a row (sixteen
// threads a row's 128 bytes). Grid: B * H * ceil(T / 16) * (D / 64) blocks.
template <int D>
__device__ __forceinline__ void flash_bwd_dq_convert_ws(const float* __restrict__ dq_acc,
                                                        __nv_bfloat16* __restrict__ dqkv, int T,
                                                        int H, int KVH, float scale) {
    __shared__ __align__(16) float rows[16][64 + 4];
    const int slab = blockIdx.x, tid = threadIdx.x;
    const int P = D / 64, T16 = (T + 15) >> 4;
    const int p = slab % P, t16 = (slab / P) % T16, bh = slab / P / T16;
    const float4 v = reinterpret_cast<const float4*>(dq_acc + (size_t)slab * FA_SLAB)[tid];
    const int lane = tid & 31, g = lane >> 2, c = (tid >> 5) * 8 + (lane & 3) * 2;
    rows[g][c] = v.x;
    rows[g][c + 1] = v.y;
    rows[g + 8][c] = v.z;
    rows[g + 8][c + 1] = v.w;
    __syncthreads();
    const int r = tid >> 4, c4 = (tid & 15) * 4, t = t16 * 16 + r;
    if (t >= T) return;
    const int b = bh / H, h = bh - b * H;
    const float4 x = *reinterpret_cast<const float4*>(&rows[r][c4]);
    uint2 out;
    out.x = fa_pack(x.x * scale, x.y * scale);
    out.y = fa_pack(x.z * scale, x.w * scale);
    *reinterpret_cast<uint2*>(dqkv + ((size_t)b * T + t) * (H + 2 * KVH) * D + h * D + p * 64 + c4) =
        out;
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_convert_ws_bf16(FA_DQ_ARGS) {
    flash_bwd_dq_convert_ws<64>(dq_acc, dqkv, T, H, KVH, scale);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_convert_ws_d128_bf16(FA_DQ_ARGS) {
    flash_bwd_dq_convert_ws<128>(dq_acc, dqkv, T, H, KVH, scale);
}

// ---------------------------------------------------------------------------------------------
// The forward's products on wgmma (FaFwdWg): at head dim 64 flash.cu's flash_fwd (mask, online
// softmax, dropout, epilogue) with its two products per key tile as warpgroup instructions, at
// 128 the same in flash_fwd_ws below —
//   S  = Q K^T   (A = Q, B = K, both K-major from shared memory; 4 x m64n64k16)
//   O += P V     (A = P from registers, packed as mma.sync's A fragments; B = V read
//                 transposed: MN-major, 2048 bytes a k-step)
// The block (one warpgroup, 64 query rows) reads K and V once from shared memory where the
// mma.sync kernel's four warps each load them into registers through ldmatrix. The scores are
// waited for at once (the softmax needs them); P V stays in flight until the next tile's top,
// where it is waited for before the prefetch refills its buffers. Head dim 128: the tiles are two
// 64-column panels each (fa_tile_off with PANELS), S takes eight k-steps over both, and P V is
// two products, one per panel of V into the matching half of O. Registers at head dim 64: 112
// (128 with dropout), four blocks an SM. Measured on H100 (B=8, T=1024, PTX JIT), a layer: 0.043
// ms at H=12, KVH=4, head dim 64 (the mma.sync kernel: 0.056).
struct FaFwdWg {
    static constexpr bool PANELS = true;  // 64-column panels in the 128-byte swizzle
    // S = Q K^T issued (one group)
    template <int D>
    static __device__ __forceinline__ void issue_scores(float (&s)[8][4], uint32_t sQa,
                                                        uint32_t kb) {
        wg_fence();
        fa_wg_ss_panels<D>(s, wg_desc_lo(sQa), wg_desc_lo(kb));
        wg_commit();
    }
    // O += P V issued, P already packed (one group; settle waits for it)
    template <int D>
    static __device__ __forceinline__ void issue_values(float (&oacc)[D / 8][4],
                                                        const uint32_t (&pa)[4][4], uint32_t vb) {
        fa_wg_rs_panels<D>(oacc, pa, wg_desc_lo(vb));
        wg_commit();
    }
    template <int D>
    struct State {};
    // S = Q K^T: D / 16 k-steps, four in each 64-column panel of Q and K
    template <int D>
    static __device__ __forceinline__ void scores(State<D>&, float (&s)[8][4], uint32_t sQa,
                                                  uint32_t kb, int, int, int) {
        static_assert(D == 64 || D == 128, "the wgmma forward is written for head dims 64 and 128");
        issue_scores<D>(s, sQa, kb);
        wg_wait<0>();
        wg_pin(s);
    }
    // O += P V: for each 64-column panel of V, the matching 64 columns of O
    template <int D>
    static __device__ __forceinline__ void values(float (&oacc)[D / 8][4], const float (&s)[8][4],
                                                  uint32_t vb, int) {
        uint32_t pa[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) fa_frag(s, kc, pa[kc]);
        wg_fence();
        issue_values<D>(oacc, pa, vb);
    }
    template <int N>
    static __device__ __forceinline__ void settle(float (&oacc)[N][4]) {
        wg_wait<0>();
        wg_pin(oacc);
    }
    // cp.async's writes, visible to the tensor cores' asynchronous proxy (before the barrier)
    static __device__ __forceinline__ void publish() { fa_fence_async(); }
};

// flash_fwd_bf16's contract (static shared memory: 40 KB and 1 KB to start the tiles on a
// 1024-byte boundary, as the 128-byte swizzle needs).
#define FA_WG_FWD(name, drop)                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 4) name(FA_FWD_ARGS) {             \
        __shared__ __align__(1024) unsigned char fa_wg_fwd_smem[5 * 64 * 64 * 2 + 1024];      \
        const uint32_t raw = fa_smem_u32(fa_wg_fwd_smem);                                      \
        __nv_bfloat16* sm = reinterpret_cast<__nv_bfloat16*>(fa_wg_fwd_smem +                  \
                                                             (((raw + 1023u) & ~1023u) - raw)); \
        flash_fwd<64, drop, FaFwdWg>(FA_FWD_PASS, sm);                                         \
    }
FA_WG_FWD(flash_fwd_wg_bf16, false)
FA_WG_FWD(flash_fwd_drop_wg_bf16, true)

// ---------------------------------------------------------------------------------------------
// The warp-specialized forward (head dim 128): 128 queries a block, two MMA warpgroups of 64
// (each its own flash_fwd loop: S = Q K^T, the softmax, O += P V on wgmma) and one copy
// warpgroup that streams the K and V tiles of 64 keys into a ring of FA_FWS_NS stages. The MMA
// warpgroups share each tile (each tile read from L2 once for 128 queries, not 64) and never wait
// on each other: a stage is handed over by mbarriers, FULL[s] (copy warpgroup -> MMA warps: its
// tiles landed; 128 arrivals, one a copy thread after its cp.async group completed and its proxy
// fence) and EMPTY[s] (MMA warps -> copy warpgroup: the products that read it are done; one
// arrival a warp), so one warpgroup's exponentials run under the other's products and the copies
// run ahead. The copy warpgroup publishes a tile once the next tile's copies are issued (two
// tiles' copies in flight). Warpgroup w's last tile is its diagonal one (2 qb + w): the first
// stops a tile early. Without dropout each MMA warpgroup also overlaps its own phases
// (FlashAttention-3's intra-warpgroup pipelining): a tile's S = Q K^T is issued beside the last
// tile's O += P V, and the softmax of the new S runs while that P V finishes; the first tile's S
// is peeled out of the loop, since a wgmma on a divergent path makes ptxas serialize every
// product in the kernel (remark C7520). The dropout kernel keeps one tile's S, then its P V. The
// copy warpgroup gives its registers to the MMA ones (setmaxnreg: 24 + 2 x 240 of the block's
// 3 x 168; the dropout kernel spilled 16 bytes without it). Shared memory: the two warpgroups'
// Q, the ring (K then V a stage), its barriers, 1 KB to align (FA_FWS_D128_SMEM).
// Launch: grid (B*H, ceil(T/128)), block 384, one block an SM.
// Measured (T = 16384, 6 heads of 128): one H200, one call, 468 / 470 -> 486 / 484 TFLOP/s
// against flash_fwd's pipelined wgmma loop it replaced at this head dim; one H100, a later call,
// 487 / 487 -> 496 / 496 with the intra-warpgroup overlap. At head dim 64 the same kernel
// (three MMA warpgroups, 192 queries, 512 threads) ran 381-390 TFLOP/s, 366-368 with the
// overlap, against flash_fwd_wg's 437-445 (four 64-query blocks an SM already overlap each
// other's phases there).

__device__ __forceinline__ void fa_mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fa_mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// until the phase of parity `parity` of the barrier at `bar` has completed
__device__ __forceinline__ void fa_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

template <bool DROP>
__device__ __forceinline__ void flash_fwd_ws(const __nv_bfloat16* __restrict__ qkv,
                                             __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                                             int B, int T, int H, int KVH, float scale,
                                             const unsigned long long* __restrict__ seed,
                                             uint32_t site, uint32_t thr, float dscale,
                                             uint16_t* __restrict__ mbits,
                                             const int* __restrict__ starts, char* smc) {
    constexpr int D = 128;                 // head dim
    constexpr int NC = 2;                  // MMA warpgroups
    constexpr uint32_t TILE = 64 * D * 2;  // 64 rows (D / 64 panels)
    const int tid = threadIdx.x;
    const uint32_t base = fa_smem_u32(smc);
    const uint32_t ring = base + NC * TILE;  // stage s: K at ring + 2s TILE, V a TILE on
    const uint32_t full = ring + 2 * FA_FWS_NS * TILE, empty = full + 8 * FA_FWS_NS;
    const FaFwdBlock blk(qkv, T, H, KVH, D);
    const int qb = blk.qb, bh = blk.bh, b = blk.b, h = blk.h, HD = blk.HD, KD = blk.KD, ld = blk.ld;
    const __nv_bfloat16* qg = blk.qg;
    const int koff = blk.koff;
    const int q0 = qb * 64 * NC;
    const int nkt = (T + FA_BN - 1) / FA_BN;
    // Packed rows or a sliding window: the key tiles below the block's first query's lowest key
    // are skipped.
    const int j0 = starts != nullptr ? __ldg(starts + (size_t)b * T + q0) / FA_BN : 0;
    const int nkv = min(NC * qb + NC, nkt);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < FA_FWS_NS; ++s) {
            fa_mbar_init(full + 8 * s, 128);
            fa_mbar_init(empty + 8 * s, 4 * NC);
        }
    }
    __syncthreads();

    // (the block's launch registers 168 x 384 = 24 x 128 + 240 x 256)
    constexpr int RC = 24, RM = 240;
    if (tid >= 128 * NC) {  // the copy warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RC) : "memory");
        const int lane = tid & 127;
        for (int j = j0, n = 0; j < nkv; ++j, ++n) {
            const int s = n % FA_FWS_NS;
            if (n >= FA_FWS_NS) fa_mbar_wait(empty + 8 * s, (n / FA_FWS_NS - 1) & 1);
            const uint32_t kb = ring + 2 * s * TILE;
            fa_load_tile<D, true, 1>(kb, qg + koff, ld, j * FA_BN, T, lane);
            fa_load_tile<D, true, 1>(kb + TILE, qg + koff + KD, ld, j * FA_BN, T, lane);
            fa_cp_commit();
            if (n > 0) {  // the tile before landed: publish it
                asm volatile("cp.async.wait_group 1;\n" ::: "memory");
                fa_fence_async();
                fa_mbar_arrive(full + 8 * ((n - 1) % FA_FWS_NS));
            }
        }
        fa_cp_wait_all();
        fa_fence_async();
        fa_mbar_arrive(full + 8 * ((nkv - 1 - j0) % FA_FWS_NS));
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RM) : "memory");
    const int wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int qw = q0 + wg * FA_BM;  // this warpgroup's first query
    const uint32_t sQa = base + wg * TILE;
    fa_load_tile<D, true>(sQa, qg, ld, qw, T, wtid);
    fa_cp_commit();
    fa_cp_wait_all();
    fa_fence_async();
    fa_ws_sync<128>(1 + wg);

    const int jd = NC * qb + wg, jl = min(jd, nkt - 1);  // the diagonal tile; the last
    const int row0 = qw + warp * 16 + g, row1 = row0 + 8;
    const int st0 = starts != nullptr && row0 < T ? __ldg(starts + (size_t)b * T + row0) : 0;
    const int st1 = starts != nullptr && row1 < T ? __ldg(starts + (size_t)b * T + row1) : st0;
    const unsigned long long sd = DROP ? *seed : 0ull;
    FaFwdRows fr{row0, row1, T, t4, bh, st0, st1, scale, scale * 1.4426950408889634f, 0.f,
                 site, sd, thr, dscale, mbits, nkt};
    float oacc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) oacc[i][e] = 0.f;
    if constexpr (DROP) {  // each tile's S, then its P V
        FaFwdWg::State<D> mm;
        for (int j = j0, n = 0; j <= jl; ++j, ++n) {
            const int s = n % FA_FWS_NS;
            if (n > 0) {  // the last tile's P V done: its stage is free
                FaFwdWg::settle(oacc);
                __syncwarp();
                if (lane == 0) fa_mbar_arrive(empty + 8 * ((n - 1) % FA_FWS_NS));
            }
            fa_mbar_wait(full + 8 * s, (n / FA_FWS_NS) & 1);
            const uint32_t kb = ring + 2 * s * TILE;
            float sc[8][4];
            FaFwdWg::scores<D>(mm, sc, sQa, kb, n, warp, lane);
            float al0, al1;
            const bool rescale = fr.template probs<true, false>(
                sc, j, j == jd || j * FA_BN + FA_BN > T || j * FA_BN < st1, al0, al1);
            if (rescale) fa_rescale(oacc, al0, al1);
            FaFwdWg::values<D>(oacc, sc, kb + TILE, lane);
        }
    } else {  // a tile's S issued beside the last tile's P V, the first tile's S alone
        // The two warpgroups take turns to issue their products (FlashAttention-3's ping-pong):
        // named barrier 3 + w is "warpgroup w's turn"; a warpgroup's exponentials then run while
        // the other's products hold the tensor cores. Both take E turns (a tile's S beside the
        // last one's P V, one for the first S, one for the last P V) — the one with fewer tiles
        // takes idle ones at the end; warpgroup 1 starts by handing warpgroup 0 the first turn
        // and hands none after its last. (One H100, T16384, six heads: 770 -> 750 us a launch
        // alone under Nsight Compute, 483 -> 496-510 TFLOP/s inside the step.)
        const int E = min(NC * qb + 1, nkt - 1) - j0 + 2;
        int ev = 0;
        auto turn = [&]() { fa_ws_sync<256>(3 + wg); };
        auto pass = [&]() {
            ++ev;
            if (!(wg == 1 && ev == E)) fa_ws_arrive<256>(3 + (wg ^ 1));
        };
        if (wg == 1) fa_ws_arrive<256>(3);
        uint32_t pf[4][4];  // the last tile's P, as the A fragments of its P V
        {
            fa_mbar_wait(full, 0);
            float sc[8][4];
            turn();
            FaFwdWg::issue_scores<D>(sc, sQa, ring);
            pass();
            wg_wait<0>();
            wg_pin(sc);
            float al0, al1;
            fr.template probs<false, false>(
                sc, j0, j0 == jd || j0 * FA_BN + FA_BN > T || j0 * FA_BN < st1, al0, al1);
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) fa_frag(sc, kc, pf[kc]);
        }
        int n = 1;
        for (int j = j0 + 1; j <= jl; ++j, ++n) {
            const int s = n % FA_FWS_NS;
            fa_mbar_wait(full + 8 * s, (n / FA_FWS_NS) & 1);
            float sc[8][4];
            turn();
            FaFwdWg::issue_scores<D>(sc, sQa, ring + 2 * s * TILE);
            FaFwdWg::issue_values<D>(oacc, pf, ring + 2 * ((n - 1) % FA_FWS_NS) * TILE + TILE);
            pass();
            wg_wait<1>();  // S landed; the P V may still run
            wg_pin(sc);
            float al0, al1;
            const bool rescale = fr.template probs<false, false>(
                sc, j, j == jd || j * FA_BN + FA_BN > T || j * FA_BN < st1, al0, al1);
            FaFwdWg::settle(oacc);  // the last tile's P V done: its stage is free
            __syncwarp();
            if (lane == 0) fa_mbar_arrive(empty + 8 * ((n - 1) % FA_FWS_NS));
            if (rescale) fa_rescale(oacc, al0, al1);
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) fa_frag(sc, kc, pf[kc]);
        }
        wg_fence();
        turn();
        FaFwdWg::issue_values<D>(oacc, pf, ring + 2 * ((n - 1) % FA_FWS_NS) * TILE + TILE);
        pass();
        while (ev < E) {  // the idle turns of the warpgroup with fewer tiles
            turn();
            pass();
        }
    }
    FaFwdWg::settle(oacc);
    // (this warp's own rows of its warpgroup's Q tile stage O)
    fr.template store<D, true>(oacc, lse, o, b, h, HD, qw, smc + wg * TILE, warp, lane);
}

#define FA_FWS(name, drop)                                                                    \
    extern "C" __global__ void __launch_bounds__(384, 1) name(FA_FWD_ARGS) {                   \
        extern __shared__ __align__(1024) unsigned char fa_fws_smem[];                        \
        const uint32_t raw = fa_smem_u32(fa_fws_smem);                                         \
        char* sm = reinterpret_cast<char*>(fa_fws_smem + (((raw + 1023u) & ~1023u) - raw));    \
        flash_fwd_ws<drop>(qkv, o, lse, B, T, H, KVH, scale, seed, site, thr, dscale, mbits,    \
                           starts, sm);                                                        \
    }
static_assert(FA_FWS_D128_SMEM == (2 + 2 * FA_FWS_NS) * 64 * 128 * 2 + 2048,
              "flash_smem.h's FA_FWS_D128_SMEM lays out Q, the ring and its barriers");
FA_FWS(flash_fwd_ws_d128_bf16, false)
FA_FWS(flash_fwd_drop_ws_d128_bf16, true)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
