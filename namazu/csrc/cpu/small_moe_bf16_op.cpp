// torch.ops.namazu.small_moe_bf16(x [T, H], topk_ids [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T * k, H]: each
// (token, slot) pair's expert output, silu(gate) * up between the two products, in bf16 with fp32 accumulation,
// for the few tokens of a decode or verify step. The pairs are grouped by expert here, so each expert that got
// a pair is read once whatever its pair count: a 7-row verify of namazu-tiny has 14 pairs over 12 experts,
// and reading an expert per pair (a gather) cost it 1.7x the bytes. The weighted sum over slots stays with the
// caller (in fp32, as every other MoE path computes it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "small_gemm_bf16.h"

namespace {

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Runs `rows` of each group (a contiguous run of `rows_of` rows starting at `first`) against its expert's
// weight, columns split over threads: work item g * n + c is group g's column c.
template <class Fn>
void over_groups(int64_t groups, int64_t n, int64_t rows_k, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, rows_k));
  at::parallel_for(0, groups * n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t g = i / n, c0 = i % n, c1 = std::min<int64_t>(n, c0 + (end - i));
      fn(g, c0, c1);
      i += c1 - c0;
    }
  });
}

at::Tensor small_moe_bf16_op(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& w13,
                             const at::Tensor& w2) {
  TORCH_CHECK(small_gemm_bf16_supported(), "small_moe_bf16: this CPU has no AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && topk_ids.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(),
              "small_moe_bf16: every tensor must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 &&
              w2.scalar_type() == at::kBFloat16, "small_moe_bf16: x, w13 and w2 must be bfloat16");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.dim() == 2 && x.dim() == 2 &&
              topk_ids.size(0) == x.size(0), "small_moe_bf16: x must be [T, H] and topk_ids int64 [T, k], got ",
              x.sizes(), " and ", topk_ids.scalar_type(), " ", topk_ids.sizes());
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1), E = w13.size(0);
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == H && w13.size(1) % 2 == 0, "small_moe_bf16: w13 must be [E, 2I, ", H,
              "], got ", w13.sizes());
  const int64_t I = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "small_moe_bf16: w2 must be [", E, ", ", H, ", ", I, "], got ", w2.sizes());
  TORCH_CHECK(w13.stride(2) == 1 && w2.stride(2) == 1, "small_moe_bf16: weights' last dimension must be contiguous");
  const int64_t P = T * K;
  at::Tensor y = at::empty({P, H}, x.options());
  if (P == 0 || H == 0) return y;
  const at::Tensor xc = x.contiguous(), ids_c = topk_ids.contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();

  // Counting sort of the pairs by expert: order[] lists pair indices expert by expert.
  std::vector<int64_t> count(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "small_moe_bf16: expert id ", ids[p], " at pair ", p, " is outside ",
                E, " experts");
    ++count[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[next[ids[p]]++] = p;
  }
  std::vector<int64_t> expert, first, rows;  // the groups: experts that got pairs
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) expert.push_back(e), first.push_back(count[e]), rows.push_back(count[e + 1] - count[e]);
  const int64_t G = static_cast<int64_t>(expert.size());

  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xs(P * H), h13(P * 2 * I), act(P * I), ys(P * H);
  for (int64_t j = 0; j < P; ++j) std::memcpy(&xs[j * H], xp + (order[j] / K) * H, H * sizeof(uint16_t));

  const auto* w13p = reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>());
  const auto* w2p = reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>());
  over_groups(G, 2 * I, P * H / std::max<int64_t>(1, G), [&](int64_t g, int64_t c0, int64_t c1) {
    small_gemm_bf16_rows(&xs[first[g] * H], H, rows[g], w13p + expert[g] * w13.stride(0), w13.stride(1), H, c0, c1,
                         &h13[first[g] * 2 * I], 2 * I);
  });
  // silu(gate) * up in fp32 from the bf16 products, rounded once (as the compiled graph fuses it).
  for (int64_t j = 0; j < P; ++j)
    for (int64_t i = 0; i < I; ++i) {
      const float g = from_bf16(h13[j * 2 * I + i]), u = from_bf16(h13[j * 2 * I + I + i]);
      act[j * I + i] = small_gemm_to_bf16(g / (1.0f + std::exp(-g)) * u);
    }
  over_groups(G, H, P * I / std::max<int64_t>(1, G), [&](int64_t g, int64_t c0, int64_t c1) {
    small_gemm_bf16_rows(&act[first[g] * I], I, rows[g], w2p + expert[g] * w2.stride(0), w2.stride(1), I, c0, c1,
                         &ys[first[g] * H], H);
  });
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t j = 0; j < P; ++j) std::memcpy(yp + order[j] * H, &ys[j * H], H * sizeof(uint16_t));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(namazu, m) {
  m.def("small_moe_bf16(Tensor x, Tensor topk_ids, Tensor w13, Tensor w2) -> Tensor");
}

TORCH_LIBRARY_IMPL(namazu, CPU, m) { m.impl("small_moe_bf16", &small_moe_bf16_op); }
