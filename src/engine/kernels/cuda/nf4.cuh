// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// NF4 (4-bit NormalFloat, QLoRA's data type) for a frozen LoRA base; src/engine/kernels/nf4.rs
// holds the host reference of the same arithmetic. A weight of n elements (row-major, n % 64 == 0):
//   codes  u8 [n/2]     element 2i in the low nibble of byte i, 2i+1 in the high one
//   absq   u8 [n/64]    each 64-element block's absmax, quantized per group of 256 blocks
//   gscale f32 [ceil(n/64/256)]   absmax = absq · gscale (absq rounded up: |w| / absmax <= 1)
// w ≈ NF4[code] · absmax of its block.
__constant__ float NF4_VALUES[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// The code nearest to x in [-1, 1] (ties to the lower code), by the midpoints of the table.
__device__ __forceinline__ uint32_t nf4_code(float x) {
    uint32_t c = 0;
#pragma unroll
    for (int i = 0; i < 15; ++i) c += x > 0.5f * (NF4_VALUES[i] + NF4_VALUES[i + 1]) ? 1u : 0u;
    return c;
}

// 1. Each 64-element block's absmax (fp32 scratch [n/64]): one warp per block, 2 elements a lane.
extern "C" __global__ void nf4_absmax_bf16(const bf16_t* __restrict__ w, float* __restrict__ amax,
                                           long long blocks) {
    const long long blk = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (blk >= blocks) return;
    const __nv_bfloat162 v = reinterpret_cast<const __nv_bfloat162*>(w + blk * 64)[lane];
    const float2 f = __bfloat1622float2(v);
    const float m = warp_max(fmaxf(fabsf(f.x), fabsf(f.y)));
    if (lane == 0) amax[blk] = m;
}

// 2. Per group of 256 blocks: gscale = max absmax / 255, absq = ceil(absmax / gscale). One warp
// per group.
extern "C" __global__ void nf4_group_f32(const float* __restrict__ amax, uint8_t* __restrict__ absq,
                                         float* __restrict__ gscale, long long blocks) {
    const long long grp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const long long b0 = grp * 256;
    if (b0 >= blocks) return;
    float m = 0.f;
    for (int i = lane; i < 256; i += 32)
        if (b0 + i < blocks) m = fmaxf(m, amax[b0 + i]);
    m = warp_max(m);
    const float sc = m / 255.f;
    if (lane == 0) gscale[grp] = sc;
    for (int i = lane; i < 256; i += 32)
        if (b0 + i < blocks) {
            const float q = sc > 0.f ? ceilf(amax[b0 + i] / sc) : 0.f;
            absq[b0 + i] = (uint8_t)fminf(q, 255.f);
        }
}

// 3. The codes: one thread per 8 elements (4 code bytes).
extern "C" __global__ void nf4_codes_bf16(const bf16_t* __restrict__ w,
                                          const uint8_t* __restrict__ absq,
                                          const float* __restrict__ gscale,
                                          uint32_t* __restrict__ codes, long long n8) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const long long blk = i >> 3;
    const float am = (float)absq[blk] * gscale[blk >> 8];
    const float inv = am > 0.f ? 1.f / am : 0.f;
    const uint4 raw = reinterpret_cast<const uint4*>(w)[i];
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
    uint32_t out = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(p[k]);
        const uint32_t lo = nf4_code(fminf(fmaxf(f.x * inv, -1.f), 1.f));
        const uint32_t hi = nf4_code(fminf(fmaxf(f.y * inv, -1.f), 1.f));
        out |= (lo | (hi << 4)) << (8 * k);
    }
    codes[i] = out;
}

// Dequantize to bf16: one thread per 8 elements (4 code bytes -> one 16-byte store).
extern "C" __global__ void nf4_dequant_bf16(const uint32_t* __restrict__ codes,
                                            const uint8_t* __restrict__ absq,
                                            const float* __restrict__ gscale,
                                            bf16_t* __restrict__ out, long long n8) {
    // The table in shared memory: lanes index it with different codes (the constant cache
    // would serialise them).
    __shared__ float tab[16];
    if (threadIdx.x < 16) tab[threadIdx.x] = NF4_VALUES[threadIdx.x];
    __syncthreads();
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const long long blk = i >> 3;
    const float am = (float)__ldg(absq + blk) * __ldg(gscale + (blk >> 8));
    const uint32_t c = __ldg(codes + i);
    uint4 raw;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint32_t byte = (c >> (8 * k)) & 0xffu;
        p[k] = __floats2bfloat162_rn(tab[byte & 15u] * am, tab[byte >> 4] * am);
    }
    reinterpret_cast<uint4*>(out)[i] = raw;
}
