// The LM head's cross-entropy, forward and backward in one pass per row.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// Cross-entropy over padded logits [n, ld] (the first v columns are the vocabulary; ld a
// multiple of 8 and rows 16-byte aligned), forward and backward in one pass per row:
// acc[r] += lw·(logsumexp(x[r, :v]) − x[r, t[r]]) (a per-row running sum over the micro-batches
// of one step, read back once; lw weighs a micro-batch's rows: 1/its targets that train), then in
// place x[r, j] = g·(softmax(x[r])_j − [j = t[r]]); (g, lw) are read from the device (gw), so
// a captured micro-batch replays with each micro-batch's own. With a soft-cap c > 0 (Gemma 2's
// final one) the logits are z = c·tanh(x/c) and the gradient is taken through it: × (1 − t²),
// t = tanh(x/c). A target of CE_IGNORE (u32::MAX: a prompt
// or padding slot of instruction data) costs nothing and passes no gradient; any other target
// past the vocabulary makes the loss NaN.
// One block per row, 16-byte loads and stores.
#define CE_IGNORE 0xffffffffu

// A logit x soft-capped (cap > 0) or as it is.
__device__ __forceinline__ float ce_cap(float x, float cap) {
    return cap > 0.f ? cap * tanhf(x / cap) : x;
}

// The running (max, Σexp) of a thread's logits, over 8 more.
__device__ __forceinline__ void lse_acc8(uint4 u, float& m, float& s, float cap) {
    Bf8 b;
    b.u = u;
    float z[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(b.h[i]);
        z[2 * i] = ce_cap(f.x, cap);
        z[2 * i + 1] = ce_cap(f.y, cap);
    }
    float cm = z[0];
#pragma unroll
    for (int i = 1; i < 8; i++) cm = fmaxf(cm, z[i]);
    const float mm = fmaxf(m, cm);
    float cs = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) cs += __expf(z[i] - mm);
    s = s * __expf(m - mm) + cs;
    m = mm;
}

// The gradient at one logit x (column j) of g·CE: g·(softmax − onehot), through the soft-cap.
__device__ __forceinline__ float ce_grad1(float x, int j, float l, float g, uint32_t tg,
                                          float cap) {
    const float onehot = j == (int)tg ? 1.f : 0.f;
    if (cap > 0.f) {
        const float t = tanhf(x / cap);
        return g * (__expf(cap * t - l) - onehot) * (1.f - t * t);
    }
    return g * (__expf(x - l) - onehot);
}

// g·(softmax − onehot) of 8 logits starting at column j0, given the row's log-sum-exp l.
__device__ __forceinline__ uint4 ce_grad8(uint4 u, int j0, float l, float g, uint32_t tg,
                                          float cap) {
    Bf8 b;
    b.u = u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(b.h[i]);
        const int j = j0 + 2 * i;
        b.h[i] = __floats2bfloat162_rn(ce_grad1(f.x, j, l, g, tg, cap),
                                       ce_grad1(f.y, j + 1, l, g, tg, cap));
    }
    return b.u;
}

// The columns past the last full 8 (v not a multiple of 8): running (max, Σexp).
__device__ __forceinline__ void lse_tail(const bf16_t* xr, int v, float& m, float& s,
                                         float cap) {
    for (int j = ((v >> 3) << 3) + threadIdx.x; j < v; j += blockDim.x) {
        const float z = ce_cap(to_f(xr[j]), cap);
        const float mm = fmaxf(m, z);
        s = s * __expf(m - mm) + __expf(z - mm);
        m = mm;
    }
}

// The target's logit (thread 0; read before block_lse, whose barriers order it before
// any gradient write).
__device__ __forceinline__ float ce_target(const bf16_t* xr, uint32_t tg, int v, float cap) {
    return threadIdx.x == 0 && tg < (uint32_t)v ? ce_cap(to_f(xr[tg]), cap) : 0.f;
}

// The row's loss into acc (zt: the target's logit), and the tail columns' gradient.
__device__ __forceinline__ void ce_finish(bf16_t* xr, float* acc, int row, float l, float zt,
                                          float g, uint32_t tg, int v, float lw, float cap) {
    if (threadIdx.x == 0 && tg != CE_IGNORE)
        acc[row] += tg < (uint32_t)v ? lw * (l - zt) : __int_as_float(0x7fc00000);
    for (int j = ((v >> 3) << 3) + threadIdx.x; j < v; j += blockDim.x)
        xr[j] = __float2bfloat16(ce_grad1(to_f(xr[j]), j, l, g, tg, cap));
}

// Any vocabulary: the row is read twice (the second time mostly from L2).
extern "C" __global__ void ce_fused_bf16(bf16_t* __restrict__ x, const uint32_t* __restrict__ t,
                                         float* __restrict__ acc, const float* __restrict__ gw,
                                         int n, int v, int ld, float cap) {
    const int row = blockIdx.x;
    if (row >= n) return;
    bf16_t* xr = x + (size_t)row * ld;
    uint4* xv = reinterpret_cast<uint4*>(xr);
    const int v8 = v >> 3;
    float m = -INFINITY, s = 0.f;
    for (int q = threadIdx.x; q < v8; q += blockDim.x) lse_acc8(xv[q], m, s, cap);
    lse_tail(xr, v, m, s, cap);
    const uint32_t tg = t[row];
    const float g = tg == CE_IGNORE ? 0.f : __ldg(gw), lw = __ldg(gw + 1);
    const float zt = ce_target(xr, tg, v, cap);
    const float l = block_lse(m, s);
    for (int q = threadIdx.x; q < v8; q += blockDim.x)
        xv[q] = ce_grad8(xv[q], q * 8, l, g, tg, cap);
    ce_finish(xr, acc, row, l, zt, g, tg, v, lw, cap);
}

// Vocabularies up to 512·CE_REG·8 = 53248 columns (GPT-2's 50257, Llama's 32000): the row
// is read once, into registers (every load in flight at once), and written once; one
// 512-thread block per multiprocessor at a time.
#define CE_REG 13
extern "C" __global__ void __launch_bounds__(512, 1)
    ce_fused_reg_bf16(bf16_t* __restrict__ x, const uint32_t* __restrict__ t,
                      float* __restrict__ acc, const float* __restrict__ gw,
                      int n, int v, int ld, float cap) {
    const int row = blockIdx.x;
    if (row >= n) return;
    bf16_t* xr = x + (size_t)row * ld;
    uint4* xv = reinterpret_cast<uint4*>(xr);
    const int v8 = v >> 3;
    uint4 r[CE_REG];
#pragma unroll
    for (int k = 0; k < CE_REG; k++) {
        const int q = threadIdx.x + k * 512;
        if (q < v8) r[k] = xv[q];
    }
    float m = -INFINITY, s = 0.f;
#pragma unroll
    for (int k = 0; k < CE_REG; k++)
        if (threadIdx.x + k * 512 < v8) lse_acc8(r[k], m, s, cap);
    lse_tail(xr, v, m, s, cap);
    const uint32_t tg = t[row];
    const float g = tg == CE_IGNORE ? 0.f : __ldg(gw), lw = __ldg(gw + 1);
    const float zt = ce_target(xr, tg, v, cap);
    const float l = block_lse(m, s);
#pragma unroll
    for (int k = 0; k < CE_REG; k++) {
        const int q = threadIdx.x + k * 512;
        if (q < v8) xv[q] = ce_grad8(r[k], q * 8, l, g, tg, cap);
    }
    ce_finish(xr, acc, row, l, zt, g, tg, v, lw, cap);
}
