"""The types every part of the routed experts shares: layers, quantization and kernels all import this
leaf (it imports nothing from namazu), so none of them has to import another to name a type.

- `PROJS`, `sort_by_expert`: checkpoint projection names and the sync-free sort of (token, slot) pairs.
- `NVFP4MoEWeights`: the one NVFP4 layout of a layer's routed experts (what kernels read, what
  `NvFP4Experts` holds as buffers).
- `MoEBackend`: one routed-experts implementation with its per-format functions (built in kernels/backends).
- `MoERuntime`: what the runner resolved once at start-up (backend, NVFP4 mode) and hands to every
  expert module; no module-level state decides how experts run.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

import torch

PROJS = ("gate_proj", "up_proj", "down_proj")
NVFP4_BLOCK = 16        # elements per NVFP4 block scale (quant/nvfp4.BLOCK)
NVFP4_MODES = ("w4a16", "w4a4")


def check_nvfp4_mode(mode: str) -> str:
    if mode not in NVFP4_MODES:
        raise ValueError(f"NVFP4 mode {mode!r}: expected one of {NVFP4_MODES}")
    return mode


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the N*k (token, slot) pairs by expert, with static shapes and no host sync.

    Returns (order [N*k]: indices into the flattened topk pairs, sorted by expert;
    counts [E]; offsets [E+1] cumulative). Token of pair p is p // k.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add instead of bincount: bincount sizes its output from the data (a device sync on GPU).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, counts, offsets


@dataclass
class NVFP4MoEWeights:
    """The packed weights of all routed experts of one layer (ModelOpt's per-expert tensors stacked).

    `a13_scale` / `a2_scale` are the calibrated activation input scales ([E] fp32), present only for
    W4A4 emulation; W4A16 (Hopper's weight-only path) leaves them None.
    """

    w13_packed: torch.Tensor   # [E, 2I, H/2] uint8, gate rows then up rows, first element in the low nibble
    w13_scale: torch.Tensor    # [E, 2I, H/16] float8_e4m3fn
    w13_gs: torch.Tensor       # [E] fp32 (gate and up share it)
    w2_packed: torch.Tensor    # [E, H, I/2] uint8
    w2_scale: torch.Tensor     # [E, H, I/16] float8_e4m3fn
    w2_gs: torch.Tensor        # [E] fp32
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @staticmethod
    def layout(e: int, h: int, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor, input scales included."""
        if h % NVFP4_BLOCK or i % NVFP4_BLOCK:
            raise ValueError(f"NVFP4 experts need hidden ({h}) and intermediate ({i}) sizes divisible by "
                             f"{NVFP4_BLOCK}")
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        return {"w13_packed": ((e, 2 * i, h // 2), u8), "w13_scale": ((e, 2 * i, h // NVFP4_BLOCK), f8),
                "w13_gs": ((e,), f32), "w2_packed": ((e, h, i // 2), u8),
                "w2_scale": ((e, h, i // NVFP4_BLOCK), f8), "w2_gs": ((e,), f32),
                "a13_scale": ((e,), f32), "a2_scale": ((e,), f32)}

    @classmethod
    def zeros(cls, e: int, h: int, i: int, device: torch.device | str | None = None) -> NVFP4MoEWeights:
        """All tensors allocated (input scales too, zero = uncalibrated), to be filled by a loader."""
        return cls(**{n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in cls.layout(e, h, i).items()})

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                yield f.name, t

    def weight_only(self) -> NVFP4MoEWeights:
        """The same tensors without input scales: W4A16."""
        return replace(self, a13_scale=None, a2_scale=None)

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_packed.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13_packed.shape[1] // 2

    def validate(self) -> None:
        """Checks shapes and dtypes against each other; raises ValueError naming the bad tensor."""
        want = self.layout(self.num_experts, self.hidden_size, self.intermediate_size)
        if (self.a13_scale is None) != (self.a2_scale is None):
            raise ValueError("W4A4 needs both a13_scale and a2_scale (or neither for W4A16)")
        for name, t in self.named_tensors():
            shape, dtype = want[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"NVFP4 expert tensor {name}: got {tuple(t.shape)} {t.dtype}, "
                                 f"expected {shape} {dtype}")

    def packed_bytes_per_expert(self) -> int:
        """Bytes a kernel reads for one touched expert (packed values + block scales + global scales)."""
        total = 0
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            t = getattr(self, name)
            total += t[0].numel() * t.element_size()
        return total + 8


Bf16Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Nvfp4Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, NVFP4MoEWeights], torch.Tensor]


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
    _prepare: Callable[[NVFP4MoEWeights], object] | None = None   # builds a kernel's own layout (cpp)

    def bf16(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
        return self._bf16(x, topk_ids, topk_weights, w13, w2)

    def nvfp4(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              weights: NVFP4MoEWeights) -> torch.Tensor:
        fn = self._w4a16 if weights.a13_scale is None else self._w4a4
        return fn(x, topk_ids, topk_weights, weights)

    def prepare_nvfp4(self, weights: NVFP4MoEWeights) -> None:
        """Builds whatever layout this backend's W4A16 kernel reads from `weights` now (the cpp backend's
        decode layout) rather than at the layer's first call; a no-op for backends without one."""
        if self._prepare is not None:
            self._prepare(weights)

    def describe(self) -> str:
        return f"{self.name} (bf16={self.bf16_impl}, nvfp4 w4a16={self.w4a16_impl}, w4a4={self.w4a4_impl})"


@dataclass(frozen=True)
class MoERuntime:
    """How routed experts run, resolved once (`kernels.backends.resolve_moe_runtime`) and handed to every
    expert module at construction.

    `backend` None means the plain-torch reference (`kernels.moe_dispatch`), on any device: what a module
    built on its own (tests, quantization tools) runs unless it is handed a resolved runtime.
    `nvfp4_mode` is the mode NVFP4 modules start in (`quant.nvfp4_experts.set_mode` switches a built model).
    """

    backend: MoEBackend | None = None
    nvfp4_mode: str = "w4a16"

    def __post_init__(self) -> None:
        check_nvfp4_mode(self.nvfp4_mode)

    def backend_for(self, device: torch.device) -> MoEBackend | None:
        """The backend for tensors on `device`; a backend resolved for another device type is an error."""
        b = self.backend
        if b is not None and b.device_type != device.type:
            raise RuntimeError(f"these experts were handed the MoE backend for {b.device_type} ({b.name}) but "
                               f"run on {device.type}; resolve the runtime for the device the model runs on "
                               f"(load_model(..., device=...))")
        return b
