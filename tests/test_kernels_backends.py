"""Backend choice: once per device type, logged, forced by name or environment, clear errors."""
from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err, require_cpu_extension

from namazu.kernels import backends
from namazu.kernels import moe_dispatch as md
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.set_moe_backend(None)
    yield
    backends.set_moe_backend(None)


def test_auto_on_cpu_prefers_cpp_and_logs_once(caplog):
    ok, _ = backends.availability("cpp", "cpu")
    with caplog.at_level(logging.INFO, logger="namazu.kernels.backends"):
        first = backends.get_moe_backend("cpu")
        again = backends.get_moe_backend(torch.device("cpu"))
    assert first is again
    assert first.name == ("cpp" if ok else "torch")
    lines = [r.getMessage() for r in caplog.records if "MoE backend" in r.getMessage()]
    assert len(lines) == 1 and "auto" in lines[0]


def test_force_by_name_and_by_environment(monkeypatch):
    backends.set_moe_backend("torch")
    assert backends.get_moe_backend("cpu").name == "torch"
    backends.set_moe_backend(None)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.get_moe_backend("cpu").name == "torch"


def test_unknown_and_unusable_backends_are_errors():
    with pytest.raises(ValueError, match="unknown MoE backend 'fast'"):
        backends.set_moe_backend("fast")
    backends.set_moe_backend("cuda")
    with pytest.raises(RuntimeError, match="'cuda' is not usable on cpu"):
        backends.get_moe_backend("cpu")


def test_cuda_extension_is_opt_in_until_validated():
    assert "cuda" not in backends.auto_order("cuda") or backends.CUDA_EXT_VALIDATED
    assert backends.auto_order("cpu") == ("cpp", "torch")


@pytest.mark.parametrize("name", ["torch", "cpp"])
def test_cpu_backends_match_reference_in_every_format(name):
    if name == "cpp":
        require_cpu_extension()
    backends.set_moe_backend(name)
    b = backends.get_moe_backend("cpu")
    c = make_case(5, 64, 32, 8, 2, seed=60, w4a4=True)
    w4a16 = md.NVFP4MoEWeights(*(getattr(c.nvfp4, f) for f in
                                 ("w13_packed", "w13_scale", "w13_gs", "w2_packed", "w2_scale", "w2_gs")))
    for w in (w4a16, c.nvfp4):
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
    backends.set_moe_backend("torch")
    b = backends.get_moe_backend("cpu")
    c = make_case(7, 64, 32, 6, 2, seed=61, dtype=dtype, w4a4=True)
    w4a16 = md.NVFP4MoEWeights(*(getattr(c.nvfp4, f) for f in
                                 ("w13_packed", "w13_scale", "w13_gs", "w2_packed", "w2_scale", "w2_gs")))
    tol = 1e-5 if dtype == torch.float32 else 4e-3   # summation order, then one bf16 rounding
    assert rel_err(b.bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2), per_token_moe(c)) < tol
    assert rel_err(b.nvfp4(c.x, c.topk_ids, c.topk_weights, w4a16), per_token_moe(c, w4a16)) < tol
    assert rel_err(b.nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4), per_token_moe(c, c.nvfp4)) < tol
