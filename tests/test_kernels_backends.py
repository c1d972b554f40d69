"""Backend choice: once per device type, logged, forced by name or environment, clear errors."""
from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err, require_cpu_extension

from namazu.kernels import backends
from namazu.kernels import moe_dispatch as md


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
