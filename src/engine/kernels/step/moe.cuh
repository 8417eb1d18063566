// Routed experts of a Granite 4.0 hybrid layer on the whole-model step: the router's top-k, the
// (row, slot) pairs sorted by expert, the gathers and weighted sums around the experts' matmuls
// (cuBLAS, one per expert, launched by step/moe.rs), and the backward's own steps.
// Part of the whole-model step's kernels: included by ../kernels.cu (bf16_t, Bf8, warp_sum,
// warp_max, sigmoid_f from swiglu.cuh).
//
// Layouts: n rows (tokens), k slots a row, P = n·k pairs. `topi`/`topw` [n, k]: each slot's
// expert and weight; `perm` [P]: the pairs in expert order (expert 0's first), each as its flat
// slot index row·k + s, rows ascending within an expert; `pos` [n·k]: each slot's place in it.
#pragma once

#define MOE_MAX_E 256
#define MOE_MAX_K 16

// A warp's argmax over (value, index) pairs: the larger value, the lower index on ties (the
// order the candle model sorts in).
__device__ __forceinline__ void moe_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

// A router logit as the models see it: the router's matmul rounded to the step's 16-bit type
// (the per-op model and transformers compute it in the model's dtype, then take it to f32, so
// ties and the weights come out the same), a NaN as −∞.
__device__ __forceinline__ float moe_logit(float x) {
    return isnan(x) ? -INFINITY : __bfloat162float(__float2bfloat16(x));
}

// A row's logits into a warp's registers, expert lane + 32·j in v[j] (−∞ past E); their max.
__device__ __forceinline__ float moe_row(const float* __restrict__ l, int E, int lane,
                                         float (&v)[MOE_MAX_E / 32]) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; j++) {
        const int e = lane + 32 * j;
        v[j] = e < E ? moe_logit(l[e]) : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    return warp_max(mx);
}

// The router: each row's logits (f32 [n, E] from the router's matmul, E ≤ MOE_MAX_E, read
// through moe_logit) → its top k experts, largest first, and their weights, the softmax of the
// chosen logits rounded to 16 bits (as the models cast them); each expert's count (`counts`,
// zeroed before, u32 [E]) and the router probabilities (softmax over all E) summed over the rows
// (`psum`, f32 [E]: the load-balancing loss). One warp a row, grid-stride; 256 threads.
// The sums in a fixed order, so that the loss is the same bits every run: each block adds its
// warps' sums in warp order into its row of `part` (f32 [gridDim.x, E]), and the last block to
// finish (`ticket`, a u32 that is 0 before and after) adds the blocks' rows in block order, a
// thread an expert. (Spreading that last sum over the block's warps measured no faster: one
// H100, the experts' config, 950.8 against 952.0 ms a step.)
extern "C" __global__ void __launch_bounds__(256)
    moe_route(const float* __restrict__ logits, int n, int E, int k, int* __restrict__ topi,
              float* __restrict__ topw, unsigned* __restrict__ counts, float* __restrict__ psum,
              float* __restrict__ part, unsigned* __restrict__ ticket) {
    constexpr int W = 8;  // warps: the 256 threads its launcher gives it
    __shared__ float sp[W][MOE_MAX_E];
    __shared__ bool last;
    constexpr int PER = MOE_MAX_E / 32;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    float acc[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) acc[j] = 0.f;
    for (int row = warp; row < n; row += warps) {
        float v[PER];
        const float mx = moe_row(logits + (size_t)row * E, E, lane, v);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < PER; j++) s += lane + 32 * j < E ? expf(v[j] - mx) : 0.f;
        s = warp_sum(s);
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (lane + 32 * j < E) acc[j] += expf(v[j] - mx) / s;
        unsigned taken = 0;
        float mine = -INFINITY;
        int mine_i = 0;
        for (int t = 0; t < k; t++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int e = lane + 32 * j;
                if (e < E && !(taken >> j & 1u) && (v[j] > bv || (v[j] == bv && e < bi))) {
                    bv = v[j];
                    bi = e;
                }
            }
            moe_argmax(bv, bi);
            if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
            if (lane == t) {
                mine = bv;
                mine_i = bi;
            }
        }
        const float top = __shfl_sync(FULL_MASK, mine, 0);
        const float w = lane < k ? expf(mine - top) : 0.f;
        const float ws = warp_sum(w);
        if (lane < k) {
            topi[(size_t)row * k + lane] = mine_i;
            topw[(size_t)row * k + lane] = __bfloat162float(__float2bfloat16(w / ws));
            atomicAdd(counts + mine_i, 1u);
        }
    }
    const int wib = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (lane + 32 * j < E) sp[wib][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < W; w++) s += sp[w][e];
        part[(size_t)blockIdx.x * E + e] = s;
    }
    // (Each block's row visible before its ticket: the last block reads them all.)
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float s = 0.f;
        for (int b = 0; b < (int)gridDim.x; b++) s += __ldcg(part + (size_t)b * E + e);
        psum[e] = s;
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

// The pairs sorted by expert: block e (of E) finds expert e's pairs in slot order and writes
// them at its offset (the counts of the experts before it) into `perm`, and each one's place
// into `pos`. Deterministic: no atomics. 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_sort(const int* __restrict__ topi,
                                                          const unsigned* __restrict__ counts,
                                                          int slots, int* __restrict__ perm,
                                                          int* __restrict__ pos) {
    __shared__ int warp_n[8];
    __shared__ int base;
    const int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        int off = 0;
        for (int j = 0; j < e; j++) off += (int)counts[j];
        base = off;
    }
    __syncthreads();
    int at = base;
    for (int q0 = 0; q0 < slots; q0 += 256) {
        const int q = q0 + threadIdx.x;
        const bool hit = q < slots && topi[q] == e;
        const unsigned m = __ballot_sync(FULL_MASK, hit);
        if (lane == 0) warp_n[w] = __popc(m);
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            before += j < w ? warp_n[j] : 0;
            total += warp_n[j];
        }
        if (hit) {
            const int p = at + before + __popc(m & ((1u << lane) - 1u));
            perm[p] = q;
            pos[q] = p;
        }
        at += total;
        __syncthreads();
    }
}

// dst row p (of P, stride c) = scale · src row perm[p] / k (stride lds): the rows each pair
// reads, in expert order. c8 = c / 8 (16-byte pieces).
extern "C" __global__ void moe_gather(const bf16_t* __restrict__ src, int lds,
                                      bf16_t* __restrict__ dst, const int* __restrict__ perm,
                                      int k, int P, int c8, float scale) {
    const size_t total = (size_t)P * c8;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int p = (int)(i / c8), j = (int)(i % c8);
        const int row = perm[p] / k;
        Bf8 x;
        x.u = reinterpret_cast<const uint4*>(src + (size_t)row * lds)[j];
        if (scale != 1.f) {
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const float2 f = __bfloat1622float2(x.h[h]);
                x.h[h] = __floats2bfloat162_rn(f.x * scale, f.y * scale);
            }
        }
        reinterpret_cast<uint4*>(dst + (size_t)p * c8 * 8)[j] = x.u;
    }
}

// out row r (stride ldo) += Σ_s w[r, s] · y row pos[r, s] (stride c; w null: weight 1), summed in
// f32 and rounded once: the experts' weighted outputs into the MLP's output (forward), their
// inputs' gradients into the normed input's (backward).
extern "C" __global__ void moe_combine(bf16_t* __restrict__ out, int ldo,
                                       const bf16_t* __restrict__ y, const int* __restrict__ pos,
                                       const float* __restrict__ w, int k, int n, int c8) {
    const size_t total = (size_t)n * c8;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / c8), j = (int)(i % c8);
        uint4* o = reinterpret_cast<uint4*>(out + (size_t)r * ldo) + j;
        Bf8 x;
        x.u = *o;
        float acc[8];
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const float2 f = __bfloat1622float2(x.h[h]);
            acc[2 * h] = f.x;
            acc[2 * h + 1] = f.y;
        }
        for (int s = 0; s < k; s++) {
            const size_t q = (size_t)r * k + s;
            const float ws = w ? w[q] : 1.f;
            Bf8 v;
            v.u = reinterpret_cast<const uint4*>(y + (size_t)pos[q] * c8 * 8)[j];
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const float2 f = __bfloat1622float2(v.h[h]);
                acc[2 * h] += ws * f.x;
                acc[2 * h + 1] += ws * f.y;
            }
        }
#pragma unroll
        for (int h = 0; h < 4; h++) x.h[h] = __floats2bfloat162_rn(acc[2 * h], acc[2 * h + 1]);
        *o = x.u;
    }
}

// The backward through each pair's weight: u = dy_r·W_down,e (per pair, [P, I], from the expert
// matmuls) → the weight's gradient dw[slot] = u · act (act = silu(gate)·up from the kept
// pre-activation `gu` [P, 2I], rounded as the forward rounds it), and u becomes the activation's
// gradient w·u in place. With `ys`/`act` (the experts' down matrices train): the pair's
// gathered dy row (`ys`, [P, C]) is scaled by w in place and act written out, the operands of
// W_down's gradient. One warp a pair, grid-stride; i8 = I / 8, c8 = C / 8.
extern "C" __global__ void moe_pair_bwd(const bf16_t* __restrict__ gu, bf16_t* __restrict__ u,
                                        bf16_t* __restrict__ ys, bf16_t* __restrict__ act,
                                        const int* __restrict__ perm,
                                        const float* __restrict__ topw, float* __restrict__ dw,
                                        int P, int i8, int c8) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int p = warp; p < P; p += warps) {
        const int q = perm[p];
        const float w = topw[q];
        const uint4* g = reinterpret_cast<const uint4*>(gu + (size_t)p * 2 * i8 * 8);
        uint4* uv = reinterpret_cast<uint4*>(u + (size_t)p * i8 * 8);
        float dot = 0.f;
        for (int j = lane; j < i8; j += 32) {
            Bf8 gg, uu, d, a;
            gg.u = g[j];
            uu.u = g[i8 + j];
            d.u = uv[j];
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const float2 fg = __bfloat1622float2(gg.h[h]), fu = __bfloat1622float2(uu.h[h]);
                const float s0 = __bfloat162float(__float2bfloat16(fg.x * sigmoid_f(fg.x)));
                const float s1 = __bfloat162float(__float2bfloat16(fg.y * sigmoid_f(fg.y)));
                a.h[h] = __floats2bfloat162_rn(s0 * fu.x, s1 * fu.y);
                const float2 fa = __bfloat1622float2(a.h[h]), fd = __bfloat1622float2(d.h[h]);
                dot += fa.x * fd.x + fa.y * fd.y;
                d.h[h] = __floats2bfloat162_rn(w * fd.x, w * fd.y);
            }
            uv[j] = d.u;
            if (act) reinterpret_cast<uint4*>(act + (size_t)p * i8 * 8)[j] = a.u;
        }
        dot = warp_sum(dot);
        if (lane == 0) dw[q] = dot;
        if (ys) {
            uint4* yv = reinterpret_cast<uint4*>(ys + (size_t)p * c8 * 8);
            for (int j = lane; j < c8; j += 32) {
                Bf8 y;
                y.u = yv[j];
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    const float2 f = __bfloat1622float2(y.h[h]);
                    y.h[h] = __floats2bfloat162_rn(w * f.x, w * f.y);
                }
                yv[j] = y.u;
            }
        }
    }
}

// The router's backward, one warp a row: the logits' gradient (16-bit [n, E]) from the chosen
// slots' weight gradients dw (through the softmax over the chosen logits; the weights' 16-bit
// rounding passed straight through) and, with `aux`
// (f32 [E]: the load-balancing loss's gradient w.r.t. each router probability), through the
// softmax over all E.
extern "C" __global__ void moe_router_bwd(const float* __restrict__ logits,
                                          const int* __restrict__ topi,
                                          const float* __restrict__ topw,
                                          const float* __restrict__ dw,
                                          const float* __restrict__ aux,
                                          bf16_t* __restrict__ dlogits, int n, int E, int k) {
    constexpr int PER = MOE_MAX_E / 32;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    for (int row = warp; row < n; row += warps) {
        const size_t q0 = (size_t)row * k;
        const float wt = lane < k ? topw[q0 + lane] : 0.f;
        const float dt = lane < k ? dw[q0 + lane] : 0.f;
        const int it = lane < k ? topi[q0 + lane] : -1;
        const float m = warp_sum(wt * dt);
        const float mine = wt * (dt - m);
        float g[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) g[j] = 0.f;
        if (aux) {
            float v[PER];
            const float mx = moe_row(logits + (size_t)row * E, E, lane, v);
            float s = 0.f, pg = 0.f;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int e = lane + 32 * j;
                v[j] = e < E ? expf(v[j] - mx) : 0.f;
                s += v[j];
                pg += e < E ? v[j] * aux[e] : 0.f;
            }
            s = warp_sum(s);
            pg = warp_sum(pg) / s;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                const int e = lane + 32 * j;
                if (e < E) g[j] = v[j] / s * (aux[e] - pg);
            }
        }
        for (int t = 0; t < k; t++) {
            const int e = __shfl_sync(FULL_MASK, it, t);
            const float d = __shfl_sync(FULL_MASK, mine, t);
#pragma unroll
            for (int j = 0; j < PER; j++)
                if (lane + 32 * j == e) g[j] += d;
        }
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int e = lane + 32 * j;
            if (e < E) dlogits[(size_t)row * E + e] = __float2bfloat16(g[j]);
        }
    }
}
