// y[b, m, n] = sum_k x[b, m, k] * w[b, n, k] in bf16 with fp32 accumulation, for the few rows of a decode
// or verify step. torch's bf16 matmul on CPU goes through oneDNN, whose kernel runs a 1 x 256 x 128 product in
// about 3 us but whose per-call set-up costs about 30 us more (fp32's MKL call: about 8 us in all); a step of
// namazu-tiny makes ~50 such calls, so in bf16 the set-up alone cost more than the fp32 step's whole matmul
// time. Here a call is a loop: one AVX512_BF16 dot product per 32 k and row, the rows' sums reduced together.
#include "small_gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

#define SMALL_GEMM_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Up to kRows rows of x against output columns [n0, n1) of one batch entry.
constexpr int kRows = 8;

// The sums of acc[0, R) into out[0, R): for R > 2 a transposed reduction (about 23 vector ops for eight sums,
// where eight _mm512_reduce_add_ps take about 64, as many as the block's dot products at k = 256).
template <int R>
SMALL_GEMM_BF16 inline void reduce_rows(const __m512* acc, float* out) {
  if constexpr (R <= 2) {
    for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  } else {
    __m512 a[8];
    for (int m = 0; m < 8; ++m) a[m] = m < R ? acc[m] : _mm512_setzero_ps();
    __m512 t[4];  // t[j]'s 128-bit lanes: two partial sums of row 2j, then two of row 2j + 1
    for (int j = 0; j < 4; ++j)
      t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    __m512 u[2];  // u[i]'s lane l: four partial sums of row 4i + l
    for (int i = 0; i < 2; ++i)
      u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    const __m512 v = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    // Lane l of s: element 0 the sum of row l, element 1 of row 4 + l.
    const __m512 s = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    for (int m = 0; m < R; ++m) out[m] = lanes[(m & 3) * 4 + (m >> 2)];
  }
}

// R rows (a compile-time count, so that the accumulators stay in registers).
template <int R>
SMALL_GEMM_BF16 void rows_block(const uint16_t* x, int64_t x_row, const uint16_t* w, int64_t w_row, int64_t k,
                                int64_t n0, int64_t n1, uint16_t* y, int64_t y_row) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (k - full)) - 1);
  __m512bh xs[R][8];  // x held in registers / L1 for the common k <= 256
  const bool cached = k <= 256;
  if (cached) {
    for (int m = 0; m < R; ++m)
      for (int64_t kk = 0, i = 0; kk < k; kk += 32, ++i)
        xs[m][i] = (__m512bh)_mm512_maskz_loadu_epi16(kk + 32 <= k ? ~0u : tail, x + m * x_row + kk);
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wn = w + n * w_row;
    __m512 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (int i = 0; kk < full; kk += 32, ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + kk);
      for (int m = 0; m < R; ++m) {
        const __m512bh xv = cached ? xs[m][i] : (__m512bh)_mm512_loadu_si512(x + m * x_row + kk);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
    if (kk < k) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wn + kk);
      for (int m = 0; m < R; ++m) {
        const __m512bh xv = cached ? xs[m][kk / 32] : (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_row + kk);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
    float sums[R];
    reduce_rows<R>(acc, sums);
    for (int m = 0; m < R; ++m) y[m * y_row + n] = small_gemm_to_bf16(sums[m]);
  }
}

using RowsBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*,
                           int64_t);
constexpr RowsBlock kRowsBlock[kRows + 1] = {nullptr,         rows_block<1>, rows_block<2>, rows_block<3>,
                                             rows_block<4>,   rows_block<5>, rows_block<6>, rows_block<7>,
                                             rows_block<8>};

}  // namespace

extern "C" int small_gemm_bf16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

extern "C" void small_gemm_bf16_rows(const uint16_t* x, int64_t x_row, int64_t rows, const uint16_t* w,
                                     int64_t w_row, int64_t k, int64_t n0, int64_t n1, uint16_t* y, int64_t y_row) {
  for (int64_t m = 0; m < rows; m += kRows)
    kRowsBlock[std::min<int64_t>(kRows, rows - m)](x + m * x_row, x_row, w, w_row, k, n0, n1, y + m * y_row, y_row);
}

extern "C" void small_gemm_bf16_range(const SmallGemmArgs* a, int64_t begin, int64_t end) {
  // [begin, end) indexes (batch entry, column) pairs flattened batch-major, so that work splits evenly
  // whether a call is one wide product (lm_head) or several narrow ones (the heads of absorbed attention).
  for (int64_t i = begin; i < end;) {
    const int64_t b = i / a->n, n0 = i % a->n, n1 = std::min<int64_t>(a->n, n0 + (end - i));
    const uint16_t* x = a->x + b * a->x_batch;
    const uint16_t* w = a->w + b * a->w_batch;
    uint16_t* y = a->y + b * a->y_batch;
    small_gemm_bf16_rows(x, a->x_row, a->m, w, a->w_row, a->k, n0, n1, y, a->y_row);
    i += n1 - n0;
  }
}
