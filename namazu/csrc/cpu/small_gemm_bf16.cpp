// y[b, m, n] = sum_k x[b, m, k] * w[b, n, k] in bf16 with fp32 accumulation, for the few rows of a decode
// or verify step. torch's bf16 matmul on CPU goes through oneDNN, whose kernel runs a 1 x 256 x 128 product in
// about 3 us but whose per-call set-up costs about 30 us more (fp32's MKL call: about 8 us in all); a step of
// namazu-tiny makes ~50 such calls, so in bf16 the set-up alone cost more than the fp32 step's whole matmul
// time. Here a call is a loop: one AVX512_BF16 dot product per 32 k, a horizontal sum per output.
#include "small_gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

#define SMALL_GEMM_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Up to kRows rows of x against output columns [n0, n1) of one batch entry.
constexpr int kRows = 8;

SMALL_GEMM_BF16 void rows_block(const uint16_t* x, int64_t x_row, int rows, const uint16_t* w, int64_t w_row,
                                int64_t k, int64_t n0, int64_t n1, uint16_t* y, int64_t y_row) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (k - full)) - 1);
  __m512bh xs[kRows][8];  // x held in registers / L1 for the common k <= 256
  const bool cached = k <= 256;
  if (cached) {
    for (int m = 0; m < rows; ++m)
      for (int64_t kk = 0, i = 0; kk < k; kk += 32, ++i)
        xs[m][i] = (__m512bh)_mm512_maskz_loadu_epi16(kk + 32 <= k ? ~0u : tail, x + m * x_row + kk);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wn = w + n * w_row;
    __m512 acc[kRows];
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (int i = 0; kk < full; kk += 32, ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + kk);
      for (int m = 0; m < rows; ++m) {
        const __m512bh xv = cached ? xs[m][i] : (__m512bh)_mm512_loadu_si512(x + m * x_row + kk);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
    if (kk < k) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wn + kk);
      for (int m = 0; m < rows; ++m) {
        const __m512bh xv = cached ? xs[m][kk / 32] : (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_row + kk);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
    for (int m = 0; m < rows; ++m) y[m * y_row + n] = to_bf16(_mm512_reduce_add_ps(acc[m]));
  }
}

}  // namespace

extern "C" int small_gemm_bf16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

extern "C" void small_gemm_bf16_range(const SmallGemmArgs* a, int64_t begin, int64_t end) {
  // [begin, end) indexes (batch entry, column) pairs flattened batch-major, so that work splits evenly
  // whether a call is one wide product (lm_head) or several narrow ones (the heads of absorbed attention).
  for (int64_t i = begin; i < end;) {
    const int64_t b = i / a->n, n0 = i % a->n, n1 = std::min<int64_t>(a->n, n0 + (end - i));
    const uint16_t* x = a->x + b * a->x_batch;
    const uint16_t* w = a->w + b * a->w_batch;
    uint16_t* y = a->y + b * a->y_batch;
    for (int64_t m = 0; m < a->m; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, a->m - m));
      rows_block(x + m * a->x_row, a->x_row, rows, w, a->w_row, a->k, n0, n1, y + m * a->y_row, a->y_row);
    }
    i += n1 - n0;
  }
}
