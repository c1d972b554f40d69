"""GPU backends (Triton compiled, the CUDA extension) against the torch reference; run by `make gpu-check`.

Skipped without CUDA. Shapes are small enough to run in seconds but span several tiles, K chunks and
experts, with idle experts and poisoned buffers.
"""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err

from namazu.kernels import moe_dispatch as md

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (these run in `make gpu-check`)", allow_module_level=True)

SIZES = [(1, None), (33, None), (300, None), (40, 5)]  # (tokens, experts receiving tokens)


def case(num_tokens, experts_used, seed, **kw):
    return make_case(num_tokens, 512, 256, 16, 4, seed=seed, experts_used=experts_used, device="cuda", **kw)


def poison(monkeypatch, mod):
    monkeypatch.setattr(mod, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                device=device))


def triton_module():
    pytest.importorskip("triton")
    from namazu.kernels import triton_moe
    return triton_moe


def cuda_module():
    from namazu.kernels import cuda_moe
    try:
        cuda_moe.load_extension()
    except ImportError as exc:
        pytest.skip(f"CUDA extension not built ({exc}); `make gpu-check` builds it first")
    return cuda_moe


@pytest.mark.parametrize("num_tokens,experts_used", SIZES)
def test_triton_bf16(monkeypatch, num_tokens, experts_used):
    tm = triton_module()
    c = case(num_tokens, experts_used, seed=100 + num_tokens)
    poison(monkeypatch, tm)
    out = tm.triton_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    ref = md.torch_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("num_tokens,experts_used", SIZES)
def test_triton_nvfp4(monkeypatch, num_tokens, experts_used):
    tm = triton_module()
    c = case(num_tokens, experts_used, seed=200 + num_tokens)
    poison(monkeypatch, tm)
    out = tm.triton_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("num_tokens,experts_used", SIZES)
def test_cuda_nvfp4(monkeypatch, num_tokens, experts_used):
    cm = cuda_module()
    c = case(num_tokens, experts_used, seed=300 + num_tokens)
    poison(monkeypatch, cm)
    out = cm.cuda_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


def test_cuda_refuses_unaligned_k():
    cm = cuda_module()
    c = make_case(2, 96, 128, 4, 2, seed=400, device="cuda")
    with pytest.raises(ValueError, match="divisible by 128"):
        cm.cuda_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_no_host_sync(backend):
    """The decode loop must not wait on the GPU: the kernels' dispatch and launches never sync."""
    mod = triton_module() if backend == "triton" else cuda_module()
    fn = mod.triton_moe_nvfp4 if backend == "triton" else mod.cuda_moe_nvfp4
    c = case(8, None, seed=500)
    fn(c.x, c.topk_ids, c.topk_weights, c.nvfp4)  # compile / load outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_zero_tokens():
    tm = triton_module()
    c = case(0, None, seed=600)
    assert tm.triton_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4).shape == (0, 512)
