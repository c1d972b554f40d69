// torch binding of small_gemm_bf16.cpp: torch.ops.namazu.small_bmm_bf16(x [B, M, K], w [B, N, K]) -> [B, M, N].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "small_gemm_bf16.h"

namespace {

at::Tensor small_bmm_bf16_op(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(small_gemm_bf16_supported(), "small_bmm_bf16: this CPU has no AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_bmm_bf16: x and w must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_bmm_bf16: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3, "small_bmm_bf16: x must be [B, M, K] and w [B, N, K], got ",
              x.sizes(), " and ", w.sizes());
  const int64_t B = x.size(0), M = x.size(1), K = x.size(2), N = w.size(1);
  TORCH_CHECK(w.size(0) == B && w.size(2) == K, "small_bmm_bf16: w ", w.sizes(), " does not match x ", x.sizes());
  TORCH_CHECK((x.stride(2) == 1 || K == 1) && (w.stride(2) == 1 || K == 1),
              "small_bmm_bf16: the k dimension of x and w must be contiguous, strides ", x.strides(), " and ",
              w.strides());
  at::Tensor y = at::empty({B, M, N}, x.options());
  if (y.numel() == 0) return y;
  if (K == 0) return y.zero_();
  SmallGemmArgs a{};
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  a.w = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  a.batch = B, a.m = M, a.n = N, a.k = K;
  a.x_row = x.stride(1), a.x_batch = x.stride(0), a.w_row = w.stride(1), a.w_batch = w.stride(0);
  a.y_row = N, a.y_batch = M * N;
  // A thread's share is at least ~64K multiply-adds: below that the fork costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, B * N, grain, [&](int64_t begin, int64_t end) { small_gemm_bf16_range(&a, begin, end); });
  return y;
}

int64_t small_gemm_bf16_supported_op() { return small_gemm_bf16_supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(namazu, m) {
  m.def("small_bmm_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("small_gemm_bf16_supported() -> int", &small_gemm_bf16_supported_op);
}

TORCH_LIBRARY_IMPL(namazu, CPU, m) { m.impl("small_bmm_bf16", &small_bmm_bf16_op); }
