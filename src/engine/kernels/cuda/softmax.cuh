// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Causal softmax over the last dim of attention scores [rows = B·H·Tq, Tk]:
// y[i, j] = softmax_j(scale · x[i, j]) over j ≤ i mod Tq + (Tk − Tq); masked entries are 0.
// With a window w > 0 (a sliding layer) also j > lim − w only. One warp per row.
template <typename T>
__device__ void causal_softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int rows, int tq,
                                   int tk, float scale, int window = 0) {
    const int warps = blockDim.x >> 5;
    const int row = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + (size_t)row * tk;
    T* yr = y + (size_t)row * tk;
    const int lim = row % tq + (tk - tq);  // last visible column
    const int lo = window > 0 ? max(0, lim - window + 1) : 0;  // first visible column
    float m = -INFINITY;
    for (int j = lo + lane; j <= lim; j += 32) m = fmaxf(m, to_f(xr[j]) * scale);
    m = warp_max(m);
    float s = 0.f;
    for (int j = lo + lane; j <= lim; j += 32) s += __expf(to_f(xr[j]) * scale - m);
    s = warp_sum(s);
    const float inv = s > 0.f ? 1.f / s : 0.f;
    for (int j = lane; j < tk; j += 32) {
        float p = j <= lim && j >= lo ? __expf(to_f(xr[j]) * scale - m) * inv : 0.f;
        yr[j] = from_f<T>(p);
    }
}

// dx = scale · y ⊙ (dy − Σ_j y_j dy_j)
template <typename T>
__device__ void causal_softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy,
                                   T* __restrict__ dx, int rows, int tq, int tk, float scale,
                                   int window = 0) {
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
    for (int j = lane; j < tk; j += 32) {
        float g = j <= lim && j >= lo ? scale * to_f(y[off + j]) * (to_f(dy[off + j]) - d) : 0.f;
        dx[off + j] = from_f<T>(g);
    }
}
