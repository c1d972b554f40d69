// NVFP4 (W4A16) split-K decode kernels for the routed experts on Hopper: C ABI (raw pointers and a
// stream), compiled with plain `nvcc -gencode=arch=compute_90a,code=sm_90a -c` or to a cubin whose
// kernels have C names (loaded by namazu/kernels/cuda_decode.py through cuda-python).
//
// The weights are in the GPU decode layout, prepacked once per layer from ModelOpt's tensors: a matrix
// of `rows` x K becomes uint8 [E, rows/8, K/128, NVFP4_DECODE_TILE_BYTES], one tile per (8 rows, 128 K
// values): bytes 0..511 are the nibbles, row r of the tile at r*64 (its 64 ModelOpt bytes of that K
// range, unchanged), bytes 512..575 the 8 E4M3 block scales of each row (row r at 512 + r*8). One
// warp reads one tile with one 16-byte load per lane plus one 2-byte scale load: lane (g = lane/4,
// t = lane%4) holds row g's values k = 32t .. 32t+31 of the tile and their two scales.
//
// That is not the mma.m16n8k16 fragment order, and it need not be: a dot product does not care how K
// is ordered as long as A and B agree. Lane t of mma step s (0..7) feeds the k slots {2t, 2t+1} with
// the real values 32t + 4s + {0, 1} and {2t+8, 2t+9} with 32t + 4s + {2, 3}, for B (weights) and A
// (activations) alike; so the weight bytes need no shuffle and each lane's A is 64 contiguous bytes.
//
// Rows come in the block-padded expert order of block_dispatch with block_m = NVFP4_DECODE_BLOCK_M
// (sorted_pairs, block_expert, total_rows as in nvfp4_grouped_gemm.h). Row p of A is
// a[sorted_pairs[p] / a_div]: a_div = top_k for gate_up (A = the tokens), 1 for down (A = the
// intermediate, one row per (token, slot) pair).
//
// nvfp4_decode_gemm: grid (ceil(rows / (8 * NT * WARPS)), split, max_rows / 16); CTA (x, y, z) computes
//   rows block z, output columns of its warps' n8 tiles, K chunks [y*C/split, (y+1)*C/split) of C = K/128,
//   and writes fp32 partial[y, pair, n] (no global scale yet) for its real pairs. Each expert's weight
//   tile is read once per 16 rows, i.e. once per step at decode (up to 16 tokens per expert).
// nvfp4_decode_reduce_gate_up: inter[pair, n] = silu(gs * sum_y partial[y, pair, n]) *
//   (gs * sum_y partial[y, pair, n + I]), bf16 [num_pairs, I], gs = w_gs[pair_expert[pair]].
// nvfp4_decode_reduce_down: out[token, n] = sum_slot tw[pair] * gs * sum_y partial[y, pair, n], fp32
//   [num_pairs / top_k, rows], pair = token * top_k + slot.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NVFP4_DECODE_BLOCK_M 16      // rows per expert block (one mma M tile)
#define NVFP4_DECODE_TILE_K 128      // K values per tile; K must be a multiple
#define NVFP4_DECODE_TILE_ROWS 8     // weight rows per tile (one mma N tile)
#define NVFP4_DECODE_TILE_BYTES 576  // 8 x 64 nibble bytes + 8 x 8 scale bytes

typedef struct Nvfp4DecodeArgs {
  const void* a;                // bf16 [*, k_dim]
  const int32_t* sorted_pairs;  // [max_rows]
  const int32_t* block_expert;  // [max_rows / NVFP4_DECODE_BLOCK_M]
  const int32_t* total_rows;    // [1], device
  const uint8_t* w_tiles;       // [E, rows/8, k_dim/128, NVFP4_DECODE_TILE_BYTES]
  float* partial;               // [split, num_pairs, rows]
  int64_t max_rows;
  int64_t num_pairs;
  int64_t a_div;
  int64_t k_dim;
  int64_t rows;                 // weight rows (2I for gate_up, H for down)
  int64_t split;                // K splits (gridDim.y)
} Nvfp4DecodeArgs;

typedef struct Nvfp4DecodeReduceArgs {
  const float* partial;         // [split, num_pairs, rows]
  const float* w_gs;            // [E]
  const int32_t* pair_expert;   // [num_pairs] (topk_ids flattened)
  const float* topk_weights;    // [num_pairs] (down only)
  void* out;                    // gate_up: bf16 [num_pairs, rows/2]; down: fp32 [num_pairs/top_k, rows]
  int64_t num_pairs;
  int64_t top_k;
  int64_t rows;
  int64_t split;
} Nvfp4DecodeReduceArgs;

// The compiled kernels: NT n8 tiles per warp, WARPS warps per CTA, the FP4 expansion by a shared-memory
// table (prmt = 0) or by register byte permutes (prmt = 1). nvfp4_decode_variant_count /
// nvfp4_decode_variant_shape list them (the Python side reads the same list from the cubin's names).
int nvfp4_decode_variant_count(void);
int nvfp4_decode_variant_shape(int variant, int* nt, int* warps, int* prmt);

// Launch one split-K GEMM of `variant`, then its reduction (gate_up = 1: the gate_up reduction into
// reduce->out, else the down one). Returns cudaSuccess, cudaErrorInvalidValue for bad sizes, or the
// launch error.
int nvfp4_decode_moe_sm90(int variant, const Nvfp4DecodeArgs* gemm, const Nvfp4DecodeReduceArgs* reduce,
                          int gate_up, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
