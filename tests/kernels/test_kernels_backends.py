"""Backend choice: resolved once into a MoERuntime, logged, forced by name or environment, clear errors;
no process-wide state (two runtimes side by side choose independently)."""
from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err, require_cpu_extension

from namazu.kernels import backends
from namazu.kernels import moe_dispatch as md
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv(backends.MODE_ENV, raising=False)


def test_auto_on_cpu_prefers_cpp_and_logs_once(caplog):
    ok, _ = backends.availability("cpp", "cpu")
    with caplog.at_level(logging.INFO, logger="namazu.kernels.backends"):
        runtime = backends.resolve_moe_runtime(torch.device("cpu"))
    assert runtime.backend.name == ("cpp" if ok else "torch") and runtime.nvfp4_mode == "w4a16"
    lines = [r.getMessage() for r in caplog.records if "MoE backend" in r.getMessage()]
    assert len(lines) == 1 and "auto" in lines[0]


def test_force_by_name_and_by_environment(monkeypatch):
    assert backends.resolve_moe_runtime("cpu", "torch").backend.name == "torch"
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    monkeypatch.setenv(backends.MODE_ENV, "w4a4")
    runtime = backends.resolve_moe_runtime("cpu")
    assert runtime.backend.name == "torch" and runtime.nvfp4_mode == "w4a4"
    assert backends.resolve_moe_runtime("cpu", nvfp4_mode="w4a16").nvfp4_mode == "w4a16"  # the flag wins
    # Resolving again is independent: nothing was remembered from the calls above.
    monkeypatch.delenv(backends.ENV_VAR)
    ok, _ = backends.availability("cpp", "cpu")
    assert backends.resolve_moe_runtime("cpu").backend.name == ("cpp" if ok else "torch")


def test_unknown_and_unusable_backends_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown MoE backend 'fast'"):
        backends.resolve_moe_runtime("cpu", "fast")
    with pytest.raises(RuntimeError, match="'cuda' is not usable on cpu"):
        backends.resolve_moe_runtime("cpu", "cuda")
    with pytest.raises(ValueError, match="NVFP4 mode 'w8a8'"):
        backends.resolve_moe_runtime("cpu", nvfp4_mode="w8a8")
    monkeypatch.setenv(backends.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="unknown MoE backend 'fast'"):
        backends.resolve_moe_runtime("cpu")


def test_experts_refuse_a_backend_resolved_for_another_device():
    from namazu.kernels.moe_types import MoERuntime

    runtime = MoERuntime(backends.build_backend("torch", "cuda"))
    with pytest.raises(RuntimeError, match="MoE backend for cuda .* run on cpu"):
        runtime.backend_for(torch.device("cpu"))


def test_auto_orders():
    assert backends.auto_order("cuda") == (("cuda", "triton", "torch") if backends.CUDA_EXT_VALIDATED
                                           else ("triton", "torch"))
    assert backends.auto_order("cpu") == ("cpp", "torch")


def test_cuda_backend_runs_bf16_experts_on_triton_when_it_can(monkeypatch):
    """The CUDA extension has NVFP4 kernels only; leading the GPU order, it must not send a BF16 model's
    experts to the torch reference while the Triton BF16 kernel is there."""
    real = backends.availability
    usable = {"cuda": True, "triton": True}
    monkeypatch.setattr(backends, "availability",
                        lambda name, dev: (usable[name], "") if name in usable else real(name, dev))
    b = backends.build_backend("cuda", "cuda")
    assert (b.bf16_impl, b.w4a16_impl, b.w4a4_impl) == ("triton", "cuda", backends.W4A4_CUDA)
    assert b._bf16 is backends._triton_bf16 and b._w4a16.func is backends._cuda_nvfp4
    assert b._w4a4 is backends._cuda_w4a4
    usable["triton"] = False
    b = backends.build_backend("cuda", "cuda")
    assert (b.bf16_impl, b.w4a16_impl) == ("torch", "cuda")


@pytest.mark.parametrize("name", ["torch", "cpp"])
def test_cpu_backends_match_reference_in_every_format(name):
    if name == "cpp":
        require_cpu_extension()
    b = backends.resolve_moe_runtime("cpu", name).backend
    assert b.name == name
    c = make_case(5, 64, 32, 8, 2, seed=60, w4a4=True)
    for w in (c.nvfp4.weight_only(), c.nvfp4):
        ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)
        assert rel_err(b.nvfp4(c.x, c.topk_ids, c.topk_weights, w), ref) < TOL
    ref = md.torch_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    assert rel_err(b.bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2), ref) < TOL


def per_token_moe(c, w=None) -> torch.Tensor:
    """The routed experts written out token by token and slot by slot, with no dispatch, permutation or
    grouped GEMM: sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x)) in fp32. With NVFP4 weights `w` the
    expert matrices are dequantized (dequantize_weight matches ModelOpt byte for byte); with W4A4 each GEMM
    input is fake-quantized with the expert's input scale and the intermediates are rounded to x's dtype."""
    n, _ = c.x.shape
    inter = c.w2.shape[-1]
    out = torch.zeros(n, c.w2.shape[1])
    for t in range(n):
        for j in range(c.topk_ids.shape[1]):
            e = int(c.topk_ids[t, j])
            a = c.x[t].float()
            if w is None:
                w13, w2 = c.w13[e].float(), c.w2[e].float()
            else:
                w13 = dequantize_weight(w.w13_packed[e], w.w13_scale[e], w.w13_gs[e], torch.float32)
                w2 = dequantize_weight(w.w2_packed[e], w.w2_scale[e], w.w2_gs[e], torch.float32)
            w4a4 = w is not None and w.a13_scale is not None
            if w4a4:
                a = fake_quantize_activation(a[None], w.a13_scale[e])[0]
            h = w13 @ a
            if w4a4:
                h = h.to(c.x.dtype).float()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            if w4a4:
                act = fake_quantize_activation(act.to(c.x.dtype).float()[None], w.a2_scale[e])[0]
            out[t] += float(c.topk_weights[t, j]) * (w2 @ act)
    return out.to(c.x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_matches_a_per_token_loop(dtype):
    """The torch backend is the reference the other backends are held to, so it is checked against an
    implementation that shares none of its dispatch code (comparing it with itself could not fail)."""
    b = backends.resolve_moe_runtime("cpu", "torch").backend
    c = make_case(7, 64, 32, 6, 2, seed=61, dtype=dtype, w4a4=True)
    w4a16 = c.nvfp4.weight_only()
    tol = 1e-5 if dtype == torch.float32 else 4e-3   # summation order, then one bf16 rounding
    assert rel_err(b.bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2), per_token_moe(c)) < tol
    assert rel_err(b.nvfp4(c.x, c.topk_ids, c.topk_weights, w4a16), per_token_moe(c, w4a16)) < tol
    assert rel_err(b.nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4), per_token_moe(c, c.nvfp4)) < tol
