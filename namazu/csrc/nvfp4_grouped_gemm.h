// NVFP4 (W4A16) grouped GEMM for the routed experts on Hopper: C ABI (raw pointers and a stream), so the
// .cu compiles with plain `nvcc -gencode=arch=compute_90a,code=sm_90a -c` and links into any host.
//
// Rows come in the block-padded expert order of namazu.kernels.moe_dispatch.block_dispatch with
// block_m = NVFP4_GEMM_BLOCK_M: padded row p holds (token, slot) pair sorted_pairs[p] (num_pairs marks
// padding), row block b belongs to expert block_expert[b], rows past *total_rows are unused.
//
// gate_up (gate_up = 1): out[p, n] = silu(g) * u, g = A[p] . W[e, n], u = A[p] . W[e, n + n_out],
//   A[p] = x[sorted_pairs[p] / top_k] (bf16 [tokens, k_dim]); out is bf16 [max_rows, n_out]
//   (= the intermediate; padded rows get zeros).
// down (gate_up = 0): out[pair, n] = topk_weights[pair] * (A[p] . W[e, n]) with A = the intermediate
//   (bf16 [max_rows, k_dim]); out is fp32 [num_pairs, n_out]; the caller sums the k rows of a token.
// W is NVFP4: packed uint8 [E, rows, k_dim/2] (low nibble first), e4m3 scales [E, rows, k_dim/16],
// fp32 global scale [E]; products accumulate in fp32 on the tensor cores (mma.sync bf16).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NVFP4_GEMM_BLOCK_M 16   // rows per tile (one mma M tile): decode has few rows per expert
#define NVFP4_GEMM_K_ALIGN 128  // k_dim must be a multiple of this (the K chunk staged per step)

typedef struct Nvfp4GemmArgs {
  const void* a;                  // bf16 activations (see above)
  const int32_t* sorted_pairs;    // [max_rows]
  const int32_t* block_expert;    // [max_rows / NVFP4_GEMM_BLOCK_M]
  const int32_t* total_rows;      // [1], device
  const uint8_t* w_packed;        // [E, rows, k_dim/2]
  const uint8_t* w_scale;         // [E, rows, k_dim/16]
  const float* w_gs;              // [E]
  const float* topk_weights;      // [num_pairs] (down only)
  void* out;
  int64_t max_rows;
  int64_t num_pairs;
  int64_t top_k;
  int64_t k_dim;
  int64_t n_out;                  // output columns (I for gate_up, H for down)
  int gate_up;
} Nvfp4GemmArgs;

// Launches one grouped GEMM on `stream`. Returns cudaSuccess, cudaErrorInvalidValue for bad sizes,
// or the launch error.
int nvfp4_grouped_gemm_sm90(const Nvfp4GemmArgs* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
