"""BF16 experts hand inference to a kernel backend that has a BF16 kernel (Triton), unchanged results."""
from __future__ import annotations

import pytest
import torch

from namazu.kernels import backends
from namazu.layers.experts import TorchExperts


def test_bf16_experts_route_through_triton_backend(monkeypatch):
    ok, why = backends.availability("triton", "cpu")
    if not ok:
        pytest.skip(f"Triton interpreter unavailable here: {why}")
    calls = []
    real = backends._triton_bf16
    monkeypatch.setattr(backends, "_triton_bf16", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    experts = TorchExperts(8, 64, 32, dtype=torch.float32, runtime=backends.resolve_moe_runtime("cpu", "triton"))
    experts.reset_parameters(0.1)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    with torch.no_grad():
        ref = experts._forward_grouped_mm(x, ids, w)
        out = experts(x, ids, w)
    assert calls, "the Triton BF16 kernel was not used"
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-3)
