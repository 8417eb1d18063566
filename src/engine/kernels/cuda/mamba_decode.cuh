// A hybrid's Mamba-2 layer for one new position per row (a generation step; launched by
// mamba_decode.rs for src/engine/model/mamba_decode.rs): the conv over the last inputs, the
// SiLU, dt's softplus and limits, the state's decay and input, its read-out by C and the D skip
// in one launch; the gated RMSNorm in a second. Instead of about forty candle launches a layer.
// Included by ../kernels.cu after step/mamba.cuh (silu_f, softplus_f).
//
// ============================== LAUNCH CONTRACT ==============================================
// Layouts (contiguous, row-major; T = f32, bf16 or f16; inner = H·P, conv = inner + 2·G·S,
// W = inner + conv + H):
//   proj   [B, W] T        in_proj's output: z (inner) | x, B, C (conv) | dt (H)
//   hist   [B, K-1, conv] T  the conv's last inputs before this position
//   conv_w [conv, K] T, conv_b [conv] T (null: none)
//   dt_bias, a_log, dskip [H] f32
//   state  [B, H, P, S] f32 before the position; state_out after it (another buffer)
//   hist_out [B, K-1, conv] T  the conv's last inputs after it
//   gated  [B, inner] f32  (y + D·x)·silu(z), the norm's input
//   out    [B, inner] T    the gated RMSNorm over each of G groups of inner / G columns
// Head h reads group h / (H / G) of B and C.
// 1. mamba_decode_step_<T>(proj, hist, conv_w, conv_b, dt_bias, a_log, dskip, state, state_out,
//        hist_out, gated, H, P, S, G, K, clamp, lo, hi)
//      grid = (B·H, ceil(P / MD_ROWS), 1), block = (MD_THREADS, 1, 1),
//      dynamic smem = (MD_ROWS + 2·S)·4 bytes. 2 ≤ K.
// 2. mamba_decode_norm_<T>(gated, norm_w, out, inner, G, eps)
//      grid = (B·G, 1, 1), block = (MD_THREADS, 1, 1), dynamic smem = 0.
// =============================================================================================

#define MD_THREADS 256
#define MD_ROWS 8  // head-width rows of the state a block takes: one a warp

template <typename T>
__device__ __forceinline__ void mamba_decode_step(
    const T* __restrict__ proj, const T* __restrict__ hist, const T* __restrict__ conv_w,
    const T* __restrict__ conv_b, const float* __restrict__ dt_bias,
    const float* __restrict__ a_log, const float* __restrict__ dskip,
    const float* __restrict__ state, float* __restrict__ state_out, T* __restrict__ hist_out,
    float* __restrict__ gated, int H, int P, int S, int G, int K, int clamp, float lo,
    float hi) {
    extern __shared__ float md_smem[];
    const int inner = H * P, conv = inner + 2 * G * S, W = inner + conv + H;
    const int b = blockIdx.x / H, h = blockIdx.x - b * H, g = h / (H / G);
    const int p0 = blockIdx.y * MD_ROWS, rows = min(MD_ROWS, P - p0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* xs = md_smem;            // [rows] the block's x channels after the conv
    float* bs = md_smem + MD_ROWS;  // [S]
    float* cs = bs + S;             // [S]
    const T* pr = proj + (size_t)b * W;
    const T* hb = hist + (size_t)b * (K - 1) * conv;
    T* ho = hist_out + (size_t)b * (K - 1) * conv;
    // The block's x channels, then its group's B and C: the conv, its bias and the SiLU; the
    // window moves on by one input (x channels by their own block, B and C by the first
    // block of the group's first head).
    const bool writes_bc = h % (H / G) == 0 && blockIdx.y == 0;
    for (int c = tid; c < rows + 2 * S; c += MD_THREADS) {
        const int ch = c < rows ? h * P + p0 + c
                                : (c < rows + S ? inner + g * S + (c - rows)
                                                : inner + G * S + g * S + (c - rows - S));
        const float xn = to_f(pr[inner + ch]);
        float acc = conv_b ? to_f(conv_b[ch]) : 0.f;
        for (int j = 0; j < K - 1; ++j) acc += to_f(conv_w[ch * K + j]) * to_f(hb[j * conv + ch]);
        acc += to_f(conv_w[ch * K + K - 1]) * xn;
        const float v = silu_f(acc);
        if (c < rows) xs[c] = v;
        else if (c < rows + S) bs[c - rows] = v;
        else cs[c - rows - S] = v;
        if (c < rows || writes_bc) {
            for (int j = 0; j + 1 < K - 1; ++j) ho[j * conv + ch] = hb[(j + 1) * conv + ch];
            ho[(K - 2) * conv + ch] = pr[inner + ch];  // (K ≥ 2)
        }
    }
    float dt = softplus_f(to_f(pr[inner + conv + h]) + dt_bias[h]);
    if (clamp) dt = fminf(fmaxf(dt, lo), hi);
    const float decay = __expf(-dt * __expf(a_log[h]));
    __syncthreads();
    // A warp a row p of the head's state: s = decay·s + dt·x_p·B, y_p = s·C.
    for (int r = warp; r < rows; r += MD_THREADS / 32) {
        const size_t base = (((size_t)b * H + h) * P + p0 + r) * S;
        const float xdt = dt * xs[r];
        float y = 0.f;
#pragma unroll 4
        for (int n = lane; n < S; n += 32) {
            const float s = fmaf(state[base + n], decay, xdt * bs[n]);
            state_out[base + n] = s;
            y = fmaf(s, cs[n], y);
        }
        y = warp_sum(y);
        if (lane == 0) {
            const int col = h * P + p0 + r;
            gated[(size_t)b * inner + col] = (y + dskip[h] * xs[r]) * silu_f(to_f(pr[col]));
        }
    }
}

// out = v / rms(v)·w over each group of the gated values of a row.
template <typename T>
__device__ __forceinline__ void mamba_decode_norm(const float* __restrict__ gated,
                                                  const float* __restrict__ norm_w,
                                                  T* __restrict__ out, int inner, int G,
                                                  float eps) {
    __shared__ float red[32];
    const int b = blockIdx.x / G, g = blockIdx.x - b * G, gw = inner / G;
    const float* v = gated + (size_t)b * inner + g * gw;
    float ss = 0.f;
    for (int j = threadIdx.x; j < gw; j += MD_THREADS) ss += v[j] * v[j];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < MD_THREADS / 32 ? red[threadIdx.x] : 0.f;
        t = warp_sum(t);
        if (threadIdx.x == 0) red[0] = rsqrtf(t / gw + eps);
    }
    __syncthreads();
    const float rs = red[0];
    T* o = out + (size_t)b * inner + g * gw;
    for (int j = threadIdx.x; j < gw; j += MD_THREADS) o[j] = from_f<T>(v[j] * rs * norm_w[g * gw + j]);
}

#define MD_INSTANTIATE(T, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(MD_THREADS) mamba_decode_step_##S(             \
        const T* proj, const T* hist, const T* conv_w, const T* conv_b, const float* dt_bias,   \
        const float* a_log, const float* dskip, const float* state, float* state_out,           \
        T* hist_out, float* gated, int H, int P, int Sd, int G, int K, int clamp, float lo,     \
        float hi) {                                                                             \
        mamba_decode_step<T>(proj, hist, conv_w, conv_b, dt_bias, a_log, dskip, state,          \
                             state_out, hist_out, gated, H, P, Sd, G, K, clamp, lo, hi);        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MD_THREADS) mamba_decode_norm_##S(             \
        const float* gated, const float* norm_w, T* out, int inner, int G, float eps) {         \
        mamba_decode_norm<T>(gated, norm_w, out, inner, G, eps);                                \
    }
MD_INSTANTIATE(float, f32)
MD_INSTANTIATE(__nv_bfloat16, bf16)
#ifndef COCKPIT_F16
MD_INSTANTIATE(__half, f16)
#endif
