// Bias add and bias + GELU over 16-byte accesses, forward and backward.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// Vectorised bias epilogues over x [rows, c] with c a multiple of 8 (16-byte accesses):
// y = x + b, y = gelu(x + b), and dx = dy·gelu'(x + b) (dx may alias dy, y may alias x).
__device__ __forceinline__ float gelu_f(float u) {
    return 0.5f * u * (1.f + tanhf(GELU_K0 * (u + GELU_K1 * u * u * u)));
}
__device__ __forceinline__ float gelu_grad_f(float u) {
    const float th = tanhf(GELU_K0 * (u + GELU_K1 * u * u * u));
    return 0.5f * (1.f + th) + 0.5f * u * (1.f - th * th) * GELU_K0 * (1.f + 3.f * GELU_K1 * u * u);
}

// mode 0: bias add, 1: bias + GELU (b may be null: no bias)
extern "C" __global__ void bias_act_v8_bf16(const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ b, bf16_t* y,
                                            size_t total8, int c8, int mode) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* bv = reinterpret_cast<const uint4*>(b);
    uint4* yv = reinterpret_cast<uint4*>(y);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        Bf8 xa, ba, out;
        xa.u = xv[q];
        ba.u = bv != nullptr ? bv[q % c8] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(xa.h[i]);
            const float2 fb = __bfloat1622float2(ba.h[i]);
            float u0 = f.x + fb.x, u1 = f.y + fb.y;
            if (mode == 1) {
                u0 = gelu_f(u0);
                u1 = gelu_f(u1);
            }
            out.h[i] = __floats2bfloat162_rn(u0, u1);
        }
        yv[q] = out.u;
    }
}

extern "C" __global__ void bias_gelu_bwd_v8_bf16(const bf16_t* __restrict__ x,
                                                 const bf16_t* __restrict__ b, const bf16_t* dy,
                                                 bf16_t* dx, size_t total8, int c8) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* bv = reinterpret_cast<const uint4*>(b);
    const uint4* dyv = reinterpret_cast<const uint4*>(dy);
    uint4* dxv = reinterpret_cast<uint4*>(dx);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        Bf8 xa, ba, ga, out;
        xa.u = xv[q];
        ba.u = bv != nullptr ? bv[q % c8] : make_uint4(0, 0, 0, 0);
        ga.u = dyv[q];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(xa.h[i]);
            const float2 fb = __bfloat1622float2(ba.h[i]);
            const float2 fg = __bfloat1622float2(ga.h[i]);
            out.h[i] = __floats2bfloat162_rn(fg.x * gelu_grad_f(f.x + fb.x),
                                             fg.y * gelu_grad_f(f.y + fb.y));
        }
        dxv[q] = out.u;
    }
}
