"""MoE backend choice: which implementation runs the routed experts, resolved once per model at start-up.

Backends (each matches the torch reference in moe_dispatch.py; tests compare them):
  torch   the reference itself (any device; dequantizes only the touched experts)
  cpp     C++ OpenMP kernels (CPU; built by setup.py everywhere): W4A16 on the decode layout, prepacked once
          per layer (kernels/cpu_decode.py), W4A4 emulation on the ModelOpt tensors
  triton  fused Triton kernels, BF16 and NVFP4 W4A16 (GPU; on CPU only under TRITON_INTERPRET=1, for tests)
  cuda    NVFP4 grouped GEMM for Hopper from namazu/csrc (GPU; built only where torch has CUDA), with the
          Triton kernel for BF16 experts where Triton is installed

`auto` order: CPU: cpp, torch. GPU: cuda, triton, torch (the CUDA extension leads since its GPU tests passed
on an H200 and it ran 1.5x the Triton NVFP4 kernel at decode sizes: CUDA_EXT_VALIDATED, bench/RESULTS.md).
Force one with the engine's `--moe-backend` flag or the NAMAZU_MOE_BACKEND environment variable.
`resolve_moe_runtime` reads both (and the NVFP4 mode: `--nvfp4-mode` / NAMAZU_NVFP4_MODE) once; the
runner hands the result to the model, whose expert modules keep it; there is no process-wide choice.
A format a backend has no kernel for (BF16 on cpp, or on cuda without Triton; W4A4 on triton, and on cuda
except on a Blackwell device whose table checked the sm_100a kernel) runs on the torch reference; the
start-up log line says so.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from namazu.kernels import moe_dispatch
from namazu.kernels.moe_types import MoEBackend, MoERuntime, NVFP4MoEWeights, check_nvfp4_mode

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpp", "triton", "cuda")
ENV_VAR = "NAMAZU_MOE_BACKEND"
MODE_ENV = "NAMAZU_NVFP4_MODE"
# True since the first GPU runs (bench/RESULTS.md, "GPU check"): every CUDA-extension test passed on an H200
# (numerics, idle experts, CUDA-graph capture, no host sync).
CUDA_EXT_VALIDATED = True
# W4A4 on the cuda backend: the Blackwell kernel where a 10.x device's table checked it, else the reference.
W4A4_CUDA = "cuda-sm100-if-checked/torch"

# ---- the implementations -------------------------------------------------------------------------------

def _cpp_w4a16(cache, x, topk_ids, topk_weights, w: NVFP4MoEWeights) -> torch.Tensor:
    from namazu.kernels.cpu_decode import cpu_moe_nvfp4
    return cpu_moe_nvfp4(x, topk_ids, topk_weights, w, cache)


def _cpp_nvfp4(x, topk_ids, topk_weights, w: NVFP4MoEWeights) -> torch.Tensor:
    """The ModelOpt-layout kernel: W4A4 emulation (and W4A16 for A/B benchmarks)."""
    return torch.ops.namazu.nvfp4_moe_cpu(x, topk_ids, topk_weights, w.w13_packed, w.w13_scale, w.w13_gs,
                                          w.w2_packed, w.w2_scale, w.w2_gs, w.a13_scale, w.a2_scale)


def _cuda_nvfp4(cache, x, topk_ids, topk_weights, w: NVFP4MoEWeights) -> torch.Tensor:
    """The split-K decode kernel where this device's recorded table picks a variant that passed its check
    (1-64 tokens; kernels/cuda_decode.py), else the grouped GEMM."""
    from namazu.kernels import cuda_decode, cuda_moe
    variant = cuda_decode.select_decode(x, w)
    if variant is not None:
        return cuda_decode.decode_moe_nvfp4(x, topk_ids, topk_weights, w, variant, cache=cache)
    return cuda_moe.cuda_moe_nvfp4(x, topk_ids, topk_weights, w)


def _cuda_w4a4(x, topk_ids, topk_weights, w: NVFP4MoEWeights) -> torch.Tensor:
    """The Blackwell W4A4 kernel (block-scaled FP4 MMA, kernels/cuda_sm100.py) on a 10.x device whose
    recorded table says it passed its device check there; the torch emulation everywhere else (9.x too)."""
    from namazu.kernels import cuda_decode
    variant = cuda_decode.select_w4a4(x, w)
    if variant is not None:
        from namazu.kernels import cuda_sm100
        return cuda_sm100.sm100_moe_nvfp4(x, topk_ids, topk_weights, w, variant)
    return moe_dispatch.torch_moe_nvfp4(x, topk_ids, topk_weights, w)


def _triton_bf16(x, topk_ids, topk_weights, w13, w2) -> torch.Tensor:
    from namazu.kernels import triton_moe
    return triton_moe.triton_moe_bf16(x, topk_ids, topk_weights, w13, w2)


def _triton_nvfp4(x, topk_ids, topk_weights, w: NVFP4MoEWeights) -> torch.Tensor:
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
        # One prepack cache per backend, i.e. per model: each layer's decode layout is built at its first call.
        from namazu.kernels.cpu_decode import PrepackCache
        cache = PrepackCache()
        return MoEBackend(name, device_type, "torch", "cpp-decode", "cpp", ref_bf16,
                          functools.partial(_cpp_w4a16, cache), _cpp_nvfp4, _prepare=cache.get)
    if name == "triton":
        return MoEBackend(name, device_type, "triton", "triton", "torch", _triton_bf16, _triton_nvfp4, ref_fp4)
    if name == "cuda":
        # NVFP4 kernels only: a BF16 model's experts take the Triton kernel rather than the reference.
        # One decode-layout cache per backend (per model), filled at each layer's first decode-kernel call.
        from namazu.kernels.cuda_decode import DecodePrepackCache
        fp4 = functools.partial(_cuda_nvfp4, DecodePrepackCache())
        if availability("triton", device_type)[0]:
            return MoEBackend(name, device_type, "triton", "cuda", W4A4_CUDA, _triton_bf16, fp4, _cuda_w4a4)
        return MoEBackend(name, device_type, "torch", "cuda", W4A4_CUDA, ref_bf16, fp4, _cuda_w4a4)
    return MoEBackend("torch", device_type, "torch", "torch", "torch", ref_bf16, ref_fp4, ref_fp4)


def select_moe_backend(name: str | None, device: torch.device | str = "cpu") -> MoEBackend:
    """The backend for `device`: `name` ("auto", a backend name, or None = the environment, else auto).
    Logs the choice; raises naming the backend when it is unknown or unusable here."""
    device_type = torch.device(device).type
    requested = name if name not in (None, "auto") else (os.environ.get(ENV_VAR) or "auto")
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"unknown MoE backend '{requested}'; choose one of auto, {', '.join(BACKENDS)}")
    if requested != "auto":
        backend = build_backend(requested, device_type)
        logger.info("MoE backend on %s: %s, forced", device_type, backend.describe())
        return backend
    skipped = []
    for candidate in auto_order(device_type):
        ok, why = availability(candidate, device_type)
        if ok:
            backend = build_backend(candidate, device_type)
            break
        skipped.append(f"{candidate}: {why}")
    note = f"; skipped {'; '.join(skipped)}" if skipped else ""
    logger.info("MoE backend on %s: %s, auto%s", device_type, backend.describe(), note)
    return backend


def resolve_moe_runtime(device: torch.device | str = "cpu", moe_backend: str | None = "auto",
                        nvfp4_mode: str | None = "auto") -> MoERuntime:
    """The routed experts' runtime for a model on `device`, from the engine flags ("auto" or None defer to
    NAMAZU_MOE_BACKEND / NAMAZU_NVFP4_MODE, then to auto / w4a16). Call once per model, before building it."""
    mode = nvfp4_mode if nvfp4_mode not in (None, "auto") else (os.environ.get(MODE_ENV) or "w4a16")
    check_nvfp4_mode(mode)  # before choosing a backend: a bad flag fails first, with its own message
    return MoERuntime(select_moe_backend(moe_backend, device), mode)
