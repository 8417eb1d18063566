// The SwiGLU MLP activation, forward and backward.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// SwiGLU over packed gate|up projections gu [n, 2·hid] (gate columns first): h = silu(g)·u,
// [n, hid]; hid a multiple of 8 (16-byte accesses). The backward writes dgu [n, 2·hid]:
// dg = dh·u·σ(g)·(1 + g·(1 − σ(g))), du = dh·silu(g). With `geglu` the gate is the tanh GELU
// (Gemma's GeGLU): h = gelu(g)·u, dg = dh·u·gelu'(g), du = dh·gelu(g).
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }
extern "C" __global__ void swiglu_fwd_v8_bf16(const bf16_t* __restrict__ gu, bf16_t* __restrict__ h,
                                              size_t total8, int hid8, int geglu) {
    const uint4* gv = reinterpret_cast<const uint4*>(gu);
    uint4* hv = reinterpret_cast<uint4*>(h);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / hid8, col = q % hid8;
        Bf8 g, u, out;
        g.u = gv[row * 2 * hid8 + col];
        u.u = gv[row * 2 * hid8 + hid8 + col];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 fg = __bfloat1622float2(g.h[i]), fu = __bfloat1622float2(u.h[i]);
            // the gate's activation rounded to bf16 first, as the per-op model computes it, then
            // the product
            const float a0 = geglu ? gelu_f(fg.x) : fg.x * sigmoid_f(fg.x);
            const float a1 = geglu ? gelu_f(fg.y) : fg.y * sigmoid_f(fg.y);
            const float s0 = __bfloat162float(__float2bfloat16(a0));
            const float s1 = __bfloat162float(__float2bfloat16(a1));
            out.h[i] = __floats2bfloat162_rn(s0 * fu.x, s1 * fu.y);
        }
        hv[q] = out.u;
    }
}
extern "C" __global__ void swiglu_bwd_v8_bf16(const bf16_t* __restrict__ gu,
                                              const bf16_t* __restrict__ dh,
                                              bf16_t* __restrict__ dgu, size_t total8, int hid8,
                                              int geglu) {
    const uint4* gv = reinterpret_cast<const uint4*>(gu);
    const uint4* dv = reinterpret_cast<const uint4*>(dh);
    uint4* ov = reinterpret_cast<uint4*>(dgu);
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / hid8, col = q % hid8;
        Bf8 g, u, d, og, ou;
        g.u = gv[row * 2 * hid8 + col];
        u.u = gv[row * 2 * hid8 + hid8 + col];
        d.u = dv[q];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 fg = __bfloat1622float2(g.h[i]), fu = __bfloat1622float2(u.h[i]);
            const float2 fd = __bfloat1622float2(d.h[i]);
            if (geglu) {
                og.h[i] = __floats2bfloat162_rn(fd.x * fu.x * gelu_grad_f(fg.x),
                                                fd.y * fu.y * gelu_grad_f(fg.y));
                ou.h[i] = __floats2bfloat162_rn(fd.x * gelu_f(fg.x), fd.y * gelu_f(fg.y));
            } else {
                const float sg0 = sigmoid_f(fg.x), sg1 = sigmoid_f(fg.y);
                og.h[i] = __floats2bfloat162_rn(fd.x * fu.x * sg0 * (1.f + fg.x * (1.f - sg0)),
                                                fd.y * fu.y * sg1 * (1.f + fg.y * (1.f - sg1)));
                ou.h[i] = __floats2bfloat162_rn(fd.x * fg.x * sg0, fd.y * fg.y * sg1);
            }
        }
        ov[row * 2 * hid8 + col] = og.u;
        ov[row * 2 * hid8 + hid8 + col] = ou.u;
    }
}
