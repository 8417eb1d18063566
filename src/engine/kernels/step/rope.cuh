// Rotary position embedding (RoPE) of the q and k heads, forward and backward.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// RoPE in place on the q and k heads of packed projections [B·T, ld]: the first `nh` heads of
// each row (q's H heads, then k's KV heads, adjacent), row bt at position bt mod t; the two
// halves of each head rotated by pos·inv_freq[j] (the Llama/NeoX layout, as the model's
// tables, with any rope scaling already applied); dir = −1 rotates back (the backward). The
// rotations come from cs [t][hd/2] = (cos, sin) of pos·inv_freq[j], computed in double on the
// host (fast-math sines lose accuracy at arguments of hundreds of radians) and read from L2.
// Four pairs a thread (8-byte accesses) where hd/2 is a multiple of 4, else one.
// Packed rows (starts: each slot's sample start in its row, or null): positions restart at
// each sample. Partial rotary (Phi-3): only the first rd dims of each head turn (their two
// halves, rd/2 apart); the rest pass.
extern "C" __global__ void rope_qkv_bf16(bf16_t* __restrict__ x, int nbt, int t, int nh, int hd,
                                         int ld, const float2* __restrict__ cs, float dir,
                                         const int* __restrict__ starts, int rd) {
    const int half = rd >> 1;
    const int w = (half & 3) == 0 ? 4 : 1;
    const int per = half / w;
    const size_t total = (size_t)nbt * nh * per;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int j = (int)(i % per) * w;
        const size_t row = i / per;  // (bt, head)
        const int hh = (int)(row % nh);
        const size_t bt = row / nh;
        const int pos = (int)(bt % t) - (starts != nullptr ? __ldg(starts + bt) : 0);
        const float2* r = cs + (size_t)pos * half + j;
        bf16_t* xr = x + bt * ld + (size_t)hh * hd + j;
        if (w == 4) {
            uint2 a = *reinterpret_cast<const uint2*>(xr);
            uint2 b = *reinterpret_cast<const uint2*>(xr + half);
            bf16_t* pa = reinterpret_cast<bf16_t*>(&a);
            bf16_t* pb = reinterpret_cast<bf16_t*>(&b);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 q = r[k];
                const float x1 = to_f(pa[k]), x2 = to_f(pb[k]), sn = dir * q.y;
                pa[k] = __float2bfloat16(x1 * q.x - x2 * sn);
                pb[k] = __float2bfloat16(x2 * q.x + x1 * sn);
            }
            *reinterpret_cast<uint2*>(xr) = a;
            *reinterpret_cast<uint2*>(xr + half) = b;
        } else {
            const float2 q = r[0];
            const float x1 = to_f(xr[0]), x2 = to_f(xr[half]), sn = dir * q.y;
            xr[0] = __float2bfloat16(x1 * q.x - x2 * sn);
            xr[half] = __float2bfloat16(x2 * q.x + x1 * sn);
        }
    }
}
