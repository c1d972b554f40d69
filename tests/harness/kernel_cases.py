"""Shared inputs for the kernel tests: fresh random MoE problems (not fixtures, so GPU checks reuse them)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest
import torch

from namazu.kernels.moe_types import NVFP4MoEWeights
from namazu.quant.nvfp4_experts import quantize_experts

TOL = 1e-2  # acceptance: relative error against the torch reference, in bf16


def host_cc(what: str) -> str:
    """gcc, for the tests that check a CUDA header's host-side rules by compiling `what` for the CPU; a skip
    that says so where the machine has none."""
    return shutil.which("gcc") or pytest.skip(f"no gcc here: {what} are tested by compiling them for the CPU")


@dataclass
class MoECase:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    nvfp4: NVFP4MoEWeights


def make_case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, *, seed: int,
              dtype: torch.dtype = torch.bfloat16, device: str = "cpu", experts_used: int | None = None,
              w4a4: bool = False) -> MoECase:
    """Random experts and routing. `experts_used` restricts routing to the first few experts, so the rest
    get zero tokens (the kernels must skip them and still be right)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    x = torch.randn(num_tokens, hidden, generator=g)
    pool = experts_used or num_experts
    if pool < top_k:
        raise ValueError(f"cannot route to {top_k} distinct experts out of {pool}")
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(num_tokens)]) if num_tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    amax13 = amax2 = None
    if w4a4:
        amax13 = torch.full((num_experts,), float(x.abs().max()) if num_tokens else 1.0)
        amax2 = torch.full((num_experts,), 1.0)
    q = quantize_experts(w13, w2, amax13, amax2)
    q = NVFP4MoEWeights(**{name: t.to(device) for name, t in q.named_tensors()})
    return MoECase(x.to(device, dtype), ids.to(device), weights.to(device), w13.to(device, dtype),
                   w2.to(device, dtype), q)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def require_cpu_extension() -> None:
    """The C++ CPU kernel must be importable: `make test` builds it (setup.py). Only a user who set
    NAMAZU_BUILD_EXT=0 (kernels not built on purpose) gets skips instead of a failure."""
    try:
        import namazu._nvfp4_cpu  # noqa: F401
    except ImportError as exc:
        if os.environ.get("NAMAZU_BUILD_EXT") == "0":
            pytest.skip(f"NAMAZU_BUILD_EXT=0: the C++ CPU extension is not built ({exc})", allow_module_level=True)
        raise ImportError(f"the C++ CPU extension namazu._nvfp4_cpu is not built ({exc}): build it with "
                          "`make install` (pip install --no-build-isolation -e .), or set NAMAZU_BUILD_EXT=0 to "
                          "skip its tests") from exc
