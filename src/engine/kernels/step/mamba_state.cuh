// The Mamba-2 mixer's state passing between chunks: the walk that computes each chunk's start
// state (fp32 from chunk to chunk, stored in the 16-bit type) and its backward, the backward of a
// chunk's own contribution to its end state, and dB's share of that. Part of mamba.cuh's family,
// launched by mamba.rs; included by ../kernels.cu after mamba.cuh and mamba_scan.cuh.
#pragma once

// The chunks' start states in one walk over the chunks: S_0 = 0, S_{c+1} = exp(lam_last(c))·S_c
// + Σ_i exp(lam_last(c) − lam_i)·dtv_i·x_i[p]·B_i[s] (chunk c's own contribution), stored in
// the 16-bit type ([B, H, chunks, P, S]); packed rows keep of chunk c's inputs those of its last
// position's sample, and of S_c nothing where that sample starts in the chunk (mb_from). A
// block per (64 head columns, NS·64 state columns, batch row · head) carries its NS tiles of
// the state in f32 accumulators from chunk to chunk, so the state never goes through global
// memory in f32; its x tile is shared by the NS products (NS = 2: a state of 128 in one
// block, x read once a chunk instead of twice). Its x and B tiles and dt values come by
// cp.async into a ring of MB_WS stages, two chunks ahead of their product; x's rows are scaled
// in shared memory once they land. Shapes whose tiles are not whole 16-byte rows walk each of
// the block's state tiles in turn, loading each chunk's tiles when it comes (mb_load).
#define MB_WS 3
template <int NS>
__device__ __forceinline__ void mb_state_walk(const bf16_t* __restrict__ xc,
                                              const float* __restrict__ dtv,
                                              const float* __restrict__ lam,
                                              mb_t* __restrict__ states,
                                              const int* __restrict__ starts, int t, int heads,
                                              int p, int s, int groups, int chunks,
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
                const int fl = mb_from(starts, b, t, c * MB_L, MB_L - 1);
                __syncthreads();  // the last product is done with the tiles and w
                for (int i = threadIdx.x; i < MB_L; i += blockDim.x)
                    w[i] = i >= fl ? __expf(last - lm[c * MB_L + i]) * dv[c * MB_L + i] : 0.f;
                __syncthreads();
                mb_load(xs, xc, conv, r0, r1, xcol, pc, w);
                mb_load(bs, xc, conv, r0, r1, bcol + 64 * si, sc, nullptr);
                __syncthreads();
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int q = 0; q < 4; ++q) acc[0][a][q] *= fl < 0 ? __expf(last) : 0.f;
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
        const int fl = mb_from(starts, b, t, c * MB_L, MB_L - 1);
        // x's rows times exp(lam_last − lam_i)·dtv_i
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int e = threadIdx.x + 256 * e2, i = e >> 3, j = (e & 7) * 8;
            uint4* cell = reinterpret_cast<uint4*>(xs + i * MB_LDH + j);
            mb_store16<mb_t>(xs, i, j, *cell, i >= fl ? __expf(last - lv[i]) * lv[MB_L + i] : 0.f,
                             true);
        }
        __syncthreads();
        const float decay = fl < 0 ? __expf(last) : 0.f;
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
             const float* __restrict__ lam, mb_t* __restrict__ states,                          \
             const int* __restrict__ starts, int t, int heads, int p, int s, int groups,       \
             int chunks) {                                                                     \
        extern __shared__ __align__(16) unsigned char mb_raw[];                                \
        mb_state_walk<NS>(xc, dtv, lam, states, starts, t, heads, p, s, groups, chunks,        \
                          mb_raw);                                                             \
    }
MB_WALK(mamba_state_walk_bf16, 1)
MB_WALK(mamba_state_walk2_bf16, 2)

// The state passing's backward in one walk over the chunks from the last. With dS_{c+1} the
// gradient of the state at chunk c's end (0 past the last chunk) and L_c = lam_last(c):
// down[c] = dS_{c+1} (the gradient of chunk c's own contribution, in the 16-bit type its only
// reader's tiles round to: mamba_chunk_state_bwd), dlam at chunk c's last position +=
// exp(L_c)·Σ dS_{c+1}·S_c (the decay's share; S_c the chunk's start state), and
// dS_c = exp(L_c)·dS_{c+1} + Σ_i exp(lam_i)·dy_i[p]·C_i[s] (the chunk's outputs' share; packed
// rows drop the terms the forward dropped, mb_from: exp(L_c) where chunk c's last position's
// sample starts in it, exp(lam_i) where position i's does). A
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
                                                  mb_t* __restrict__ down,
                                                  const int* __restrict__ starts, int t,
                                                  int heads, int p, int s, int groups,
                                                  int chunks, unsigned char* mb_raw) {
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
        const float d = mb_from(starts, b, t, c * MB_L, MB_L - 1) < 0 ? __expf(last) : 0.f;
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
                for (int i = threadIdx.x; i < MB_L; i += blockDim.x) {
                    const bool in = mb_from(starts, b, t, c * MB_L, i) < 0;
                    el[i] = in ? __expf(lm[c * MB_L + i]) : 0.f;
                }
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
        for (int e = 0; e < 2; ++e) {
            const int i = (threadIdx.x + 256 * e) >> 3;
            erow[e] = mb_from(starts, b, t, c * MB_L, i) < 0 ? __expf(lm[c * MB_L + i]) : 0.f;
        }
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
             float* __restrict__ dlam, mb_t* __restrict__ down, const int* __restrict__ starts, \
             int t, int heads, int p, int s, int groups, int chunks) {                         \
        extern __shared__ __align__(16) unsigned char mb_raw[];                                \
        mb_state_walk_bwd<NS>(xc, dy, lam, states, dlam, down, starts, t, heads, p, s, groups, \
                              chunks, mb_raw);                                                 \
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
                               float* __restrict__ dlam, const int* __restrict__ starts, int t,
                               int heads, int p, int s, int groups, int hb) {
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
    // (packed rows: only the last position's sample goes into the end state)
    const int fl = mb_from(starts, k0.b, t, k0.t0, MB_L - 1);
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        vec[hh * 2 * MB_L + i] =
            i >= fl ? __expf(lam[pos + MB_L - 1] - lam[pos + i]) * dtv[pos + i] : 0.f;
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
            if (j >= fl) ddt[pos + j] += dw[j] * __expf(last - lam[pos + j]);
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
                              float* __restrict__ dxc, const int* __restrict__ starts, int t,
                              int heads, int p, int s, int groups, int hb) {
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
    const int fl = mb_from(starts, k0.b, t, k0.t0, MB_L - 1);  // (as mamba_chunk_state_bwd)
    for (int e = threadIdx.x; e < hb * MB_L; e += blockDim.x) {
        const int hh = e / MB_L, i = e % MB_L;
        const size_t pos = mb_chunk_of(t, heads, groups, p, s, h0 + hh).pos;
        wv[e] = i >= fl ? __expf(lam[pos + MB_L - 1] - lam[pos + i]) * dtv[pos + i] : 0.f;
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
