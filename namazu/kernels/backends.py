"""MoE backend choice: which implementation runs the routed experts, picked once per device type.

Backends (each matches the torch reference in moe_dispatch.py; tests compare them):
  torch   the reference itself (any device; dequantizes only the touched experts)
  cpp     C++ OpenMP kernel, NVFP4 W4A16 and W4A4 (CPU; built by setup.py everywhere)
  triton  fused Triton kernels, BF16 and NVFP4 W4A16 (GPU; on CPU only under TRITON_INTERPRET=1, for tests)
  cuda    NVFP4 grouped GEMM for Hopper from namazu/csrc (GPU; built only where torch has CUDA)

`auto` order: CPU: cpp, torch. GPU: triton, torch; the CUDA extension joins the front of the GPU order
only once it has passed `make gpu-check` on a real GPU (CUDA_EXT_VALIDATED), until then it is opt-in.
Force one with `set_moe_backend(name)`, the NAMAZU_MOE_BACKEND environment variable, or the engine's
`--moe-backend` flag. A format a backend has no kernel for (BF16 on cpp/cuda, W4A4 on triton/cuda) runs
on the torch reference; the start-up log line says so.
"""
from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from namazu.kernels import moe_dispatch

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpp", "triton", "cuda")
ENV_VAR = "NAMAZU_MOE_BACKEND"
# Flip to True in the commit that records a passing `make gpu-check` run in bench/RESULTS.md.
CUDA_EXT_VALIDATED = False

Bf16Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Nvfp4Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, moe_dispatch.NVFP4MoEWeights], torch.Tensor]


@dataclass(frozen=True)
class MoEBackend:
    """The chosen routed-experts implementation for one device type, with its per-format functions.

    `bf16(x, topk_ids, topk_weights, w13, w2)` and `nvfp4(x, topk_ids, topk_weights, weights)` both
    return [N, H] in x's dtype; `nvfp4` runs W4A4 emulation when `weights.a13_scale` is set.
    """

    name: str
    device_type: str
    bf16_impl: str
    w4a16_impl: str
    w4a4_impl: str
    _bf16: Bf16Fn
    _w4a16: Nvfp4Fn
    _w4a4: Nvfp4Fn

    def bf16(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
        return self._bf16(x, topk_ids, topk_weights, w13, w2)

    def nvfp4(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              weights: moe_dispatch.NVFP4MoEWeights) -> torch.Tensor:
        fn = self._w4a16 if weights.a13_scale is None else self._w4a4
        return fn(x, topk_ids, topk_weights, weights)

    def describe(self) -> str:
        return f"{self.name} (bf16={self.bf16_impl}, nvfp4 w4a16={self.w4a16_impl}, w4a4={self.w4a4_impl})"


# ---- the implementations -------------------------------------------------------------------------------

def _cpp_nvfp4(x, topk_ids, topk_weights, w: moe_dispatch.NVFP4MoEWeights) -> torch.Tensor:
    return torch.ops.namazu.nvfp4_moe_cpu(x, topk_ids, topk_weights, w.w13_packed, w.w13_scale, w.w13_gs,
                                          w.w2_packed, w.w2_scale, w.w2_gs, w.a13_scale, w.a2_scale)


def _cuda_nvfp4(x, topk_ids, topk_weights, w: moe_dispatch.NVFP4MoEWeights) -> torch.Tensor:
    from namazu.kernels import cuda_moe
    return cuda_moe.cuda_moe_nvfp4(x, topk_ids, topk_weights, w)


def _triton_bf16(x, topk_ids, topk_weights, w13, w2) -> torch.Tensor:
    from namazu.kernels import triton_moe
    return triton_moe.triton_moe_bf16(x, topk_ids, topk_weights, w13, w2)


def _triton_nvfp4(x, topk_ids, topk_weights, w: moe_dispatch.NVFP4MoEWeights) -> torch.Tensor:
    from namazu.kernels import triton_moe
    return triton_moe.triton_moe_nvfp4(x, topk_ids, topk_weights, w)


def _import_ok(module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
        return True, ""
    except ImportError as exc:
        return False, f"cannot import {module} ({exc})"


def availability(name: str, device_type: str) -> tuple[bool, str]:
    """(usable, reason when not) for backend `name` on `device_type` ("cpu" or "cuda")."""
    if name == "torch":
        return True, ""
    if name == "cpp":
        if device_type != "cpu":
            return False, "the cpp backend runs on the CPU only"
        ok, why = _import_ok("namazu._nvfp4_cpu")
        return ok, why and why + "; build it with `pip install --no-build-isolation -e .` (make install)"
    if name == "triton":
        ok, why = _import_ok("triton")
        if not ok:
            return False, why
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            return False, "Triton runs on the CPU only under TRITON_INTERPRET=1 (tests)"
        return True, ""
    if name == "cuda":
        if device_type != "cuda":
            return False, "the cuda backend needs a CUDA device"
        ok, why = _import_ok("namazu._nvfp4_cuda")
        return ok, why and why + "; it is built by setup.py only where torch has CUDA and nvcc is found"
    raise ValueError(f"unknown MoE backend '{name}'; choose one of auto, {', '.join(BACKENDS)}")


def auto_order(device_type: str) -> tuple[str, ...]:
    if device_type == "cpu":
        return ("cpp", "torch")
    return ("cuda", "triton", "torch") if CUDA_EXT_VALIDATED else ("triton", "torch")


def build_backend(name: str, device_type: str) -> MoEBackend:
    """The backend `name` with torch filling the formats it has no kernel for. Raises if unusable."""
    ok, why = availability(name, device_type)
    if not ok:
        raise RuntimeError(f"MoE backend '{name}' is not usable on {device_type}: {why}")
    ref_bf16, ref_fp4 = moe_dispatch.torch_moe_bf16, moe_dispatch.torch_moe_nvfp4
    if name == "cpp":
        return MoEBackend(name, device_type, "torch", "cpp", "cpp", ref_bf16, _cpp_nvfp4, _cpp_nvfp4)
    if name == "triton":
        return MoEBackend(name, device_type, "triton", "triton", "torch", _triton_bf16, _triton_nvfp4, ref_fp4)
    if name == "cuda":
        return MoEBackend(name, device_type, "torch", "cuda", "torch", ref_bf16, _cuda_nvfp4, ref_fp4)
    return MoEBackend("torch", device_type, "torch", "torch", "torch", ref_bf16, ref_fp4, ref_fp4)


_forced: str | None = None
_chosen: dict[str, MoEBackend] = {}


def set_moe_backend(name: str | None) -> None:
    """Forces a backend ("auto", "torch", "cpp", "triton", "cuda"; None = back to the environment / auto).
    Call before the model's first forward: the choice is made once per device type."""
    global _forced
    if name is not None and name != "auto" and name not in BACKENDS:
        raise ValueError(f"unknown MoE backend '{name}'; choose one of auto, {', '.join(BACKENDS)}")
    _forced = name
    _chosen.clear()


def get_moe_backend(device: torch.device | str | None = None) -> MoEBackend:
    """The backend for `device` (default CPU), chosen on first use and logged; later calls reuse it."""
    device_type = torch.device(device).type if device is not None else "cpu"
    backend = _chosen.get(device_type)
    if backend is not None:
        return backend
    requested = _forced or os.environ.get(ENV_VAR, "auto") or "auto"
    if requested == "auto":
        skipped = []
        for name in auto_order(device_type):
            ok, why = availability(name, device_type)
            if ok:
                backend = build_backend(name, device_type)
                break
            skipped.append(f"{name}: {why}")
        assert backend is not None  # torch is always available
        note = f"; skipped {'; '.join(skipped)}" if skipped else ""
        logger.info("MoE backend on %s: %s, auto%s", device_type, backend.describe(), note)
    else:
        backend = build_backend(requested, device_type)
        logger.info("MoE backend on %s: %s, forced", device_type, backend.describe())
    _chosen[device_type] = backend
    return backend
