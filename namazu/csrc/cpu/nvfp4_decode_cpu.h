// NVFP4 routed experts on the CPU, decode layout: the W4A16 path the cpp backend serves.
//
// The checkpoint stays ModelOpt's (nvfp4_moe_cpu.h); at load each [rows, K] matrix is prepacked once
// into tiles of 4 rows x 128 K elements, 288 bytes each:
//   bytes [0, 256):   row r (0..3) at r * 64: two 32-byte units, unit u holding K elements u*64..u*64+63
//                     of the tile (four 16-blocks). Byte b of a unit, low nibble: block (b % 16 >= 8),
//                     element (b >= 16) * 8 + b % 8 of that block; high nibble: the same element of block
//                     2 + (b % 16 >= 8). One 32-byte load, a nibble split and a byte shuffle give the four
//                     blocks as 16-bit lanes in natural element order (unpacking against zero).
//   bytes [256, 288): row r, block j (0..7) at 256 + r * 8 + j: the E4M3 block scale with its sign
//                     folded into the codes (a negative scale flips the blocks' code signs), so every
//                     stored scale is non-negative and decodes through the F16C half-to-float converter.
// Tiles are ordered (matrix, 4-row group, K tile): a 4-row group's whole K is one contiguous stream.
// K is padded to a multiple of 128 with zero codes and zero scales. Same size as ModelOpt's layout
// (0.5625 bytes per weight), so the kernel reads what the checkpoint counts.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  NVFP4_TILE_ROWS = 4,
  NVFP4_TILE_K = 128,
  NVFP4_TILE_BYTES = 288,
};

// Status codes beyond nvfp4_moe_cpu.h's (0..3).
enum {
  NVFP4_MOE_NAN_SCALE = 4,  // a block scale is the E4M3 NaN code (a corrupt checkpoint)
};

// Bytes of the decode layout of `num_mats` matrices of [rows, k].
int64_t nvfp4_decode_layout_bytes(int64_t num_mats, int64_t rows, int64_t k);

// ModelOpt packed uint8 [num_mats, rows, k/2] + E4M3 scale bytes [num_mats, rows, k/16] -> the decode
// layout in dst (nvfp4_decode_layout_bytes bytes). rows % 4 == 0, k % 16 == 0.
int nvfp4_prepack_cpu(const uint8_t* packed, const uint8_t* scale, int64_t num_mats, int64_t rows, int64_t k,
                      uint8_t* dst, int num_threads);

typedef struct Nvfp4DecodeArgs {
  int64_t num_tokens;    // N
  int64_t hidden;        // H (multiple of 16)
  int64_t inter;         // I (multiple of 16; 2I rows of w13 are a multiple of 4)
  int64_t num_experts;   // E
  int64_t top_k;         // k
  const float* x;             // [N, H]
  const int64_t* topk_ids;    // [N, k]
  const float* topk_weights;  // [N, k]
  const uint8_t* w13;         // decode layout of [E, 2I, H]
  const float* w13_gs;        // [E]
  const uint8_t* w2;          // decode layout of [E, H, I]
  const float* w2_gs;         // [E]
  float* out;                 // [N, H], fully written
  int num_threads;            // <= 0: OpenMP's default
  int isa;                    // NVFP4_ISA_* (nvfp4_moe_cpu.h): AUTO, SCALAR or AVX2; AVX-512 requests take AVX2
} Nvfp4DecodeArgs;

int nvfp4_moe_cpu_decode(const Nvfp4DecodeArgs* args);

// The path `isa` resolves to for the decode layout: NVFP4_ISA_AVX2 (AVX2 + FMA + F16C) or NVFP4_ISA_SCALAR.
int nvfp4_decode_resolve_isa(int isa);

#ifdef __cplusplus
}
#endif
