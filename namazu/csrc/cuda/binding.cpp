// torch binding of the Hopper NVFP4 grouped GEMM: registers torch.ops.namazu.nvfp4_grouped_gemm_cuda.
// Built by setup.py only where torch has CUDA; importing `namazu._nvfp4_cuda` registers the op.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "../nvfp4_grouped_gemm.h"

namespace {

void check_cuda(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "nvfp4_grouped_gemm_cuda: ", name, " must be on a CUDA device, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "nvfp4_grouped_gemm_cuda: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "nvfp4_grouped_gemm_cuda: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "nvfp4_grouped_gemm_cuda: ", name,
              " must be 16-byte aligned");
}

void nvfp4_grouped_gemm_cuda(const at::Tensor& a, const at::Tensor& sorted_pairs, const at::Tensor& block_expert,
                             const at::Tensor& total_rows, const at::Tensor& w_packed, const at::Tensor& w_scale,
                             const at::Tensor& w_gs, const std::optional<at::Tensor>& topk_weights, at::Tensor& out,
                             int64_t num_pairs, int64_t top_k, bool gate_up) {
  check_cuda(a, "a", at::kBFloat16);
  check_cuda(sorted_pairs, "sorted_pairs", at::kInt);
  check_cuda(block_expert, "block_expert", at::kInt);
  check_cuda(total_rows, "total_rows", at::kInt);
  check_cuda(w_packed, "w_packed", at::kByte);
  check_cuda(w_scale, "w_scale", at::kFloat8_e4m3fn);
  check_cuda(w_gs, "w_gs", at::kFloat);
  check_cuda(out, "out", gate_up ? at::kBFloat16 : at::kFloat);
  TORCH_CHECK(a.dim() == 2 && w_packed.dim() == 3 && w_scale.dim() == 3, "nvfp4_grouped_gemm_cuda: a must be 2-D, "
              "w_packed and w_scale 3-D");
  const int64_t k_dim = a.size(1), rows = w_packed.size(1), n_out = gate_up ? rows / 2 : rows;
  TORCH_CHECK(w_packed.size(2) * 2 == k_dim && w_scale.size(2) * 16 == k_dim && w_scale.size(1) == rows,
              "nvfp4_grouped_gemm_cuda: w_packed ", w_packed.sizes(), " / w_scale ", w_scale.sizes(),
              " do not match K = ", k_dim);
  TORCH_CHECK(k_dim % NVFP4_GEMM_K_ALIGN == 0, "nvfp4_grouped_gemm_cuda: K = ", k_dim, " must be a multiple of ",
              NVFP4_GEMM_K_ALIGN);
  TORCH_CHECK(sorted_pairs.size(0) % NVFP4_GEMM_BLOCK_M == 0 &&
                  block_expert.size(0) * NVFP4_GEMM_BLOCK_M == sorted_pairs.size(0),
              "nvfp4_grouped_gemm_cuda: the dispatch must be padded to blocks of ", NVFP4_GEMM_BLOCK_M, " rows");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == n_out &&
                  out.size(0) == (gate_up ? sorted_pairs.size(0) : num_pairs),
              "nvfp4_grouped_gemm_cuda: out has shape ", out.sizes());
  if (!gate_up) {
    TORCH_CHECK(topk_weights.has_value(), "nvfp4_grouped_gemm_cuda: the down GEMM needs topk_weights");
    check_cuda(*topk_weights, "topk_weights", at::kFloat);
    TORCH_CHECK(topk_weights->numel() == num_pairs, "nvfp4_grouped_gemm_cuda: topk_weights must have ",
                num_pairs, " entries");
  }
  const c10::cuda::CUDAGuard guard(a.device());
  Nvfp4GemmArgs args{};
  args.a = a.data_ptr();
  args.sorted_pairs = sorted_pairs.data_ptr<int32_t>();
  args.block_expert = block_expert.data_ptr<int32_t>();
  args.total_rows = total_rows.data_ptr<int32_t>();
  args.w_packed = w_packed.data_ptr<uint8_t>();
  args.w_scale = static_cast<const uint8_t*>(w_scale.data_ptr());
  args.w_gs = w_gs.data_ptr<float>();
  args.topk_weights = gate_up ? nullptr : topk_weights->data_ptr<float>();
  args.out = out.data_ptr();
  args.max_rows = sorted_pairs.size(0);
  args.num_pairs = num_pairs;
  args.top_k = top_k;
  args.k_dim = k_dim;
  args.n_out = n_out;
  args.gate_up = gate_up ? 1 : 0;
  const int err = nvfp4_grouped_gemm_sm90(&args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "nvfp4_grouped_gemm_cuda: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(namazu, m) {
  m.def(
      "nvfp4_grouped_gemm_cuda(Tensor a, Tensor sorted_pairs, Tensor block_expert, Tensor total_rows, "
      "Tensor w_packed, Tensor w_scale, Tensor w_gs, Tensor? topk_weights, Tensor(a!) out, int num_pairs, "
      "int top_k, bool gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(namazu, CUDA, m) { m.impl("nvfp4_grouped_gemm_cuda", &nvfp4_grouped_gemm_cuda); }

extern "C" PyMODINIT_FUNC PyInit__nvfp4_cuda(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_nvfp4_cuda",
                            "NVFP4 grouped GEMM for Hopper (torch.ops.namazu)", -1, nullptr};
  return PyModule_Create(&def);
}
