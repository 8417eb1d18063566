// Decode attention: one new query per row against the keys and values a batched generation
// cache holds (src/engine/model/decode_batch.rs, launched by decode_attention.rs), in two
// launches — the keys split into chunks across blocks (flash-decoding), then their partial
// softmaxes merged.
//
// ============================== LAUNCH CONTRACT ==============================================
// Layouts (contiguous, row-major; T = f32, bf16 or f16):
//   q    [B, H, D]             the new queries (RoPE applied), unscaled
//   kc   [B, KVH, cap, D]      the cache's keys; vc likewise its values
//   mask [B, cap] T            additive: 0 on a row's columns, -inf on its padding
//   part [B, H, nsplit, D + 2] f32 scratch: each chunk's unnormalised output, max, sum
//   y    [B, H, D] T
// Query head h reads key/value head h / (H / KVH). Row b attends to columns lo..len-1 where
// mask is 0 (lo: a sliding layer's window start, else 0). Scores are scale·q·k, through
// cap·tanh(score / cap) where cap > 0 (Gemma 2), then + mask.
// 1. decode_attn_split_<T>(q, kc, vc, mask, part, H, KVH, cap, D, lo, len, at, window, chunk,
//                          scale, softcap)
//      grid = (B*KVH, nsplit = ceil((len - lo) / chunk), 1), block = (DA_THREADS, 1, 1),
//      dynamic smem = (H / KVH) * (D + chunk) * 4 bytes. D a multiple of 8, at most DA_MAX_D.
//      Where `at` is not null (a step captured in a CUDA graph, whose arguments are fixed),
//      len = at[1] is read from the device and lo = max(0, len - window) (0 without a window);
//      then nsplit = ceil(cap / chunk), and the chunks past len give nothing.
// 2. decode_attn_merge_<T>(part, y, H, D, nsplit)
//      grid = (B*H, 1, 1), block = (DA_THREADS, 1, 1), dynamic smem = 0.
// =============================================================================================

#define DA_THREADS 128
#define DA_GROUP 8  // lanes sharing one key's dot products (16-byte chunks of the head dim)
#define DA_MAX_D 512

// 16-byte loads of 8 elements as floats.
__device__ __forceinline__ void da_load8(const float* p, float (&x)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void da_load8(const T* p, float (&x)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_f(e[i]);
}

template <typename T>
__device__ __forceinline__ void decode_attn_split(
    const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
    const T* __restrict__ mask, float* __restrict__ part, int H, int KVH, int cap, int D, int lo,
    int len, const unsigned int* __restrict__ at, int window, int chunk, float scale,
    float softcap) {
    extern __shared__ float da_smem[];
    if (at != nullptr) {
        len = (int)at[1];
        lo = window > 0 ? max(0, len - window) : 0;
    }
    const int rep = H / KVH, nch = D / 8;
    float* qs = da_smem;             // [rep][D] scale·q, later the output accumulator
    float* sc = da_smem + rep * D;   // [rep][chunk] scores, then probabilities
    const int b = blockIdx.x / KVH, kvh = blockIdx.x - b * KVH;
    const int split = blockIdx.y, nsplit = gridDim.y;
    const int c0 = lo + split * chunk, n = min(chunk, len - c0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const T* qb = q + ((size_t)b * H + kvh * rep) * D;
    const T* kb = kc + ((size_t)b * KVH + kvh) * cap * D;
    const T* vb = vc + ((size_t)b * KVH + kvh) * cap * D;
    for (int i = tid; i < rep * D; i += DA_THREADS) qs[i] = to_f(qb[i]) * scale;
    __syncthreads();

    // Scores: DA_GROUP lanes a key, lane g over head-dim chunks g, g + 8, ... (held in
    // registers across the group's heads); every lane runs every round of the loop (the
    // shuffles need the whole warp).
    const int grp = tid / DA_GROUP, g = tid % DA_GROUP;
    for (int j0 = 0; j0 < n; j0 += DA_THREADS / DA_GROUP) {
        const int j = j0 + grp, c = c0 + j;
        const bool ok = j < n;
        float k8[DA_MAX_D / 64][8];
#pragma unroll
        for (int i = 0; i < DA_MAX_D / 64; ++i) {
            const int ch = g + i * DA_GROUP;
            if (ok && ch < nch) da_load8(kb + (size_t)c * D + ch * 8, k8[i]);
        }
        for (int h = 0; h < rep; ++h) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DA_MAX_D / 64; ++i) {
                const int ch = g + i * DA_GROUP;
                if (ok && ch < nch) {
                    float q8[8];
                    da_load8(qs + h * D + ch * 8, q8);
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot = fmaf(q8[e], k8[i][e], dot);
                }
            }
#pragma unroll
            for (int o = DA_GROUP / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
            if (ok && g == 0) {
                if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);
                sc[h * chunk + j] = dot + to_f(mask[(size_t)b * cap + c]);
            }
        }
    }
    __syncthreads();

    // Each head's chunk maximum, exponentials and sum (a warp a head); the output accumulator
    // (qs, no longer read) zeroed meanwhile.
    float* red = part + ((size_t)b * H + kvh * rep) * nsplit * (D + 2);
    for (int h = warp; h < rep; h += DA_THREADS / 32) {
        float m = -INFINITY;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[h * chunk + j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += 32) {
            const float p = m == -INFINITY ? 0.f : __expf(sc[h * chunk + j] - m);
            sc[h * chunk + j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            float* r = red + ((size_t)h * nsplit + split) * (D + 2);
            r[D] = m;
            r[D + 1] = l;
        }
    }
    for (int i = tid; i < rep * D; i += DA_THREADS) qs[i] = 0.f;
    __syncthreads();

    // out[h] = Σ_j p[h][j] · v[j]: thread = (key subset, 8-column chunk), heads 8 at a time,
    // summed over the key subsets with shared-memory atomics.
    const int nks = DA_THREADS / nch;  // key subsets (nch <= DA_THREADS)
    const int cc = tid % nch, ks = tid / nch;
    if (ks < nks) {
        for (int h0 = 0; h0 < rep; h0 += 8) {
            const int hn = min(8, rep - h0);
            float acc[8][8];
#pragma unroll
            for (int h = 0; h < 8; ++h)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
            for (int j = ks; j < n; j += nks) {
                float v8[8];
                da_load8(vb + (size_t)(c0 + j) * D + cc * 8, v8);
#pragma unroll
                for (int h = 0; h < 8; ++h) {
                    if (h < hn) {
                        const float p = sc[(h0 + h) * chunk + j];
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(p, v8[e], acc[h][e]);
                    }
                }
            }
            // Lanes of a warp that share a column chunk (nch dividing 32: lanes nch apart)
            // add up first, so that fewer shared-memory atomics meet at one address.
            const bool folds = 32 % nch == 0;
            if (folds)
                for (int o = nch; o < 32; o <<= 1)
#pragma unroll
                    for (int h = 0; h < 8; ++h)
#pragma unroll
                        for (int e = 0; e < 8; ++e)
                            acc[h][e] += __shfl_xor_sync(FULL_MASK, acc[h][e], o);
            if (!folds || lane < nch)
#pragma unroll
                for (int h = 0; h < 8; ++h)
                    if (h < hn)
#pragma unroll
                        for (int e = 0; e < 8; ++e)
                            atomicAdd(qs + (h0 + h) * D + cc * 8 + e, acc[h][e]);
        }
    }
    __syncthreads();
    for (int i = tid; i < rep * D; i += DA_THREADS) {
        const int h = i / D, d = i - h * D;
        red[((size_t)h * nsplit + split) * (D + 2) + d] = qs[i];
    }
}

// y[b, h] = Σ_s e^{m_s − M} out_s / Σ_s e^{m_s − M} l_s over the chunks s.
template <typename T>
__device__ __forceinline__ void decode_attn_merge(const float* __restrict__ part, T* __restrict__ y,
                                                  int H, int D, int nsplit) {
    const size_t bh = blockIdx.x;
    const float* p = part + bh * nsplit * (D + 2);
    float m = -INFINITY;
    for (int s = 0; s < nsplit; ++s) m = fmaxf(m, p[s * (D + 2) + D]);
    float l = 0.f;
    for (int s = 0; s < nsplit; ++s) {
        const float ms = p[s * (D + 2) + D];
        l += ms == -INFINITY ? 0.f : __expf(ms - m) * p[s * (D + 2) + D + 1];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = threadIdx.x; d < D; d += DA_THREADS) {
        float acc = 0.f;
        for (int s = 0; s < nsplit; ++s) {
            const float ms = p[s * (D + 2) + D];
            if (ms != -INFINITY) acc = fmaf(__expf(ms - m), p[s * (D + 2) + d], acc);
        }
        y[bh * D + d] = from_f<T>(acc * inv);
    }
}

#define DA_INSTANTIATE(T, S)                                                                    \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attn_split_##S(             \
        const T* q, const T* kc, const T* vc, const T* mask, float* part, int H, int KVH,       \
        int cap, int D, int lo, int len, const unsigned int* at, int window, int chunk,         \
        float scale, float softcap) {                                                           \
        decode_attn_split<T>(q, kc, vc, mask, part, H, KVH, cap, D, lo, len, at, window, chunk, \
                             scale, softcap);                                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attn_merge_##S(             \
        const float* part, T* y, int H, int D, int nsplit) {                                    \
        decode_attn_merge<T>(part, y, H, D, nsplit);                                            \
    }
DA_INSTANTIATE(float, f32)
DA_INSTANTIATE(__nv_bfloat16, bf16)
#ifndef COCKPIT_F16
DA_INSTANTIATE(__half, f16)
#endif
