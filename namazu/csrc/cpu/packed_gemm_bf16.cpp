// The lm_head's few-row product on a weight packed once for it: torch.ops.namazu.pack_bf16_weight(w [N, K]) ->
// [ceil(N / 16), ceil(K / 2), 32] and torch.ops.namazu.packed_linear_bf16(x [M, K], packed, n) -> [M, n].
//
// small_gemm_bf16.cpp reads w as stored ([N, K], K contiguous): one dot product per output column and row, then
// a horizontal reduction and a scalar rounding per output. For the lm_head (N = 12288 columns, K = 256) those
// per-column steps cost as much as the products: 0.40 ms for 7 rows, 0.15 ms for one, one thread. Packed, 16
// columns' weights for two k at a time fill one vector (entry 2c + e: column c, k = 2p + e), so
// VDPBF16PS against a broadcast pair of one row's x accumulates 16 columns at once, with no reduction; the
// rounding is vectorised. Each row is accumulated over k in the same order whatever the row count, so a row's
// logits do not depend on how many rows share the call (a verify row equals the plain step's row, bit for bit).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "small_gemm_bf16.h"

namespace {

#define PACKED_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kCols = 16;   // columns per packed block
constexpr int kMaxRows = 8;

// fp32 -> bf16, round to nearest even, NaN kept quiet: small_gemm_to_bf16 on 16 lanes.
PACKED_BF16 inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// R rows against packed column blocks [b0, b1), NB blocks at a time (R * NB accumulators in registers).
template <int R, int NB>
PACKED_BF16 void packed_rows(const uint16_t* x, int64_t x_row, const uint16_t* p, int64_t kp, int64_t n,
                             int64_t b0, int64_t b1, uint16_t* y, int64_t y_row) {
  for (int64_t b = b0; b < b1; b += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, b1 - b));
    __m512 acc[R][NB];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* pb = p + b * kp * 2 * kCols;
    for (int64_t i = 0; i < kp; ++i) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = (__m512bh)(j < nb ? _mm512_loadu_si512(pb + (j * kp + i) * 2 * kCols) : _mm512_setzero_si512());
      for (int m = 0; m < R; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * x_row + 2 * i, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < nb; ++j) {
      const int64_t c0 = (b + j) * kCols;
      const __mmask16 keep = static_cast<__mmask16>(n - c0 >= kCols ? 0xffff : (1u << (n - c0)) - 1);
      for (int m = 0; m < R; ++m) _mm256_mask_storeu_epi16(y + m * y_row + c0, keep, to_bf16(acc[m][j]));
    }
  }
}

template <int R>
void rows_r(const uint16_t* x, int64_t x_row, const uint16_t* p, int64_t kp, int64_t n, int64_t b0, int64_t b1,
            uint16_t* y, int64_t y_row) {
  // Up to 4 rows: 4 blocks (16 accumulators); more: 3 blocks (up to 24), leaving registers for the weights.
  if constexpr (R <= 4) packed_rows<R, 4>(x, x_row, p, kp, n, b0, b1, y, y_row);
  else packed_rows<R, 3>(x, x_row, p, kp, n, b0, b1, y, y_row);
}

using RowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*,
                        int64_t);
constexpr RowsFn kRowsFn[kMaxRows + 1] = {nullptr,   rows_r<1>, rows_r<2>, rows_r<3>, rows_r<4>,
                                          rows_r<5>, rows_r<6>, rows_r<7>, rows_r<8>};

void check_cpu_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(small_gemm_bf16_supported(), what, ": this CPU has no AVX512_BF16");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, what, ": a bfloat16 CPU tensor is needed, got ",
              t.scalar_type(), " on ", t.device());
}

at::Tensor pack_bf16_weight_op(const at::Tensor& w) {
  check_cpu_bf16(w, "pack_bf16_weight");
  TORCH_CHECK(w.dim() == 2, "pack_bf16_weight: w must be [N, K], got ", w.sizes());
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), blocks = (n + kCols - 1) / kCols, kp = (k + 1) / 2;
  at::Tensor packed = at::zeros({blocks, kp, 2 * kCols}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < kCols && b * kCols + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(b * kp + kk / 2) * 2 * kCols + 2 * c + kk % 2] = src[(b * kCols + c) * k + kk];
  });
  return packed;
}

at::Tensor packed_linear_bf16_op(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_cpu_bf16(x, "packed_linear_bf16");
  check_cpu_bf16(packed, "packed_linear_bf16");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 2 * kCols,
              "packed_linear_bf16: x must be [M, K] and packed [N / 16, K / 2, 32], got ", x.sizes(), " and ",
              packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2 && n > 0 && (n + kCols - 1) / kCols == packed.size(0),
              "packed_linear_bf16: packed ", packed.sizes(), " is not a packed [", n, ", ", k, "] weight");
  TORCH_CHECK(packed.is_contiguous(), "packed_linear_bf16: packed must be contiguous");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  // An odd K reads one bf16 past each row: pad the rows to an even length.
  const at::Tensor xc = k % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t x_row = xc.size(1), blocks = packed.size(0);
  // A thread's share is at least ~64K multiply-adds, as small_bmm_bf16's.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, std::min<int64_t>(m, kMaxRows) * k * kCols));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t r = 0; r < m; r += kMaxRows)
      kRowsFn[std::min<int64_t>(kMaxRows, m - r)](xp + r * x_row, x_row, pp, kp, n, b0, b1, yp + r * n, n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(namazu, m) {
  m.def("pack_bf16_weight(Tensor w) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(namazu, CPU, m) {
  m.impl("pack_bf16_weight", &pack_bf16_weight_op);
  m.impl("packed_linear_bf16", &packed_linear_bf16_op);
}
