// torch binding of the CPU NVFP4 MoE kernel: registers torch.ops.namazu.nvfp4_moe_cpu.
// Importing the module `namazu._nvfp4_cpu` loads this library, which registers the op.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "nvfp4_decode_cpu.h"
#include "nvfp4_moe_cpu.h"

namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "nvfp4_moe_cpu: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "nvfp4_moe_cpu: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "nvfp4_moe_cpu: ", name, " must have ", dim, " dims, got shape ", t.sizes());
}

at::Tensor nvfp4_moe_cpu_op(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& w13_packed, const at::Tensor& w13_scale, const at::Tensor& w13_gs,
                            const at::Tensor& w2_packed, const at::Tensor& w2_scale, const at::Tensor& w2_gs,
                            const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                            int64_t isa, const std::optional<at::Tensor>& out_buffer) {
  TORCH_CHECK(x.dim() == 2, "nvfp4_moe_cpu: x must be [N, H], got shape ", x.sizes());
  check(topk_ids, "topk_ids", at::kLong, 2);
  check(w13_packed, "w13_packed", at::kByte, 3);
  check(w13_scale, "w13_scale", at::kFloat8_e4m3fn, 3);
  check(w13_gs, "w13_gs", at::kFloat, 1);
  check(w2_packed, "w2_packed", at::kByte, 3);
  check(w2_scale, "w2_scale", at::kFloat8_e4m3fn, 3);
  check(w2_gs, "w2_gs", at::kFloat, 1);
  const int64_t N = x.size(0), H = x.size(1), E = w13_packed.size(0), I = w13_packed.size(1) / 2;
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_ids.size(0) == N && topk_weights.sizes() == topk_ids.sizes(),
              "nvfp4_moe_cpu: topk_ids ", topk_ids.sizes(), " and topk_weights ", topk_weights.sizes(),
              " must both be [N, k] with N = ", N);
  TORCH_CHECK(H % 16 == 0 && I % 16 == 0 && I > 0, "nvfp4_moe_cpu: hidden ", H, " and intermediate ", I,
              " must be positive multiples of 16");
  TORCH_CHECK(w13_packed.sizes() == at::IntArrayRef({E, 2 * I, H / 2}), "nvfp4_moe_cpu: w13_packed ",
              w13_packed.sizes(), " does not match x's hidden size ", H);
  TORCH_CHECK(w13_scale.sizes() == at::IntArrayRef({E, 2 * I, H / 16}), "nvfp4_moe_cpu: w13_scale ",
              w13_scale.sizes(), " must be [E, 2I, H/16]");
  TORCH_CHECK(w2_packed.sizes() == at::IntArrayRef({E, H, I / 2}), "nvfp4_moe_cpu: w2_packed ", w2_packed.sizes(),
              " must be [E, H, I/2]");
  TORCH_CHECK(w2_scale.sizes() == at::IntArrayRef({E, H, I / 16}), "nvfp4_moe_cpu: w2_scale ", w2_scale.sizes(),
              " must be [E, H, I/16]");
  TORCH_CHECK(w13_gs.size(0) == E && w2_gs.size(0) == E, "nvfp4_moe_cpu: global scales must be [E]");
  TORCH_CHECK(a13_scale.has_value() == a2_scale.has_value(),
              "nvfp4_moe_cpu: W4A4 needs both a13_scale and a2_scale");
  at::Tensor a13, a2;
  if (a13_scale.has_value()) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "nvfp4_moe_cpu: W4A4 emulation takes bf16 or fp32 activations, got ", x.scalar_type());
    a13 = a13_scale->to(at::kFloat).contiguous();
    a2 = a2_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(a13.numel() == E && a2.numel() == E, "nvfp4_moe_cpu: input scales must be [E]");
  }

  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor tw = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor w13p = w13_packed.contiguous(), w13s = w13_scale.contiguous(), g13 = w13_gs.contiguous();
  const at::Tensor w2p = w2_packed.contiguous(), w2s = w2_scale.contiguous(), g2 = w2_gs.contiguous();
  at::Tensor out;
  if (out_buffer.has_value()) {  // lets callers reuse a buffer (and tests poison it)
    out = *out_buffer;
    check(out, "out", at::kFloat, 2);
    TORCH_CHECK(out.size(0) == N && out.size(1) == H && out.is_contiguous(),
                "nvfp4_moe_cpu: out must be a contiguous fp32 [", N, ", ", H, "], got ", out.sizes());
  } else {
    out = at::empty({N, H}, xf.options());
  }

  Nvfp4MoeCpuArgs args{};
  args.num_tokens = N;
  args.hidden = H;
  args.inter = I;
  args.num_experts = E;
  args.top_k = k;
  args.x = xf.data_ptr<float>();
  args.topk_ids = ids.data_ptr<int64_t>();
  args.topk_weights = tw.data_ptr<float>();
  args.w13_packed = w13p.data_ptr<uint8_t>();
  args.w13_scale = static_cast<const uint8_t*>(w13s.data_ptr());
  args.w13_gs = g13.data_ptr<float>();
  args.w2_packed = w2p.data_ptr<uint8_t>();
  args.w2_scale = static_cast<const uint8_t*>(w2s.data_ptr());
  args.w2_gs = g2.data_ptr<float>();
  args.a13_scale = a13.defined() ? a13.data_ptr<float>() : nullptr;
  args.a2_scale = a2.defined() ? a2.data_ptr<float>() : nullptr;
  args.out = out.data_ptr<float>();
  args.num_threads = at::get_num_threads();
  args.isa = static_cast<int>(isa);
  args.act_bf16 = x.scalar_type() == at::kBFloat16 ? 1 : 0;
  const int status = nvfp4_moe_cpu(&args);
  TORCH_CHECK(status != NVFP4_MOE_BAD_EXPERT_ID, "nvfp4_moe_cpu: topk_ids holds an expert id outside [0, ", E, ")");
  TORCH_CHECK(status != NVFP4_MOE_OUT_OF_MEMORY, "nvfp4_moe_cpu: out of memory for ", N * k, " token rows");
  TORCH_CHECK(status == NVFP4_MOE_OK, "nvfp4_moe_cpu: failed with status ", status);
  return out.to(x.scalar_type());
}

int64_t nvfp4_moe_cpu_isa_op(int64_t isa) { return nvfp4_moe_cpu_resolve_isa(static_cast<int>(isa)); }

int64_t nvfp4_decode_isa_op(int64_t isa) { return nvfp4_decode_resolve_isa(static_cast<int>(isa)); }

// ModelOpt packed [E, R, K/2] + scales [E, R, K/16] -> decode layout uint8 [E, R/4, ceil(K/128), 288].
at::Tensor nvfp4_prepack_cpu_op(const at::Tensor& packed, const at::Tensor& scale) {
  check(packed, "packed", at::kByte, 3);
  check(scale, "scale", at::kFloat8_e4m3fn, 3);
  const int64_t E = packed.size(0), R = packed.size(1), K = packed.size(2) * 2;
  TORCH_CHECK(R % NVFP4_TILE_ROWS == 0 && K % 16 == 0 && K > 0, "nvfp4_prepack_cpu: rows ", R,
              " must be a multiple of 4 and K ", K, " a positive multiple of 16");
  TORCH_CHECK(scale.sizes() == at::IntArrayRef({E, R, K / 16}), "nvfp4_prepack_cpu: scale ", scale.sizes(),
              " must be [E, R, K/16] = [", E, ", ", R, ", ", K / 16, "] to match packed ", packed.sizes());
  const at::Tensor p = packed.contiguous(), s = scale.contiguous();
  const int64_t nkc = (K + NVFP4_TILE_K - 1) / NVFP4_TILE_K;
  at::Tensor out = at::empty({E, R / NVFP4_TILE_ROWS, nkc, NVFP4_TILE_BYTES}, p.options());
  const int status = nvfp4_prepack_cpu(p.data_ptr<uint8_t>(), static_cast<const uint8_t*>(s.data_ptr()), E, R, K,
                                       out.data_ptr<uint8_t>(), at::get_num_threads());
  TORCH_CHECK(status != NVFP4_MOE_NAN_SCALE, "nvfp4_prepack_cpu: a block scale is the E4M3 NaN code (0x7F/0xFF): "
              "the checkpoint's weight_scale is corrupt");
  TORCH_CHECK(status == NVFP4_MOE_OK, "nvfp4_prepack_cpu: failed with status ", status);
  return out;
}

at::Tensor nvfp4_moe_cpu_decode_op(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                   const at::Tensor& w13, const at::Tensor& w13_gs, const at::Tensor& w2,
                                   const at::Tensor& w2_gs, int64_t isa, const std::optional<at::Tensor>& out_buffer) {
  TORCH_CHECK(x.dim() == 2, "nvfp4_moe_cpu_decode: x must be [N, H], got shape ", x.sizes());
  check(topk_ids, "topk_ids", at::kLong, 2);
  check(w13, "w13", at::kByte, 4);
  check(w2, "w2", at::kByte, 4);
  check(w13_gs, "w13_gs", at::kFloat, 1);
  check(w2_gs, "w2_gs", at::kFloat, 1);
  const int64_t N = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) * NVFP4_TILE_ROWS / 2;
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_ids.size(0) == N && topk_weights.sizes() == topk_ids.sizes(),
              "nvfp4_moe_cpu_decode: topk_ids ", topk_ids.sizes(), " and topk_weights ", topk_weights.sizes(),
              " must both be [N, k] with N = ", N);
  TORCH_CHECK(H % 16 == 0 && H > 0 && I % 16 == 0 && I > 0, "nvfp4_moe_cpu_decode: hidden ", H, " and intermediate ",
              I, " must be positive multiples of 16");
  auto tiles = [](int64_t n) { return (n + NVFP4_TILE_K - 1) / NVFP4_TILE_K; };
  TORCH_CHECK(w13.sizes() == at::IntArrayRef({E, 2 * I / NVFP4_TILE_ROWS, tiles(H), NVFP4_TILE_BYTES}),
              "nvfp4_moe_cpu_decode: w13 ", w13.sizes(), " is not the decode layout of [E, 2I, H] for H = ", H);
  TORCH_CHECK(w2.sizes() == at::IntArrayRef({E, H / NVFP4_TILE_ROWS, tiles(I), NVFP4_TILE_BYTES}),
              "nvfp4_moe_cpu_decode: w2 ", w2.sizes(), " is not the decode layout of [E, H, I] for I = ", I);
  TORCH_CHECK(w13_gs.size(0) == E && w2_gs.size(0) == E, "nvfp4_moe_cpu_decode: global scales must be [E]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor tw = topk_weights.to(at::kFloat).contiguous();
  const at::Tensor w13c = w13.contiguous(), w2c = w2.contiguous(), g13 = w13_gs.contiguous(), g2 = w2_gs.contiguous();
  at::Tensor out;
  if (out_buffer.has_value()) {
    out = *out_buffer;
    check(out, "out", at::kFloat, 2);
    TORCH_CHECK(out.size(0) == N && out.size(1) == H && out.is_contiguous(),
                "nvfp4_moe_cpu_decode: out must be a contiguous fp32 [", N, ", ", H, "], got ", out.sizes());
  } else {
    out = at::empty({N, H}, xf.options());
  }
  Nvfp4DecodeArgs args{};
  args.num_tokens = N;
  args.hidden = H;
  args.inter = I;
  args.num_experts = E;
  args.top_k = k;
  args.x = xf.data_ptr<float>();
  args.topk_ids = ids.data_ptr<int64_t>();
  args.topk_weights = tw.data_ptr<float>();
  args.w13 = w13c.data_ptr<uint8_t>();
  args.w13_gs = g13.data_ptr<float>();
  args.w2 = w2c.data_ptr<uint8_t>();
  args.w2_gs = g2.data_ptr<float>();
  args.out = out.data_ptr<float>();
  args.num_threads = at::get_num_threads();
  args.isa = static_cast<int>(isa);
  const int status = nvfp4_moe_cpu_decode(&args);
  TORCH_CHECK(status != NVFP4_MOE_BAD_EXPERT_ID, "nvfp4_moe_cpu_decode: topk_ids holds an expert id outside [0, ", E,
              ")");
  TORCH_CHECK(status != NVFP4_MOE_OUT_OF_MEMORY, "nvfp4_moe_cpu_decode: out of memory for ", N * k, " token rows");
  TORCH_CHECK(status == NVFP4_MOE_OK, "nvfp4_moe_cpu_decode: failed with status ", status);
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(namazu, m) {
  m.def(
      "nvfp4_moe_cpu(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, Tensor w13_scale, "
      "Tensor w13_gs, Tensor w2_packed, Tensor w2_scale, Tensor w2_gs, Tensor? a13_scale=None, "
      "Tensor? a2_scale=None, int isa=0, Tensor(a!)? out=None) -> Tensor");
  m.def("nvfp4_moe_cpu_isa(int isa=0) -> int", &nvfp4_moe_cpu_isa_op);
  m.def("nvfp4_prepack_cpu(Tensor packed, Tensor scale) -> Tensor");
  m.def(
      "nvfp4_moe_cpu_decode(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_gs, "
      "Tensor w2, Tensor w2_gs, int isa=0, Tensor(a!)? out=None) -> Tensor");
  m.def("nvfp4_decode_isa(int isa=0) -> int", &nvfp4_decode_isa_op);
}

TORCH_LIBRARY_IMPL(namazu, CPU, m) {
  m.impl("nvfp4_moe_cpu", &nvfp4_moe_cpu_op);
  m.impl("nvfp4_prepack_cpu", &nvfp4_prepack_cpu_op);
  m.impl("nvfp4_moe_cpu_decode", &nvfp4_moe_cpu_decode_op);
}

// A Python module with no functions: importing it loads the library and so registers the ops above.
extern "C" PyMODINIT_FUNC PyInit__nvfp4_cpu(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_nvfp4_cpu", "NVFP4 MoE CPU kernel (torch.ops.namazu)",
                            -1, nullptr};
  return PyModule_Create(&def);
}
