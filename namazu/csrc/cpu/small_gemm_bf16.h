// bf16 products of a few rows against a weight stored [N, K] (K contiguous): see small_gemm_bf16.cpp.
#pragma once

#include <cstdint>
#include <cstring>

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet).
inline uint16_t small_gemm_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct SmallGemmArgs {
  const uint16_t* x;   // [batch][m][k], rows x_row apart, entries x_batch apart, k contiguous
  const uint16_t* w;   // [batch][n][k], rows w_row apart, entries w_batch apart, k contiguous
  uint16_t* y;         // [batch][m][n], rows y_row apart, entries y_batch apart, n contiguous
  int64_t batch, m, n, k;
  int64_t x_row, x_batch, w_row, w_batch, y_row, y_batch;
};

extern "C" int small_gemm_bf16_supported(void);
// Computes the outputs (entry, column) in [begin, end) of the batch-major flattening, for every row.
extern "C" void small_gemm_bf16_range(const SmallGemmArgs* args, int64_t begin, int64_t end);
// Rows [0, rows) of x against w's output columns [n0, n1) (one weight matrix, any row count).
extern "C" void small_gemm_bf16_rows(const uint16_t* x, int64_t x_row, int64_t rows, const uint16_t* w,
                                     int64_t w_row, int64_t k, int64_t n0, int64_t n1, uint16_t* y, int64_t y_row);
