// The Mamba-2 mixer's dt: softplus(in_proj's dt column + dt_bias) within the limits, lam its
// cumulative sum × A within each chunk; and the backward into dzx's dt column, dt_bias and A_log.
// Part of mamba.cuh's family, launched by mamba.rs; included by ../kernels.cu after mamba.cuh.
#pragma once

// dt's kernels: a warp per (b, h, chunk), lane l owning the chunk's positions 2l and 2l + 1
// (MB_L = 64). Returns false for the grid's spare warps.
static_assert(MB_L == 64, "mamba_dt_*: a warp's lanes own two positions of a chunk each");
struct MbDtLane {
    int bb, hh, c;
    size_t base;  // (b·H + h)·Tp + c·MB_L: the chunk's dtv/lam/ddt/dlam
};
__device__ __forceinline__ bool mb_dt_lane(MbDtLane& d, int b, int h, int chunks) {
    const int q = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    if (q >= b * h * chunks) return false;
    d.c = q % chunks;
    d.hh = (q / chunks) % h;
    d.bb = q / (chunks * h);
    d.base = (size_t)(d.bb * h + d.hh) * chunks * MB_L + (size_t)d.c * MB_L;
    return true;
}

// dt: dtv = softplus(zx[r, off + h] + dt_bias[h]) (clamped to [lo, hi] where `clamp`), lam its
// running sum × A (A = −exp(a_log[h])) within each chunk; 0 and the chunk's last sum past T.
// The running sum is a warp scan over the lanes' pairs.
extern "C" __global__ void __launch_bounds__(128)
    mamba_dt_fwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                      const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ a_log,
                      float* __restrict__ dtv, float* __restrict__ lam, int b, int t, int h,
                      int chunks, int clamp, float lo, float hi) {
    MbDtLane d;
    if (!mb_dt_lane(d, b, h, chunks)) return;
    const int lane = threadIdx.x & 31;
    const float a = -__expf(to_f(a_log[d.hh])), bias = to_f(dt_bias[d.hh]);
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int tt = d.c * MB_L + 2 * lane + e;
        v[e] = 0.f;
        if (tt < t) {
            v[e] = softplus_f(to_f(zx[(size_t)(d.bb * t + tt) * ld + off + d.hh]) + bias);
            if (clamp) v[e] = fminf(fmaxf(v[e], lo), hi);
        }
    }
    const float mine = v[0] * a + v[1] * a;
    float run = mine;  // inclusive scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_up_sync(0xffffffffu, run, o);
        if (lane >= o) run += u;
    }
    const float first = run - mine + v[0] * a;
    *reinterpret_cast<float2*>(&dtv[d.base + 2 * lane]) = make_float2(v[0], v[1]);
    *reinterpret_cast<float2*>(&lam[d.base + 2 * lane]) = make_float2(first, first + v[1] * a);
}

// dt's backward: da_j = Σ_{i ≥ j in the chunk} dlam_i (a warp's suffix scan over its lanes'
// pairs); ddtv_j = ddt_j + da_j·A; through the limits and softplus into dzx's dt column (bf16);
// dt_bias's gradient += Σ, A_log's += A·Σ da·dtv (a warp sum, one atomic each).
extern "C" __global__ void __launch_bounds__(128)
    mamba_dt_bwd_bf16(const bf16_t* __restrict__ zx, int ld, int off,
                      const bf16_t* __restrict__ dt_bias, const bf16_t* __restrict__ a_log,
                      const float* __restrict__ dtv, const float* __restrict__ ddt,
                      const float* __restrict__ dlam, bf16_t* __restrict__ dzx,
                      float* __restrict__ dbias, float* __restrict__ da_log, int b, int t, int h,
                      int chunks, int clamp, float lo, float hi) {
    MbDtLane d;
    if (!mb_dt_lane(d, b, h, chunks)) return;
    const int lane = threadIdx.x & 31;
    const float a = -__expf(to_f(a_log[d.hh])), bias = to_f(dt_bias[d.hh]);
    const float2 dl = *reinterpret_cast<const float2*>(&dlam[d.base + 2 * lane]);
    float run = dl.x + dl.y;  // inclusive suffix scan over the lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_down_sync(0xffffffffu, run, o);
        if (lane + o < 32) run += u;
    }
    const float da[2] = {run, run - dl.x};
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int i = 2 * lane + e, tt = d.c * MB_L + i;
        if (tt >= t) continue;
        sa += da[e] * dtv[d.base + i];
        float g = ddt[d.base + i] + da[e] * a;
        const size_t at = (size_t)(d.bb * t + tt) * ld + off + d.hh;
        const float u = to_f(zx[at]) + bias;
        if (clamp) {
            const float raw = softplus_f(u);
            if (raw < lo || raw > hi) g = 0.f;
        }
        g *= sigmoid_f(u);
        dzx[at] = from_f<bf16_t>(g);
        sb += g;
    }
    sa = warp_sum(sa);
    sb = warp_sum(sb);
    if (lane == 0) {
        if (dbias) atomicAdd(&dbias[d.hh], sb);
        if (da_log) atomicAdd(&da_log[d.hh], sa * a);
    }
}
