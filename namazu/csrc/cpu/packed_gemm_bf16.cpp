// The lm_head's few-row product on a weight packed once for it: torch.ops.namazu.pack_bf16_weight(w [N, K]) ->
// [ceil(N / 64), ceil(K / 2), 128] and torch.ops.namazu.packed_linear_bf16(x [M, K], packed, n) -> [M, n].
//
// small_gemm_bf16.cpp reads w as stored ([N, K], K contiguous): one dot product per output column and row, then
// a horizontal reduction and a scalar rounding per output. For the lm_head (N = 12288 columns, K = 256) those
// per-column steps cost as much as the products: 0.40 ms for 7 rows, 0.15 ms for one, one thread. Packed, 16
// columns' weights for two k at a time fill one vector (entry 2c + e: column c, k = 2p + e), so
// VDPBF16PS against a broadcast pair of one row's x accumulates 16 columns at once, with no reduction; the
// rounding is vectorised. Four such vectors (64 columns) per k pair lie side by side, so a group of columns is
// one sequential stream: with the 16 columns' vectors a whole k-range apart, the four streams of a first layout
// read 15-25% slower than the dot-product block's when the weight came from memory (1 to 4 rows). Each row is
// accumulated over k in the same order whatever the row count, so a row's product does not depend on how many
// rows share the call.
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

constexpr int kCols = 16;    // columns per vector
constexpr int kGroup = 4;    // vectors per k pair in a group: 64 columns, read as one sequential stream
constexpr int kPrefetch = 16; // k pairs ahead (16 x 256 bytes)
constexpr int kRowChunk = 4; // rows per pass over a group (4 x 4 accumulators); later passes find it in L1

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

// R rows against column groups [g0, g1): per group, the k pairs in order, each pair's 4 vectors contiguous.
template <int R>
PACKED_BF16 void packed_rows(const uint16_t* x, int64_t x_row, const uint16_t* p, int64_t kp, int64_t n,
                             int64_t g0, int64_t g1, uint16_t* y, int64_t y_row) {
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R][kGroup];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < kGroup; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* pg = p + g * kp * kGroup * 2 * kCols;
    for (int64_t i = 0; i < kp; ++i) {
      // A few rows consume the stream faster than the hardware prefetcher fetches it from memory: ask ahead.
      if (i + kPrefetch < kp)
        for (int j = 0; j < kGroup; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(pg + ((i + kPrefetch) * kGroup + j) * 2 * kCols), _MM_HINT_T0);
      __m512bh wv[kGroup];
      for (int j = 0; j < kGroup; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(pg + (i * kGroup + j) * 2 * kCols);
      for (int m = 0; m < R; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * x_row + 2 * i, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < kGroup; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < kGroup; ++j) {
      const int64_t c0 = (g * kGroup + j) * kCols;
      if (c0 >= n) break;
      const __mmask16 keep = static_cast<__mmask16>(n - c0 >= kCols ? 0xffff : (1u << (n - c0)) - 1);
      for (int m = 0; m < R; ++m) _mm256_mask_storeu_epi16(y + m * y_row + c0, keep, to_bf16(acc[m][j]));
    }
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*,
                        int64_t);
constexpr RowsFn kRowsFn[kRowChunk + 1] = {nullptr, packed_rows<1>, packed_rows<2>, packed_rows<3>, packed_rows<4>};

void check_cpu_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(small_gemm_bf16_supported(), what, ": this CPU has no AVX512_BF16");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, what, ": a bfloat16 CPU tensor is needed, got ",
              t.scalar_type(), " on ", t.device());
}

at::Tensor pack_bf16_weight_op(const at::Tensor& w) {
  check_cpu_bf16(w, "pack_bf16_weight");
  TORCH_CHECK(w.dim() == 2, "pack_bf16_weight: w must be [N, K], got ", w.sizes());
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), groups = (n + kGroup * kCols - 1) / (kGroup * kCols), kp = (k + 1) / 2;
  at::Tensor packed = at::zeros({groups, kp, kGroup * 2 * kCols}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kGroup * kCols && g * kGroup * kCols + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk)
          dst[(g * kp + kk / 2) * kGroup * 2 * kCols + (c / kCols) * 2 * kCols + 2 * (c % kCols) + kk % 2] =
              src[(g * kGroup * kCols + c) * k + kk];
  });
  return packed;
}

at::Tensor packed_linear_bf16_op(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_cpu_bf16(x, "packed_linear_bf16");
  check_cpu_bf16(packed, "packed_linear_bf16");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kGroup * 2 * kCols,
              "packed_linear_bf16: x must be [M, K] and packed [N / 64, K / 2, 128], got ", x.sizes(), " and ",
              packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2 && n > 0 && (n + kGroup * kCols - 1) / (kGroup * kCols) == packed.size(0),
              "packed_linear_bf16: packed ", packed.sizes(), " is not a packed [", n, ", ", k, "] weight");
  TORCH_CHECK(packed.is_contiguous(), "packed_linear_bf16: packed must be contiguous");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  // An odd K reads one bf16 past each row: pad the rows to an even length.
  const at::Tensor xc = k % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t x_row = xc.size(1), groups = packed.size(0);
  // A thread's share is at least ~64K multiply-adds, as small_bmm_bf16's.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, m * k * kGroup * kCols));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    // Group by group, every row chunk: the group's weights come from memory once, then from L1.
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < m; r += kRowChunk)
        kRowsFn[std::min<int64_t>(kRowChunk, m - r)](xp + r * x_row, x_row, pp, kp, n, g, g + 1, yp + r * n, n);
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
