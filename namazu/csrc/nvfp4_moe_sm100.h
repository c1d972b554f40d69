// NVFP4 W4A4 grouped GEMM for the routed experts on Blackwell (sm_100a): the native block-scaled FP4
// tensor-core MMA, tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X (E2M1 x E2M1, one
// UE4M3 scale per 16 values along K for both operands, fp32 accumulator in tensor memory).
//
// Plain C (stdint only, no CUDA header): the layout and encoding functions below are the ones the kernel
// calls, and tests compile this header with gcc and compare every function against an independent Python
// reading of the PTX ISA (tests/kernels/test_cuda_sm100.py).
//
// Rows come in block_dispatch's order with block_m = NVFP4_SM100_BM (one MMA M tile per row block).
// Inputs of one GEMM: A already in NVFP4 (nvfp4_sm100_quant_act writes it: codes uint8 [max_rows, K/2],
// low nibble first, E4M3 scales [max_rows, K/16], quantized with the row's expert input scale); W in
// ModelOpt's layout unchanged (uint8 [E, rows, K/2], E4M3 [E, rows, K/16]) since that is already what the
// MMA wants: K-major rows, two E2M1 per byte, one scale per 16 consecutive K values of a row.
// out = alpha[e] * (A . W^T), alpha[e] = input_scale[e] * weight_scale_2[e]; gate_up fuses SiLU-and-mul.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define NVFP4_SM100_BM 128        // MMA M: rows per CTA (cta_group::1, M = 128: row m -> TMEM lane m)
#define NVFP4_SM100_BN 128        // MMA N: weight rows per CTA (gate_up: 64 gate + the matching 64 up)
#define NVFP4_SM100_BK 128        // K values per shared-memory stage (64 bytes a row)
#define NVFP4_SM100_MMA_K 64      // K of one mxf4nvf4 MMA (dense): 32 bytes a row, 4 scales a row
#define NVFP4_SM100_THREADS 128   // 4 warps: warp w owns TMEM lanes 32w..32w+31 (rows 32w..32w+31)
#define NVFP4_SM100_STAGE_BYTES (NVFP4_SM100_BM * NVFP4_SM100_BK / 2)   // 8 KB per operand per stage
#define NVFP4_SM100_TMEM_COLS 256 // accumulator 128 + A/B scales 2 stages x 2 MMAs x 4 columns, rounded up
#define NVFP4_SM100_ACC_COL 0
#define NVFP4_SM100_SFA_COL 128   // + stage*8 + mma*4
#define NVFP4_SM100_SFB_COL 144   // + stage*8 + mma*4
#define NVFP4_SM100_QUANT_THREADS 128

typedef struct Nvfp4Sm100Args {
  const uint8_t* a_codes;         // [max_rows, k_dim/2] E2M1 pairs, low nibble first
  const uint8_t* a_scale;         // [max_rows, k_dim/16] E4M3
  const int32_t* sorted_pairs;    // [max_rows]
  const int32_t* block_expert;    // [max_rows / BM]
  const int32_t* total_rows;      // [1], device
  const uint8_t* w_packed;        // [E, rows, k_dim/2]
  const uint8_t* w_scale;         // [E, rows, k_dim/16]
  const float* alpha;             // [E]: input_scale * weight_scale_2
  const float* topk_weights;      // [num_pairs] (down only)
  void* out;                      // gate_up: bf16 [max_rows, n_out]; down: fp32 [num_pairs, n_out]
  int64_t max_rows;
  int64_t num_pairs;
  int64_t k_dim;
  int64_t n_out;                  // I for gate_up (W has 2I rows), H for down
} Nvfp4Sm100Args;

typedef struct Nvfp4Sm100QuantArgs {
  const void* src;                // bf16 [src rows, k_dim]
  const int32_t* sorted_pairs;    // [max_rows]
  const int32_t* block_expert;    // [max_rows / BM]
  const int32_t* total_rows;      // [1]
  const float* input_scale;       // [E]
  uint8_t* codes;                 // [max_rows, k_dim/2]
  uint8_t* scale;                 // [max_rows, k_dim/16]
  int64_t max_rows;
  int64_t num_pairs;
  int64_t k_dim;
  int64_t a_div;                  // source row of padded row p: sorted_pairs[p] / a_div (gate_up input:
                                  // top_k, rows of x); 0: p itself (down input: the padded intermediate)
} Nvfp4Sm100QuantArgs;

// ---- shared memory: the canonical K-major layout without swizzling ----------------------------------------
// PTX ISA, tcgen05 canonical layouts: K-major, no swizzle is ((8,m),(T,2k)):((1T,SBO),(1,LBO)) in elements,
// T = 128 bits / 4 bits = 32 E2M1 values (16 bytes): core matrices of 8 rows x 16 bytes (rows 16 bytes
// apart), LBO between the two core matrices along K, SBO between 8-row groups. A stage of 128 rows x 64
// bytes is stored group by group: row r, byte b at (r/8)*512 + (b/16)*128 + (r%8)*16 + b%16, so
// LBO = 128, SBO = 512, and MMA j of the stage (bytes 32j..32j+31) starts at j*256.
#define NVFP4_SM100_LBO 128
#define NVFP4_SM100_SBO 512

NVFP4_HD uint32_t nvfp4_sm100_smem_offset(uint32_t row, uint32_t kbyte) {
  return (row >> 3) * NVFP4_SM100_SBO + (kbyte >> 4) * NVFP4_SM100_LBO + (row & 7) * 16 + (kbyte & 15);
}

// Shared memory matrix descriptor (PTX ISA, tcgen05 "Shared memory descriptor"): start address, LBO and SBO
// as (x & 0x3FFFF) >> 4 in bits 0-13, 16-29, 32-45; the fixed 0b001 in bits 46-48; base offset 0 (no
// swizzle pattern); relative LBO mode (bit 52 = 0); swizzle mode 0 (none) in bits 61-63.
NVFP4_HD uint64_t nvfp4_sm100_smem_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 46);
}

// Instruction descriptor for .kind::mxf4nvf4 (PTX ISA, table "Instruction descriptor format for .kind::mxf4
// and .kind::mxf4nvf4"): dense; SFB ID 0 (bits 4-5); atype E2M1 = 1 (bits 7-9), btype E2M1 = 1 (10-11); no
// negation; both K-major (transpose bits 15, 16 = 0); N >> 3 in bits 17-22; scale type UE4M3 = 0 (bit 23);
// M >> 7 in bits 27-28; SFA ID 0 (29-30); K = 64 (bit 31 = 0). scale_vec::4X requires both IDs to be 0.
NVFP4_HD uint32_t nvfp4_sm100_instr_desc(uint32_t m, uint32_t n) {
  return (1u << 7) | (1u << 10) | ((n >> 3) << 17) | ((m >> 7) << 27);
}

// ---- tensor memory ----------------------------------------------------------------------------------------
// A TMEM address is lane << 16 | column. Scale factors for scale_vec::4X (one 32-bit column holds a row's
// 4 UE4M3 scales of one K = 64 MMA, byte j = K block j) in the 32 x 4 arrangement the MMA reads with M = 128
// (and N = 128 for B): row m's word in lane m % 32, column base + m / 32, the same in every one of the four
// 32-lane partitions ("duplicated to all 32 lane partitions", PTX ISA, block scaling). Each warp writes
// its own partition (tcgen05.st 32x32b.x4: thread t writes lane 32w + t, columns base..base+3), so the
// thread of lane t stores the words of rows t, t+32, t+64, t+96 in that order.
NVFP4_HD uint32_t nvfp4_sm100_sf_row(uint32_t lane, uint32_t column) { return (lane & 31) + 32 * column; }

// The other reading (the `_sflane` kernels): one word per lane and MMA, row m in lane m (partition m / 32),
// a single column. Warp w's thread t stores the word of row 32w + t with tcgen05.st 32x32b.x1.
NVFP4_HD uint32_t nvfp4_sm100_sf_lane_row(uint32_t warp, uint32_t lane) { return 32 * warp + lane; }

NVFP4_HD uint32_t nvfp4_sm100_tmem_addr(uint32_t base, uint32_t lane, uint32_t column) {
  return base + (lane << 16) + column;
}

// Scale column of operand A or B for stage s (0/1) and MMA j (0/1) of the stage.
NVFP4_HD uint32_t nvfp4_sm100_sf_col(uint32_t first, uint32_t stage, uint32_t mma) {
  return first + stage * 8 + mma * 4;
}

// MMA column n of a CTA -> weight row: down: n0 + n; gate_up: gate rows n0 .. n0+63 in columns 0-63 and the
// matching up rows n_out + n0 .. in columns 64-127 (so column j and j + 64 meet in the epilogue).
NVFP4_HD int64_t nvfp4_sm100_weight_row(int gate_up, int64_t n0, int64_t n_out, uint32_t n) {
  if (!gate_up) return n0 + n;
  return n < 64 ? n0 + n : n_out + n0 + (n - 64);
}

// Columns of output one CTA produces along n_out: 64 for gate_up (each from a gate and an up row), 128.
NVFP4_HD int64_t nvfp4_sm100_cols_per_cta(int gate_up) { return gate_up ? 64 : 128; }

// E2M1 code of an already-scaled activation value (the quantizer's last step): round to nearest, ties to the
// even code, saturating at 6; the sign from x < 0 (so -0 and NaN give code 0), as
// namazu.quant.nvfp4.e2m1_encode: the index is the number of decision bounds |x| passes, `>=` where the
// upper neighbour is even (0.75, 1.75, 3.5) and `>` where the lower one is (0.25, 1.25, 2.5, 5).
NVFP4_HD uint32_t nvfp4_sm100_e2m1_code(float x) {
  const float a = x < 0.0f ? -x : x;
  const uint32_t idx = (uint32_t)(a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return idx | (x < 0.0f ? 8u : 0u);
}

#ifdef __cplusplus
}
#endif
