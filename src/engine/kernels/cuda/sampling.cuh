// Included by ../kernels.cu after dropout.cuh (its Philox generator draws the uniforms);
// launched from sampling.rs beside this file.
#pragma once

// The next token of every row of a batch in one launch (src/engine/generate/sampling.rs is
// the same choice in candle ops: the CPU path and the reference of tests/gpu_sampling.rs).
// One block per row of logits [rows, vocab] (f32):
//   x = logit, divided by the repetition penalty r where the row has seen the token and the
//       logit is ≥ 0, multiplied by r where it is < 0; then times 1 / temperature;
//   greedy: the first maximum of x;
//   top-k (0 < k < vocab): keep x ≥ the k-th largest x (ties with it kept), found by a radix
//       select over the 32-bit order-preserving keys of x (four passes of 8-bit digits);
//   top-p (< 1): of those, keep the fewest most likely tokens whose probability reaches p (x ≥
//       the largest threshold whose tokens at or above it hold ≥ p of the mass; ties kept).
//       Over the top-k candidates when they fit shared memory (sorted there, the threshold a
//       scan), otherwise over the whole row by a radix select that sums probability mass
//       instead of counting;
//   a draw from the kept tokens' renormalised probabilities: one uniform from Philox4x32-10
//       keyed by the seed, counter (row, step), by the inverse of the cumulative mass.
// Every sum runs in a fixed order (warp-private histograms, no float atomics across warps):
// the same logits, seed and step give the same token.

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Top-k candidates sorted in shared memory (a power of two); more (ties) use the row path.
#define SAMPLE_CAP 1024
// Elements a thread loads before it processes them (memory-level parallelism in the selects).
#define SAMPLE_UNROLL 4

// Order-preserving key of a float (larger x, larger key); -0 is +0.
__device__ __forceinline__ uint32_t sample_key(float x) {
    uint32_t b = __float_as_uint(x);
    if ((b << 1) == 0) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sample_unkey(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// A row of logits as the sampler sees it: penalised, tempered; NaN as -inf.
struct SampleRow {
    const float* row;
    const uint8_t* seen;  // null: no repetition penalty
    float pen_pos, pen_neg, inv_t;
    int n;
    __device__ __forceinline__ float value(int j) const {
        float x = row[j];
        if (seen != nullptr && seen[j]) x = x >= 0.f ? x * pen_pos : x * pen_neg;
        x = x * inv_t;
        return isnan(x) ? -INFINITY : x;
    }
    // This thread's SAMPLE_UNROLL values of the stretch from j0 (0 past the row), all loaded
    // before any is used.
    __device__ __forceinline__ void values(int j0, float (&xs)[SAMPLE_UNROLL]) const {
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; u++) {
            const int j = j0 + u * SAMPLE_THREADS + threadIdx.x;
            xs[u] = j < n ? value(j) : 0.f;
        }
    }
};

struct SampleShared {
    float hist[SAMPLE_WARPS * 256];  // per-warp digit counts (as uint32) or masses
    float tot[256];
    float thread_sum[SAMPLE_THREADS];
    float cand_v[SAMPLE_CAP];
    int cand_i[SAMPLE_CAP];
    uint32_t prefix;
    float above;
    int count;
    int pick;
    float fval;
};

// The 32-bit key T, largest among the row's keys ≥ `floor` with count(key ≥ T) ≥ k (the k-th
// largest x); `count_ge` gets count(key ≥ T).
__device__ uint32_t sample_select_count(const SampleRow& s, int k, SampleShared& sh,
                                        int* count_ge) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t* hist = reinterpret_cast<uint32_t*>(sh.hist);
    uint32_t prefix = 0;
    int above = 0, last_bin = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < SAMPLE_WARPS * 256; i += SAMPLE_THREADS) hist[i] = 0;
        __syncthreads();
        const uint32_t hi = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int j0 = 0; j0 < s.n; j0 += SAMPLE_THREADS * SAMPLE_UNROLL) {
            // The loads first (several in flight), then the warp's bookkeeping.
            float xs[SAMPLE_UNROLL];
            s.values(j0, xs);
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; u++) {
                const int j = j0 + u * SAMPLE_THREADS + threadIdx.x;
                const uint32_t key = sample_key(xs[u]);
                const bool in = j < s.n && (key & hi) == (prefix & hi);
                const uint32_t digit = (key >> shift) & 255u;
                const unsigned active = __ballot_sync(FULL_MASK, in);
                if (in) {
                    const unsigned peers = __match_any_sync(active, digit);
                    if (lane == __ffs(peers) - 1) hist[warp * 256 + digit] += __popc(peers);
                }
                __syncwarp();
            }
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            uint32_t t = 0;
            for (int w = 0; w < SAMPLE_WARPS; w++) t += hist[w * 256 + threadIdx.x];
            reinterpret_cast<uint32_t*>(sh.tot)[threadIdx.x] = t;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const uint32_t* tot = reinterpret_cast<const uint32_t*>(sh.tot);
            int d = 255, acc = above;
            for (; d > 0; d--) {
                if (acc + (int)tot[d] >= k) break;
                acc += tot[d];
            }
            sh.prefix = prefix | ((uint32_t)d << shift);
            sh.count = acc;
            sh.pick = acc + (int)tot[d];
        }
        __syncthreads();
        prefix = sh.prefix;
        above = sh.count;
        last_bin = sh.pick;
        __syncthreads();
    }
    *count_ge = last_bin;
    return prefix;
}

// The largest key T ≥ `floor` with mass(key ≥ T) ≥ target, mass = Σ exp(x − m) over the
// row's keys ≥ floor; the smallest key with mass where rounding leaves the target unreached.
__device__ uint32_t sample_select_mass(const SampleRow& s, uint32_t floor, float m, float target,
                                       SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t prefix = 0;
    float above = 0.f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < SAMPLE_WARPS * 256; i += SAMPLE_THREADS) sh.hist[i] = 0.f;
        __syncthreads();
        const uint32_t hi = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int j0 = 0; j0 < s.n; j0 += SAMPLE_THREADS * SAMPLE_UNROLL) {
            float xs[SAMPLE_UNROLL];
            s.values(j0, xs);
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; u++) {
                const int j = j0 + u * SAMPLE_THREADS + threadIdx.x;
                const uint32_t key = sample_key(xs[u]);
                const bool in = j < s.n && key >= floor && (key & hi) == (prefix & hi);
                const float q = in ? __expf(xs[u] - m) : 0.f;
                const uint32_t digit = (key >> shift) & 255u;
                const unsigned active = __ballot_sync(FULL_MASK, in);
                if (active == 0u) continue;
                const unsigned peers = in ? __match_any_sync(active, digit) : 0u;
                // The peers' masses summed in lane order (a fixed order: the same sums each
                // run).
                float sum = 0.f;
                for (int o = 0; o < 32; o++) {
                    const float v = __shfl_sync(FULL_MASK, q, o);
                    if ((peers >> o) & 1u) sum += v;
                }
                if (in && lane == __ffs(peers) - 1) sh.hist[warp * 256 + digit] += sum;
                __syncwarp();
            }
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            float t = 0.f;
            for (int w = 0; w < SAMPLE_WARPS; w++) t += sh.hist[w * 256 + threadIdx.x];
            sh.tot[threadIdx.x] = t;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = above;
            int d = 255, lowest = -1;
            for (; d >= 0; d--) {
                if (sh.tot[d] > 0.f) {
                    lowest = d;
                    if (acc + sh.tot[d] >= target) break;
                }
                acc += sh.tot[d];
            }
            if (d < 0) {  // rounding: the target is past the whole mass; keep all of it
                d = lowest < 0 ? 0 : lowest;
                acc -= sh.tot[d];
            }
            sh.prefix = prefix | ((uint32_t)d << shift);
            sh.above = acc;
        }
        __syncthreads();
        prefix = sh.prefix;
        above = sh.above;
        __syncthreads();
    }
    return prefix;
}

__device__ __forceinline__ float sample_block_max(float v, SampleShared& sh) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) sh.tot[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float r = sh.tot[0];
        for (int w = 1; w < SAMPLE_WARPS; w++) r = fmaxf(r, sh.tot[w]);
        sh.fval = r;
    }
    __syncthreads();
    const float r = sh.fval;
    __syncthreads();
    return r;
}

// The row's uniform in [0, 1) for this step.
__device__ __forceinline__ float sample_uniform(unsigned long long seed, unsigned long long step,
                                                int row) {
    const Philox4 r = philox4x32_10((uint32_t)row, (uint32_t)step, (uint32_t)(step >> 32),
                                    0x53414D50u, (uint32_t)seed, (uint32_t)(seed >> 32));
    return (float)(r.v[0] >> 8) * (1.0f / 16777216.0f);
}

// Candidates (cand_v, cand_i)[0..n) sorted in place: x descending, ties by index ascending.
__device__ void sample_sort(SampleShared& sh, int n) {
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + threadIdx.x; i < size; i += SAMPLE_THREADS) {
        sh.cand_v[i] = -INFINITY;
        sh.cand_i[i] = 0x7fffffff;
    }
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < size; i += SAMPLE_THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const float vi = sh.cand_v[i], vp = sh.cand_v[p];
                    const int ii = sh.cand_i[i], ip = sh.cand_i[p];
                    // Whether p belongs before i in the final order.
                    const bool p_first = vp > vi || (vp == vi && ip < ii);
                    const bool descending = (i & k) == 0;
                    if (p_first == descending) {
                        sh.cand_v[i] = vp;
                        sh.cand_v[p] = vi;
                        sh.cand_i[i] = ip;
                        sh.cand_i[p] = ii;
                    }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows_f32(const float* __restrict__ logits, const uint8_t* __restrict__ seen,
                    int use_seen, uint32_t* __restrict__ out, float* __restrict__ floor_out,
                    int rows, int vocab, float inv_t, float pen_pos, float pen_neg, int top_k,
                    float top_p, unsigned long long seed, unsigned long long step, int greedy) {
    __shared__ SampleShared sh;
    const int row = blockIdx.x;
    if (row >= rows) return;
    SampleRow s;
    s.row = logits + (size_t)row * vocab;
    s.seen = use_seen ? seen + (size_t)row * vocab : nullptr;
    s.pen_pos = pen_pos;
    s.pen_neg = pen_neg;
    s.inv_t = greedy ? 1.f : inv_t;
    s.n = vocab;
    const int tid = threadIdx.x;

    if (greedy) {
        // The first maximum.
        float best = -INFINITY;
        int bi = 0x7fffffff;
        for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
            const float x = s.value(j);
            if (x > best || bi == 0x7fffffff) {
                best = x;
                bi = j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        if ((tid & 31) == 0) {
            sh.cand_v[tid >> 5] = best;
            sh.cand_i[tid >> 5] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < SAMPLE_WARPS; w++)
                if (sh.cand_v[w] > best || (sh.cand_v[w] == best && sh.cand_i[w] < bi)) {
                    best = sh.cand_v[w];
                    bi = sh.cand_i[w];
                }
            out[row] = (uint32_t)min(bi, vocab - 1);
            if (floor_out) floor_out[row] = best;
        }
        return;
    }

    // Top-k: the threshold key, and the candidates in shared memory when they fit.
    uint32_t floor = 0;
    int n_cand = -1;
    if (top_k > 0 && top_k < vocab) {
        int c;
        floor = sample_select_count(s, top_k, sh, &c);
        if (c <= SAMPLE_CAP) {
            if (tid == 0) sh.count = 0;
            __syncthreads();
            for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
                const float x = s.value(j);
                if (sample_key(x) >= floor) {
                    const int at = atomicAdd(&sh.count, 1);
                    if (at < SAMPLE_CAP) {
                        sh.cand_v[at] = x;
                        sh.cand_i[at] = j;
                    }
                }
            }
            __syncthreads();
            n_cand = min(sh.count, SAMPLE_CAP);
            __syncthreads();
            sample_sort(sh, n_cand);
        }
    }
    const float u = sample_uniform(seed, step, row);

    if (n_cand >= 0) {
        // The candidates, sorted: top-p by a scan, the draw by another (one thread; k is small).
        if (tid == 0) {
            const float m = sh.cand_v[0];
            float z = 0.f;
            for (int i = 0; i < n_cand; i++) z += __expf(sh.cand_v[i] - m);
            int kept = n_cand;
            if (top_p < 1.f) {
                const float target = top_p * z;
                float acc = 0.f;
                int i = 0;
                for (; i < n_cand; i++) {
                    acc += __expf(sh.cand_v[i] - m);
                    if (acc >= target) break;
                }
                if (i >= n_cand) i = n_cand - 1;
                // Ties with the threshold stay.
                while (i + 1 < n_cand && sh.cand_v[i + 1] == sh.cand_v[i]) i++;
                kept = i + 1;
            }
            float mass = 0.f;
            for (int i = 0; i < kept; i++) mass += __expf(sh.cand_v[i] - m);
            const float target = u * mass;
            float acc = 0.f;
            int pick = kept - 1;
            for (int i = 0; i < kept; i++) {
                acc += __expf(sh.cand_v[i] - m);
                if (acc > target) {
                    pick = i;
                    break;
                }
            }
            out[row] = (uint32_t)sh.cand_i[pick];
            if (floor_out) floor_out[row] = sh.cand_v[kept - 1];
        }
        return;
    }

    // The whole row (no top-k, or more tied candidates than fit): max, mass, top-p by a
    // radix select over the mass, then the draw.
    float mx = -INFINITY;
    for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
        const float x = s.value(j);
        if (sample_key(x) >= floor) mx = fmaxf(mx, x);
    }
    const float m = sample_block_max(mx, sh);
    if (top_p < 1.f) {
        float part = 0.f;
        for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
            const float x = s.value(j);
            if (sample_key(x) >= floor) part += __expf(x - m);
        }
        sh.thread_sum[tid] = part;
        __syncthreads();
        if (tid == 0) {
            float z = 0.f;
            for (int t = 0; t < SAMPLE_THREADS; t++) z += sh.thread_sum[t];
            sh.fval = z;
        }
        __syncthreads();
        const float z = sh.fval;
        __syncthreads();
        floor = sample_select_mass(s, floor, m, top_p * z, sh);
    }
    // The draw: the kept mass in a fixed order (thread by thread, each its strided tokens),
    // the thread whose span holds u × mass, then its token.
    float part = 0.f;
    for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
        const float x = s.value(j);
        if (sample_key(x) >= floor) part += __expf(x - m);
    }
    sh.thread_sum[tid] = part;
    __syncthreads();
    if (tid == 0) {
        float mass = 0.f;
        for (int t = 0; t < SAMPLE_THREADS; t++) mass += sh.thread_sum[t];
        const float target = u * mass;
        float acc = 0.f;
        int owner = -1, last = -1;
        for (int t = 0; t < SAMPLE_THREADS; t++) {
            if (sh.thread_sum[t] > 0.f) {
                last = t;
                if (acc + sh.thread_sum[t] > target) {
                    owner = t;
                    break;
                }
            }
            acc += sh.thread_sum[t];
        }
        sh.pick = owner < 0 ? (last < 0 ? 0 : last) : owner;
        // Past the whole mass by rounding: the last thread's last kept token.
        sh.above = owner < 0 ? INFINITY : target - acc;
    }
    __syncthreads();
    if (tid == sh.pick) {
        const float rest = sh.above;
        float acc = 0.f;
        int pick = -1, last = -1;
        for (int j = tid; j < vocab; j += SAMPLE_THREADS) {
            const float x = s.value(j);
            if (sample_key(x) >= floor) {
                const float q = __expf(x - m);
                if (q > 0.f) last = j;
                acc += q;
                if (acc > rest) {
                    pick = j;
                    break;
                }
            }
        }
        if (pick < 0) pick = last < 0 ? min(tid, vocab - 1) : last;
        out[row] = (uint32_t)pick;
        if (floor_out) floor_out[row] = floor == 0 ? -INFINITY : sample_unkey(floor);
    }
}

// The repetition penalty's record: the token each row just took is now seen.
extern "C" __global__ void sample_observe(uint8_t* __restrict__ seen,
                                          const uint32_t* __restrict__ tokens, int rows,
                                          int vocab) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        const uint32_t t = tokens[r];
        if (t < (uint32_t)vocab) seen[(size_t)r * vocab + t] = 1;
    }
}
