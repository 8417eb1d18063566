// The whole-model step's materialised attention (head dims without flash kernels: Gemma's 256,
// small test widths): q|k|v into heads with grouped-query key/value heads repeated for their
// query heads, their gradients summed back per key/value head, and the causal softmax with a
// sliding window.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, to_f, from_f, ...) and the softmax templates used here.
#pragma once

// Packed projections src [B, T, (H + 2·KVH)·hd] → q, k, v each [B, H, T, hd]: query head h
// reads key/value head h / (H / KVH).
extern "C" __global__ void qkv_split_gqa_bf16(const bf16_t* __restrict__ src, bf16_t* __restrict__ q,
                                              bf16_t* __restrict__ k, bf16_t* __restrict__ v, int b,
                                              int t, int h, int kvh, int hd) {
    const int ld = (h + 2 * kvh) * hd, rep = h / kvh;
    const size_t total = (size_t)b * h * t * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int d = (int)(i % hd);
        size_t r = i / hd;
        const int ti = (int)(r % t);
        r /= t;
        const int hh = (int)(r % h);
        const size_t bi = r / h;
        const bf16_t* row = src + (bi * t + ti) * ld;
        const int kv = hh / rep;
        q[i] = row[hh * hd + d];
        k[i] = row[(h + kv) * hd + d];
        v[i] = row[(h + kvh + kv) * hd + d];
    }
}

// The key and value heads' gradients dk, dv [B, H, T, hd] (one per query head) summed over each
// key/value head's query heads into the k and v columns of dqkv [B, T, (H + 2·KVH)·hd].
extern "C" __global__ void kv_grads_merge_bf16(const bf16_t* __restrict__ dk,
                                               const bf16_t* __restrict__ dv,
                                               bf16_t* __restrict__ dqkv, int b, int t, int h,
                                               int kvh, int hd) {
    const int ld = (h + 2 * kvh) * hd, rep = h / kvh;
    const size_t total = (size_t)b * t * kvh * hd;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int d = (int)(i % hd);
        size_t r = i / hd;
        const int kv = (int)(r % kvh);
        r /= kvh;
        const int ti = (int)(r % t);
        const size_t bi = r / t;
        float sk = 0.f, sv = 0.f;
        for (int j = 0; j < rep; ++j) {
            const size_t o = (((bi * h) + kv * rep + j) * t + ti) * hd + d;
            sk += to_f(dk[o]);
            sv += to_f(dv[o]);
        }
        bf16_t* row = dqkv + (bi * t + ti) * ld;
        row[(h + kv) * hd + d] = from_f<bf16_t>(sk);
        row[(h + kvh + kv) * hd + d] = from_f<bf16_t>(sv);
    }
}

// The causal softmax of the step's scores (window > 0: a sliding layer's; cap > 0: Gemma 2's
// soft-cap, with each row's log-sum-exp in lse for the backward).
extern "C" __global__ void step_softmax_fwd_bf16(const bf16_t* x, bf16_t* y, int rows, int tq,
                                                 int tk, float scale, int window, float cap,
                                                 float* lse) {
    causal_softmax_fwd<bf16_t>(x, y, rows, tq, tk, scale, window, cap, lse);
}
extern "C" __global__ void step_softmax_bwd_bf16(const bf16_t* y, const bf16_t* dy, bf16_t* dx,
                                                 int rows, int tq, int tk, float scale,
                                                 int window, float cap, const float* lse) {
    causal_softmax_bwd<bf16_t>(y, dy, dx, rows, tq, tk, scale, window, cap, lse);
}
