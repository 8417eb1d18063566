// ggml's quantized blocks, kept as a GGUF file stores them, dequantized on the device: a frozen
// LoRA base read from a Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K file (src/engine/kernels/ggml.rs).
// The arithmetic is the host decoder's (src/engine/gguf/quant.rs, kquant.rs), operation for
// operation and in its order, each product and sum rounded on its own (no fused multiply-add):
// the f32 values are bit-equal to the host's before the rounding to the 16-bit type.
//
// The layouts (bytes of one block; d, dmin are little-endian f16):
//   Q4_0 (32 weights, 18 B): d, 16 bytes of nibbles (low: weights 0..16, high: 16..32);
//        x = (q - 8)·d
//   Q4_1 (32, 20 B): d, m, 16 bytes of nibbles; x = q·d + m
//   Q4_K (256, 144 B): d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 of nibbles;
//        x = d·sc·q − dmin·m over sub-blocks of 32
//   Q5_K (256, 176 B): as Q4_K with 32 bytes of fifth bits before the nibbles
//   Q6_K (256, 210 B): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d;
//        x = d·sc·(q − 32) over sub-blocks of 16

#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14

__device__ __forceinline__ float ggml_half(const uint8_t* b) {
    return __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
}

// Sub-block j's (scale, min) of Q4_K/Q5_K's 12 packed bytes.
__device__ __forceinline__ void ggml_scale_min(const uint8_t* s, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        const int k = j - 4;
        *sc = (float)((s[k + 8] & 0x0f) | ((s[k] >> 6) << 4));
        *m = (float)((s[k + 8] >> 4) | ((s[k + 4] >> 6) << 4));
    }
}

// Weights e0..e0+8 of the block at b (e0 a multiple of 8).
__device__ __forceinline__ void ggml_eight(int code, const uint8_t* b, int e0, float* v) {
    switch (code) {
    case GGML_Q4_0: {
        const float d = ggml_half(b);
        const uint8_t* q = b + 2 + (e0 & 15);
        const int shift = e0 >= 16 ? 4 : 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __fmul_rn((float)((int)((q[k] >> shift) & 15) - 8), d);
        break;
    }
    case GGML_Q4_1: {
        const float d = ggml_half(b), m = ggml_half(b + 2);
        const uint8_t* q = b + 4 + (e0 & 15);
        const int shift = e0 >= 16 ? 4 : 0;
#pragma unroll
        for (int k = 0; k < 8; ++k)
            v[k] = __fadd_rn(__fmul_rn((float)((q[k] >> shift) & 15), d), m);
        break;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const bool fifth = code == GGML_Q5_K;
        const float d = ggml_half(b), dmin = ggml_half(b + 2);
        const int j = e0 >> 5, c = e0 >> 6, half = j & 1, l0 = e0 & 31;
        float sc, m;
        ggml_scale_min(b + 4, j, &sc, &m);
        const float ds = __fmul_rn(d, sc), dm = __fmul_rn(dmin, m);
        const uint8_t* qh = b + 16;
        const uint8_t* qs = b + (fifth ? 48 : 16) + 32 * c + l0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            int q = (qs[k] >> (4 * half)) & 15;
            if (fifth) q |= ((qh[l0 + k] >> j) & 1) << 4;
            v[k] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
        }
        break;
    }
    case GGML_Q6_K: {
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
        const float d = ggml_half(b + 208);
        const int hf = e0 >> 7, r = e0 & 127, s = r >> 5, i0 = r & 31;
        const float ds = __fmul_rn(d, (float)scales[e0 >> 4]);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int lo = (ql[64 * hf + 32 * (s & 1) + i0 + k] >> (4 * (s >> 1))) & 15;
            const int hi = (qh[32 * hf + i0 + k] >> (2 * s)) & 3;
            v[k] = __fmul_rn(ds, (float)((lo | (hi << 4)) - 32));
        }
        break;
    }
    default:
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = 0.f;
    }
}

// Dequantize n8·8 weights of `code` (blocks of `block` weights, `bytes` bytes each) to the
// 16-bit type: one thread per 8 weights (one 16-byte store).
extern "C" __global__ void ggml_dequant_bf16(const uint8_t* __restrict__ data,
                                             bf16_t* __restrict__ out, int code, int block,
                                             int bytes, long long n8) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const long long e = i * 8;
    const long long blk = e / block;
    float v[8];
    ggml_eight(code, data + blk * bytes, (int)(e - blk * block), v);
    uint4 raw;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    reinterpret_cast<uint4*>(out)[i] = raw;
}
