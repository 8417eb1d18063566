// Included by ../kernels.cu (one translation unit: the helpers it defines first are used here);
// launched from the module of the same name beside this file.
#pragma once

// Dropout masks from a counter-based RNG: Philox4x32-10 (Salmon et al., SC'11), keyed by the
// micro-batch's 64-bit seed; the counter names the element, so a mask is a pure function of
// (seed, site, element) — a replayed step draws the same one, on any device, in any order.
// src/engine/dropout.rs is the same arithmetic on the host (the CPU path and the tests).
// Each call gives 128 bits = eight 16-bit uniforms u; an element is kept iff u >= thr, where
// thr = round(p·65536), and a kept value is scaled by 65536 / (65536 − thr).
//   rows [rows, cols] (embedding and residual dropout): element (r, c) ↦ counter
//     (r lo, r hi, c / 8, site), uniform (c mod 8) — eight adjacent columns per call.
//   attention probabilities [B·H·T, T]: element (query row r, key j) with j = 64·tile + jj,
//     jj = 8·nt + 2·t4 + e ↦ counter (r lo, r hi, 8·tile + 2·t4 + nt / 4, site), uniform
//     2·(nt mod 4) + e — the layout of flash attention's mma fragments (a thread's 16 keys
//     of a 64-key tile in two calls).
struct Philox4 {
    uint32_t v[4];
};
__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                 uint32_t c3, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int i = 0; i < 10; i++) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    Philox4 r;
    r.v[0] = c0;
    r.v[1] = c1;
    r.v[2] = c2;
    r.v[3] = c3;
    return r;
}
// The 16-bit uniform i (0..7) of a call.
__device__ __forceinline__ uint32_t philox_u16(const Philox4& r, int i) {
    return (r.v[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
}
// Eight kept flags (bit i: uniform i kept) of the rows layout's call for (row, col / 8).
__device__ __forceinline__ uint32_t drop_bits8(unsigned long long seed, uint32_t site,
                                               unsigned long long row, uint32_t col8,
                                               uint32_t thr) {
    const Philox4 r = philox4x32_10((uint32_t)row, (uint32_t)(row >> 32), col8, site,
                                    (uint32_t)seed, (uint32_t)(seed >> 32));
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) bits |= (philox_u16(r, i) >= thr ? 1u : 0u) << i;
    return bits;
}

// The mask (0 or scale) of either layout as f32 [rows, cols] (the per-op path multiplies by it).
extern "C" __global__ void dropout_mask_f32(float* __restrict__ out, int rows, int cols,
                                            unsigned long long seed, uint32_t site, uint32_t thr,
                                            float scale, int attn) {
    const size_t total = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const unsigned long long r = i / cols;
        const uint32_t c = (uint32_t)(i % cols);
        uint32_t ctr2, u;
        if (attn) {
            const uint32_t tile = c >> 6, jj = c & 63, nt = jj >> 3, t4 = (jj >> 1) & 3;
            ctr2 = 8 * tile + 2 * t4 + (nt >> 2);
            u = 2 * (nt & 3) + (jj & 1);
        } else {
            ctr2 = c >> 3;
            u = c & 7;
        }
        const Philox4 p = philox4x32_10((uint32_t)r, (uint32_t)(r >> 32), ctr2, site,
                                        (uint32_t)seed, (uint32_t)(seed >> 32));
        out[i] = philox_u16(p, u) >= thr ? scale : 0.f;
    }
}
