"""The CPU decode layout of NVFP4 experts: prepacked once per layer, read by the cpp backend's W4A16 kernel.

The checkpoint (and `NVFP4MoEWeights`, what every other path reads) stays ModelOpt's. The C++ kernel
(`namazu/csrc/cpu/nvfp4_decode_cpu.h` spells the layout out) wants each matrix as tiles of 4 rows x 128
K elements, nibbles and that tile's block scales side by side, so `prepack` rewrites w13 and w2 once;
the global scales are read from the ModelOpt tensors on every call (they are [E] scalars).

`PrepackCache` keeps one decode layout per layer, keyed by the ModelOpt tensors it came from: the
first call of a layer (the engine's warm-up step at start-up) prepacks it, later calls reuse it. An
in-place write to those tensors (a loader filling the buffers, `copy_` in tests) bumps their version
counters, which invalidates the entry; freeing them drops it.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from namazu.kernels.moe_types import NVFP4MoEWeights

logger = logging.getLogger(__name__)

TILE_ROWS, TILE_K, TILE_BYTES = 4, 128, 288   # nvfp4_decode_cpu.h


@dataclass(frozen=True)
class CpuDecodeWeights:
    """A layer's routed experts in the decode layout (uint8 [E, rows/4, ceil(K/128), 288] per matrix)."""

    w13: torch.Tensor   # from w13_packed / w13_scale: [E, 2I/4, ceil(H/128), 288]
    w2: torch.Tensor    # from w2_packed / w2_scale:   [E, H/4, ceil(I/128), 288]

    def nbytes(self) -> int:
        return self.w13.numel() + self.w2.numel()


def prepack(w: NVFP4MoEWeights) -> CpuDecodeWeights:
    """ModelOpt tensors -> the decode layout (C++, OpenMP). Raises naming the tensor when a block scale is
    the E4M3 NaN code."""
    out = []
    for name in ("w13", "w2"):
        try:
            out.append(torch.ops.namazu.nvfp4_prepack_cpu(getattr(w, f"{name}_packed"), getattr(w, f"{name}_scale")))
        except RuntimeError as exc:
            raise ValueError(f"NVFP4 experts: cannot prepack {name} for the CPU kernel: {exc}") from exc
    return CpuDecodeWeights(*out)


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    try:
        version = t._version
    except RuntimeError:   # an inference-mode tensor has no version counter: in-place writes go unseen
        version = -1
    return t.data_ptr(), version


@dataclass
class _Entry:
    ref: weakref.ref
    stamp: tuple
    packed: CpuDecodeWeights


class PrepackCache:
    """One decode layout per layer's ModelOpt tensors (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, w: NVFP4MoEWeights) -> CpuDecodeWeights:
        src = (w.w13_packed, w.w13_scale, w.w2_packed, w.w2_scale)
        key, stamp = id(w.w13_packed), tuple(_stamp(t) for t in src)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is w.w13_packed and entry.stamp == stamp:
            return entry.packed
        start = time.perf_counter()
        packed = prepack(w)
        entries = self._entries
        self._entries[key] = _Entry(weakref.ref(w.w13_packed, lambda _r, k=key: entries.pop(k, None)), stamp, packed)
        logger.debug("prepacked %d NVFP4 experts for the CPU decode kernel (%.1f MB) in %.2f s", w.num_experts,
                     packed.nbytes() / 1e6, time.perf_counter() - start)
        return packed


def cpu_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
                  cache: PrepackCache, isa: int = 0) -> torch.Tensor:
    """W4A16 routed experts through the decode-layout kernel; [N, H] in x's dtype."""
    d = cache.get(w)
    return torch.ops.namazu.nvfp4_moe_cpu_decode(x, topk_ids, topk_weights, d.w13, w.w13_gs, d.w2, w.w2_gs, isa)
