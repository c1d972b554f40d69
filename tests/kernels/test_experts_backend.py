"""BF16 experts hand inference to a kernel backend that has a BF16 kernel (Triton), unchanged results;
the torch path is checked against the layer's definition token by token."""
from __future__ import annotations

import pytest
import torch

from namazu.kernels import backends
from namazu.layers.experts import TorchExperts


def per_token_experts(experts: TorchExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The layer's definition token by token, from its stacked weights (gate rows, then up rows)."""
    i = experts.intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = experts.w13[e] @ x[t]
            out[t] += w[t, j] * (experts.w2[e] @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    return out


def test_bf16_experts_route_through_triton_backend(monkeypatch):
    torch.manual_seed(0)
    torch_experts = TorchExperts(8, 64, 32, dtype=torch.float32, runtime=backends.resolve_moe_runtime("cpu", "torch"))
    torch_experts.reset_parameters(0.1)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    with torch.no_grad():
        ref = per_token_experts(torch_experts, x, ids, w)
        torch.testing.assert_close(torch_experts(x, ids, w), ref, rtol=1e-5, atol=1e-6)
    ok, why = backends.availability("triton", "cpu")
    if not ok:
        pytest.skip(f"Triton interpreter unavailable here: {why}")
    calls = []
    real = backends._triton_bf16
    monkeypatch.setattr(backends, "_triton_bf16", lambda *a: calls.append(1) or real(*a))
    experts = TorchExperts(8, 64, 32, dtype=torch.float32, runtime=backends.resolve_moe_runtime("cpu", "triton"))
    experts.load_state_dict(torch_experts.state_dict())
    with torch.no_grad():
        out = experts(x, ids, w)
    assert calls, "the Triton BF16 kernel was not used"
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-3)
