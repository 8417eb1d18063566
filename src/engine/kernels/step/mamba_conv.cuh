// The Mamba-2 mixer's depthwise causal conv1d + SiLU over in_proj's x | B | C columns: the
// forward a channel a thread (at KW 4 also through shared memory) and the backward in one pass,
// with the weight's and bias's gradients. Part of mamba.cuh's family (its tile and vector
// helpers), launched by mamba.rs; included by ../kernels.cu after mamba.cuh.
#pragma once

// The conv: xc[r, ch] = silu(cb[ch] + Σ_j w[ch, j]·zx[r − (K−1) + j, off + ch]) over the inputs
// of the same sequence — of packed rows, the same sample (`starts`, mamba.cuh's mb_from; PK:
// the builds that read them) — earlier ones are zeros. A thread per channel walks MB_CONV_ROWS
// rows with the last KW inputs in registers (each input loaded once); the weights are padded at
// the front to KW taps (K ≤ KW), so tap j reads the input KW − 1 − j rows back. Two builds of each
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
// r0's sequence or sample (tt = r0's position in it) and feeds a tap, else 0; win[KW − 1] is
// filled by the walk. `x` points at row r0's input of the channel, rows `ldx` apart.
template <int KW>
__device__ __forceinline__ void mb_conv_prefill(float win[KW], const bf16_t* x, int ldx, int tt,
                                                int k) {
#pragma unroll
    for (int j = 0; j < KW; ++j) {
        const int back = KW - j;  // win[j] moves to win[j - 1] when row r0 comes in
        win[j] = j >= KW + 1 - k && j < KW && tt - back >= 0 ? to_f(x[-back * ldx]) : 0.f;
    }
}
// Shift row r's input into the window (zeroing what lies before its sequence or sample) and
// return the conv's output before the SiLU.
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
// Row r's position within its sample (packed rows, PK) or its sequence (tt: its position in
// the sequence).
template <bool PK>
__device__ __forceinline__ int mb_conv_pos(const int* __restrict__ starts, int r, int tt) {
    return PK ? tt - starts[r] : tt;
}
// The forward's walk of one channel over rows r0 .. r_end − 1: its inputs at `x` (row r0's,
// rows ldx apart, the KW − 1 before it readable where they are in r0's sequence), its outputs
// from row r0 at `dst` (rows ld apart).
template <int KW, bool PK>
__device__ __forceinline__ void mb_conv_walk(const bf16_t* __restrict__ x, int ldx,
                                             const bf16_t* __restrict__ w,
                                             const bf16_t* __restrict__ cb,
                                             bf16_t* __restrict__ dst, int ld,
                                             const int* __restrict__ starts, int ch, int r0,
                                             int r_end, int t, int k) {
    const MbConvTaps<KW> taps = mb_conv_taps<KW>(w, cb, ch, k);
    float win[KW];
    mb_conv_prefill<KW>(win, x, ldx, mb_conv_pos<PK>(starts, r0, r0 % t), k);
    // Row pointers and the position within the sequence step with the walk (no 64-bit
    // multiply or integer division a row).
    int tt = r0 % t;
#pragma unroll 8
    for (int r = r0; r < r_end; ++r, x += ldx, dst += ld) {
        const bool first = mb_conv_pos<PK>(starts, r, tt) == 0;
        *dst = from_f<bf16_t>(silu_f(mb_conv_push<KW>(win, taps, to_f(*x), first)));
        tt = tt + 1 == t ? 0 : tt + 1;
    }
}
template <int KW>
__device__ __forceinline__ void mb_conv_fwd(const bf16_t* __restrict__ zx, int ld, int off,
                                            const bf16_t* __restrict__ w,
                                            const bf16_t* __restrict__ cb, bf16_t* __restrict__ xc,
                                            const int* __restrict__ starts, int n, int t,
                                            int conv, int k) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv) return;
    const int r0 = blockIdx.y * MB_CONV_ROWS, r_end = min(n, r0 + MB_CONV_ROWS);
    const bf16_t* x = zx + (size_t)r0 * ld + off + ch;
    bf16_t* dst = xc + (size_t)r0 * conv + ch;
    if (starts)
        mb_conv_walk<KW, true>(x, ld, w, cb, dst, conv, starts, ch, r0, r_end, t, k);
    else
        mb_conv_walk<KW, false>(x, ld, w, cb, dst, conv, starts, ch, r0, r_end, t, k);
}
extern "C" __global__ void __launch_bounds__(128)
    mamba_conv_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                        const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                        bf16_t* __restrict__ xc, const int* __restrict__ starts, int n, int t,
                        int conv, int k) {
    mb_conv_fwd<8>(zx, ld, off, w, cb, xc, starts, n, t, conv, k);
}
extern "C" __global__ void __launch_bounds__(128)
    mamba_conv4_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                         const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                         bf16_t* __restrict__ xc, const int* __restrict__ starts, int n, int t,
                         int conv, int k) {
    mb_conv_fwd<4>(zx, ld, off, w, cb, xc, starts, n, t, conv, k);
}

// The conv's backward in one pass, from dxc (d of the SiLU's output, f32 [N, conv]): d of its
// inputs into dzx's x | B | C columns (bf16), the weight's and bias's gradients (+=, where not
// null). A thread per V channels walks ROWS rows plus KW − 1 ahead: at row q it recomputes the
// conv's output (the input window as in the forward), takes dpre_q = dxc_q·silu'(pre_q) into a
// window of the last KW, adds dpre_q's weight and bias terms (q in the block's rows; GRADS), and
// finishes d of input q − KW + 1, which feeds outputs q − KW + 1 … q of its sequence (of packed
// rows, PK, those of its sample: the window keeps each output's sample start); U rows'
// loads are issued before the first of them is used. Sums added once. The walk reads its rows
// through `x` (row r0's input of channel ch, rows ldx apart, the KW − 1 before it readable
// where they are in r0's sequence) and `dx_in` (row r0's dxc, rows ldd apart), and writes d of
// the inputs from row r0 at `dst` (rows ld apart): global memory (mb_conv_bwd) or the rows a
// block copied into shared memory (mamba_conv4s_bwd).
template <int KW, int V, int U, bool GRADS, bool PK>
__device__ __forceinline__ void mb_conv_bwd_walk(const bf16_t* __restrict__ x, int ldx,
                                                 const float* __restrict__ dx_in, int ldd,
                                                 bf16_t* __restrict__ dst, int ld,
                                                 const bf16_t* __restrict__ w,
                                                 const bf16_t* __restrict__ cb,
                                                 float* __restrict__ dw, float* __restrict__ db,
                                                 const int* __restrict__ starts, int ch, int r0,
                                                 int r_end, int n, int t, int k) {
    MbConvTaps<KW> taps[V];
    const int q_end = min(n, r_end + k - 1);  // rows whose dpre the block's inputs feed
    float win[V][KW], dwin[V][KW], dwk[V][KW], dbs[V];
    int sw[KW];  // PK: the sample start (within its row) of each output in dwin
#pragma unroll
    for (int j = 0; j < KW; ++j) sw[j] = 0;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        taps[v] = mb_conv_taps<KW>(w, cb, ch + v, k);
        mb_conv_prefill<KW>(win[v], x + v, ldx, mb_conv_pos<PK>(starts, r0, r0 % t), k);
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
        int sq[U];  // PK: row q's sample start
#pragma unroll
        for (int u = 0; u < U; ++u) {
            sq[u] = 0;
            if (q0 + u < q_end) {
                mb_ldv<V>(x + (size_t)u * ldx, xs[u]);
                mb_ldv<V>(dx_in + (size_t)u * ldd, ds[u]);
                if (PK) sq[u] = starts[q0 + u];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int q = q0 + u;
            if (q >= q_stop) break;
            const bool first = PK ? tq == sq[u] : tq == 0;
#pragma unroll
            for (int j = 0; j < KW - 1; ++j) sw[j] = sw[j + 1];
            sw[KW - 1] = sq[u];
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float d = 0.f;
                if (q < q_end)
                    d = ds[u][v] * dsilu_f(mb_conv_push<KW>(win[v], taps[v], xs[u][v], first));
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
                // tap j, within its sequence (and sample: the output's starts at or before r)
                const int left = t - 1 - tr;
                float dx[V];
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    dx[v] = 0.f;
#pragma unroll
                    for (int j = 0; j < KW; ++j)
                        if (KW - 1 - j <= left && (!PK || sw[KW - 1 - j] <= tr))
                            dx[v] += taps[v].w[j] * dwin[v][KW - 1 - j];
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
                                            float* __restrict__ db,
                                            const int* __restrict__ starts, int n, int t,
                                            int conv, int k) {
    const int ch = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (ch >= conv) return;
    const int r0 = blockIdx.y * ROWS, r_end = min(n, r0 + ROWS);
    const size_t at = (size_t)r0 * ld + off + ch;
    const float* d = dxc + (size_t)r0 * conv + ch;
    if (starts)
        mb_conv_bwd_walk<KW, V, U, true, true>(zx + at, ld, d, conv, dzx + at, ld, w, cb, dw, db,
                                               starts, ch, r0, r_end, n, t, k);
    else
        mb_conv_bwd_walk<KW, V, U, true, false>(zx + at, ld, d, conv, dzx + at, ld, w, cb, dw,
                                                db, starts, ch, r0, r_end, n, t, k);
}
#define MB_CONV_BWD(name, KW, V, THREADS, ROWS, U)                                               \
    extern "C" __global__ void __launch_bounds__(THREADS)                                       \
        name(const bf16_t* __restrict__ zx, int ld, int off, const bf16_t* __restrict__ w,     \
             const bf16_t* __restrict__ cb, const float* __restrict__ dxc,                     \
             bf16_t* __restrict__ dzx, float* __restrict__ dw, float* __restrict__ db,         \
             const int* __restrict__ starts, int n, int t, int conv, int k) {                  \
        mb_conv_bwd<KW, V, ROWS, U>(zx, ld, off, w, cb, dxc, dzx, dw, db, starts, n, t, conv,   \
                                    k);                                                        \
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
                          float* __restrict__ dw, float* __restrict__ db,
                          const int* __restrict__ starts, int n, int t, int conv, int k) {
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
    const bool grads = dw != nullptr || db != nullptr;
    if (starts && grads)
        mb_conv_bwd_walk<KW, 1, 4, true, true>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, starts, ch,
                                               w0, w_end, n, t, k);
    else if (starts)
        mb_conv_bwd_walk<KW, 1, 4, false, true>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, starts,
                                                ch, w0, w_end, n, t, k);
    else if (grads)
        mb_conv_bwd_walk<KW, 1, 4, true, false>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, starts,
                                                ch, w0, w_end, n, t, k);
    else
        mb_conv_bwd_walk<KW, 1, 4, false, false>(x, SCH, d, SCH, dst, ld, w, cb, dw, db, starts,
                                                 ch, w0, w_end, n, t, k);
}

// The conv's forward (KW 4) through shared memory, as mamba_conv4s_bwd: a block of
// MB_CONV_SCH channels × MB_CONV_SROWS rows copies its rows' inputs and the KW − 1 before them
// by cp.async in one go, then each thread walks its channel there (mb_conv_fwd's walk).
extern "C" __global__ void __launch_bounds__(MB_CONV_SCH)
    mamba_conv4s_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                          const bf16_t* __restrict__ w, const bf16_t* __restrict__ cb,
                          bf16_t* __restrict__ xc, const int* __restrict__ starts, int n, int t,
                          int conv, int k) {
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
    const bf16_t* x = xs + H * SCH + threadIdx.x;
    bf16_t* dst = xc + (size_t)r0 * conv + ch;
    if (starts)
        mb_conv_walk<KW, true>(x, SCH, w, cb, dst, conv, starts, ch, r0, r_end, t, k);
    else
        mb_conv_walk<KW, false>(x, SCH, w, cb, dst, conv, starts, ch, r0, r_end, t, k);
}
