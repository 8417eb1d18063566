// Row-layout dropout (embedding, residual, LoRA input) and plain scaling.
// Part of the whole-model step's kernels: included by ../kernels.cu, which defines the
// helpers (bf16_t, Bf8, warp_sum, row_stats, drop_bits8, ...) used here.
#pragma once

// y = dropout(x), or y += dropout(x) with acc, over bf16 [n, d] (rows layout; d a multiple of
// 8; y may be x; x's and y's rows ldx8·8 and ldy8·8 apart): the embedding's dropout, in the backward the masked copies of the residual
// gradient, LoRA dropout (acc: the adapters' data gradient through their input's mask), and
// with thr = 0 a plain scale (Granite's multipliers). row0: the first row's index in the whole
// rows (a chunk of the MLP's rows draws the masks of its rows).
extern "C" __global__ void dropout_rows_v8_bf16(const bf16_t* x, bf16_t* y, size_t total8, int d8,
                                                const unsigned long long* __restrict__ seed,
                                                uint32_t site, uint32_t thr, float dscale,
                                                int acc, int ldx8, int ldy8, long long row0) {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* yv = reinterpret_cast<uint4*>(y);
    const unsigned long long sd = *seed;
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < total8;
         q += (size_t)gridDim.x * blockDim.x) {
        const size_t row = q / d8, col8 = q % d8;
        const size_t qy = row * ldy8 + col8;
        const uint32_t keep = drop_bits8(sd, site, row0 + row, (uint32_t)col8, thr);
        Bf8 a, b, o;
        a.u = xv[row * ldx8 + col8];
        b.u = acc ? yv[qy] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(a.h[i]), g = __bfloat1622float2(b.h[i]);
            o.h[i] = __floats2bfloat162_rn(g.x + ((keep >> (2 * i)) & 1 ? f.x * dscale : 0.f),
                                           g.y + ((keep >> (2 * i + 1)) & 1 ? f.y * dscale : 0.f));
        }
        yv[qy] = o.u;
    }
}
