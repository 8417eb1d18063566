// The dynamic shared memory (bytes) flash attention's kernels launch with: the one definition.
// flash.cu and flash_sm90.cu use these macros; build.rs turns each `#define` below into a Rust
// constant of the same name (kernels/spec.rs includes them), so the launcher asks for what the
// kernel lays out. Each value is one expression of integers, `*`, `+` and parentheses.
#ifndef COCKPIT_FLASH_SMEM_H
#define COCKPIT_FLASH_SMEM_H

// Forward, head dim 128 (flash.cu): Q, K, V and two buffers as 64 x 128 bf16 tiles (80 KB).
#define FA_FWD_D128_SMEM (5 * 64 * 128 * 2)
// Backward, head dim 128 (flash.cu): sK and sV [64][128], Q/dO [2 buffers][2][64][128], dS^T
// [64][64] (104 KB).
#define FA_BWD_D128_SMEM ((2 * 64 * 128 + 4 * 64 * 128 + 64 * 64) * 2)
// Forward, head dim 256 (flash.cu): Q, K, V and two buffers as 64 x 256 bf16 tiles (160 KB).
#define FA_FWD_D256_SMEM (5 * 64 * 256 * 2)
// Backward, head dim 256 (flash.cu): sK and sV [64][256], Q/dO [2 buffers][2][64][256], dS^T
// [64][64] (200 KB).
#define FA_BWD_D256_SMEM ((2 * 64 * 256 + 4 * 64 * 256 + 64 * 64) * 2)
// Warp-specialized Hopper backward, head dims 64 and 128 (flash_sm90.cu's flash_bwd_ws): twenty
// 64 x 64 bf16 tiles (K and V of 128 keys, two ring slots of a step's Q and dO, two dS^T slots
// of the step's 128 x 128 pairs — at head dim 128 the 64-query steps' 128 x 64), two buffers of
// eight warps' 16 x 64 fp32 dQ staging, each ring slot's lse and delta of 128 queries (fp32),
// and 1 KB to align them (227 KB: all that Hopper gives a block).
#define FA_WS_SMEM (20 * 64 * 64 * 2 + 2 * 8 * 16 * 64 * 4 + 2 * 2 * 128 * 4 + 1024)
// Warp-specialized Hopper forward, head dim 128 (flash_sm90.cu's flash_fwd_ws): the two MMA
// warpgroups' Q (64 x 128 bf16 each), FA_FWS_NS ring stages of K and V (64 x 128 each), the
// stages' barriers (1 KB) and 1 KB to align them (162 KB: one block an SM).
#define FA_FWS_NS 4
#define FA_FWS_D128_SMEM ((2 + 2 * 4) * 64 * 128 * 2 + 2048)

#endif  // COCKPIT_FLASH_SMEM_H
