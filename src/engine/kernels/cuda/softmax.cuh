// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Causal softmax over the last dim of attention scores [rows = B·H·Tq, Tk]:
// y[i, j] = softmax_j(z[i, j]) over j ≤ i mod Tq + (Tk − Tq); masked entries are 0, where
// z = scale · x, or with a soft-cap c > 0 (Gemma 2) z = c · tanh(scale · x / c).
// With a window w > 0 (a sliding layer) also j > lim − w only. With `lse`, each row's
// log-sum-exp of z is stored there (f32: the soft-capped backward recovers z from y with it).
// One warp per row.
__device__ __forceinline__ float softcapped(float z, float cap) {
    return cap > 0.f ? cap * tanhf(z / cap) : z;
}

template <typename T>
__device__ void causal_softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int rows, int tq,
                                   int tk, float scale, int window = 0, float cap = 0.f,
                                   float* __restrict__ lse = nullptr) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + (size_t)row * tk;
    T* yr = y + (size_t)row * tk;
    const int lim = row % tq + (tk - tq);  // last visible column
    const int lo = window > 0 ? max(0, lim - window + 1) : 0;  // first visible column
    float m = -INFINITY;
    for (int j = lo + lane; j <= lim; j += 32)
        m = fmaxf(m, softcapped(to_f(xr[j]) * scale, cap));
    m = warp_max(m);
    float s = 0.f;
    for (int j = lo + lane; j <= lim; j += 32)
        s += __expf(softcapped(to_f(xr[j]) * scale, cap) - m);
    s = warp_sum(s);
    const float inv = s > 0.f ? 1.f / s : 0.f;
    if (lse != nullptr && lane == 0) lse[row] = m + __logf(s);
    for (int j = lane; j < tk; j += 32) {
        float p = j <= lim && j >= lo ? __expf(softcapped(to_f(xr[j]) * scale, cap) - m) * inv
                                      : 0.f;
        yr[j] = from_f<T>(p);
    }
}

// dx = scale · y ⊙ (dy − Σ_j y_j dy_j), and with a soft-cap c > 0 also ⊙ (1 − t²), where
// t = tanh(scale · x / c) = (ln y + lse) / c (the forward's row log-sum-exp `lse`; where y
// is 0 the gradient is 0 whatever t is).
template <typename T>
__device__ void causal_softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy,
                                   T* __restrict__ dx, int rows, int tq, int tk, float scale,
                                   int window = 0, float cap = 0.f,
                                   const float* __restrict__ lse = nullptr) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const size_t off = (size_t)row * tk;
    const int lim = row % tq + (tk - tq);
    const int lo = window > 0 ? max(0, lim - window + 1) : 0;
    float d = 0.f;
    for (int j = lo + lane; j <= lim; j += 32) d += to_f(y[off + j]) * to_f(dy[off + j]);
    d = warp_sum(d);
    const bool capped = cap > 0.f && lse != nullptr;
    const float l = capped ? lse[row] : 0.f;
    for (int j = lane; j < tk; j += 32) {
        const float yj = to_f(y[off + j]);
        float g = j <= lim && j >= lo ? scale * yj * (to_f(dy[off + j]) - d) : 0.f;
        if (capped && yj > 0.f) {
            const float t = fminf(1.f, fmaxf(-1.f, (__logf(yj) + l) / cap));
            g *= 1.f - t * t;
        }
        dx[off + j] = from_f<T>(g);
    }
}
