// The token (and learned position) embedding of the whole-model step.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// out[r, :] = wte[ids[r], :] + wpe[r mod t, :]
extern "C" __global__ void embed_fwd_bf16(const uint32_t* __restrict__ ids,
                                          const bf16_t* __restrict__ wte,
                                          const bf16_t* __restrict__ wpe, bf16_t* __restrict__ out,
                                          int n, int t, int c, int vocab) {
    const size_t total = (size_t)n * c;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / c), j = (int)(i % c);
        const uint32_t id = ids[r];
        float v = id < (uint32_t)vocab ? to_f(wte[(size_t)id * c + j]) : 0.f;
        if (wpe != nullptr) v += to_f(wpe[(size_t)(r % t) * c + j]);
        out[i] = __float2bfloat16(v);
    }
}
