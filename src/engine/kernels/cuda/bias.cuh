// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Bias add and bias + GELU (tanh approximation, as candle's `gelu`) over x [n, c], b [c].
template <typename T>
__device__ void bias_add(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                         size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        y[i] = from_f<T>(to_f(x[i]) + to_f(b[i % c]));
    }
}

#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f

template <typename T>
__device__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ b,
                              T* __restrict__ y, size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = to_f(x[i]) + (b != nullptr ? to_f(b[i % c]) : 0.f);
        float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
        y[i] = from_f<T>(0.5f * u * (1.f + th));
    }
}

template <typename T>
__device__ void bias_gelu_bwd(const T* __restrict__ x, const T* __restrict__ b,
                              const T* __restrict__ dy, T* __restrict__ dx, size_t total, int c) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = to_f(x[i]) + (b != nullptr ? to_f(b[i % c]) : 0.f);
        float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
        float d = 0.5f * (1.f + th) +
                  0.5f * u * (1.f - th * th) * GELU_K0 * (1.f + 3.f * GELU_K1 * u * u);
        dx[i] = from_f<T>(to_f(dy[i]) * d);
    }
}

// out[c] += Σ_rows x[r, c] (f32 accumulator zeroed by the caller). Block (32, 8).
template <typename T>
__device__ void col_sum(const T* __restrict__ x, float* __restrict__ out, int n, int c) {
    __shared__ float part[8][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (col < c) {
        for (int r = blockIdx.y * 8 + threadIdx.y; r < n; r += gridDim.y * 8)
            s += to_f(x[(size_t)r * c + col]);
    }
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += part[k][threadIdx.x];
        atomicAdd(&out[col], t);
    }
}
