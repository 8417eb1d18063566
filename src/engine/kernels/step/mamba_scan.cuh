// The Mamba-2 mixer's scan within a chunk (state-space duality): each chunk's C·Bᵀ per group, a
// chunk's outputs from its own positions and its start state (tensor-core tiles, mb_mm), and
// their backward. Part of mamba.cuh's family, launched by mamba.rs; included by ../kernels.cu
// after mamba.cuh.
#pragma once

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

// Whether chunk position i's output takes source j's input: j ≤ i, in i's sample (from: the
// chunk's mb_from over its positions).
__device__ __forceinline__ bool mb_sees(const int* from, int i, int j) {
    return j <= i && j >= from[i];
}

// The chunk's mb_from over its positions into from[MB_L] (shared memory; the caller syncs).
__device__ __forceinline__ void mb_load_from(int* from, const int* __restrict__ starts, int b,
                                             int t, int t0) {
    for (int i = threadIdx.x; i < MB_L; i += blockDim.x) from[i] = mb_from(starts, b, t, t0, i);
}

// M[i][j] = (C_i·B_j)·exp(lam_i − lam_j)·dtv_j where i sees j (mb_sees), else 0 (g: C·Bᵀ at
// this thread's accumulator places, lm and dv: the head's lam and dtv over the chunk) into
// the tile ms.
__device__ __forceinline__ void mb_put_decayed(mb_t* ms, const float g[4][4], const float* lm,
                                               const float* dv, const int* from) {
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int i = mb_row(a, c), j = mb_col(a, c);
            mb_put(ms, i, j, mb_sees(from, i, j) ? g[a][c] * __expf(lm[i] - lm[j]) * dv[j] : 0.f);
        }
}

// A chunk's outputs: y_i[p] = Σ_{j ≤ i} (C_i·B_j)·exp(lam_i − lam_j)·dtv_j·x_j[p]
// + exp(lam_i)·Σ_s C_i[s]·S[p][s] + D·x_i[p] (packed rows: only j of i's sample, and S only
// where i's sample started before the chunk), into y [N, inner] (the gated norm's input), for
// the hb heads of a group of the block in turn (grid (chunks, heads / hb, batch)): what they
// share, the chunk's C·Bᵀ and its C tiles (all of the state's columns), is read once a block.
// Each (head, 64 head columns) step copies its x tile and its rows of S by cp.async, building
// the head's M = C·Bᵀ·exp(lam_i − lam_j)·dtv_j (j ≤ i) while they land.
extern "C" __global__ void __launch_bounds__(256, 3)
    mamba_chunk_scan_bf16(const bf16_t* __restrict__ xc, const float* __restrict__ cb,
                          const float* __restrict__ dtv, const float* __restrict__ lam,
                          const mb_t* __restrict__ states, const bf16_t* __restrict__ dskip,
                          bf16_t* __restrict__ y, const int* __restrict__ starts, int t,
                          int heads, int p, int s, int groups, int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    __shared__ int from[MB_L];
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
    mb_load_from(from, starts, k0.b, t, k0.t0);
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
        if (p0 == 0) mb_put_decayed(ms, g, lm, dv, from);
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
                const float carried = from[i] < 0 ? __expf(lm[i]) * off[a][c] : 0.f;
                acc[a][c] += carried + dsk * mb_get(xt, i, mb_col(a, c));
            }
        mb_store_tile16(y + k.row0 * inner + k.h * p + p0, inner, acc, rows, pc);
    }
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
                              float* __restrict__ dd, const int* __restrict__ starts, int t,
                              int heads, int p, int s, int groups, int hb) {
    extern __shared__ __align__(16) unsigned char mb_raw[];
    __shared__ int from[MB_L];  // packed rows' mb_from over the chunk
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
        // (exp(lam_i) carries the start state into i, w_i position i into the end state:
        // each only within its sample)
        const int fi = mb_from(starts, k0.b, t, k0.t0, i);
        const int fl = mb_from(starts, k0.b, t, k0.t0, MB_L - 1);
        v[2 * MB_L + i] = fi < 0 ? __expf(v[i]) : 0.f;
        v[3 * MB_L + i] = v[4 * MB_L + i] = v[5 * MB_L + i] = v[7 * MB_L + i] = 0.f;
        v[6 * MB_L + i] = i >= fl ? __expf(lam[pos + MB_L - 1] - v[i]) * v[MB_L + i] : 0.f;
    }
    mb_load_from(from, starts, k0.b, t, k0.t0);
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
            mb_put_decayed(ms, g, lm, dv, from);
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
        // The head's last step. Per (i, j) where i sees j (mb_sees): W = exp(lam_i − lam_j);
        // dG = dM·W·dtv_j (into dGΣ); ddt_j += dM·G·W; q = dM·G·W·dtv_j: dlam_i += q,
        // dlam_j −= q.
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
                if (mb_sees(from, i, j)) {
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
            if (i >= from[MB_L - 1]) dd += dw * __expf(v[MB_L - 1] - v[i]);
            dl -= dw * v[6 * MB_L + i];
            if (i == MB_L - 1) dl += red[hh] + dlam[pos + i];
        }
        ddt[pos + i] = dd;
        dlam[pos + i] = dl;
    }
}
