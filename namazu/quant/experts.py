"""NVFP4 routed experts: packed FP4 weights stay resident; each call dequantizes only the experts it touches.

Two execution modes, chosen once (a flag, not per call):

- `w4a16`: Hopper's weight-only path. A touched expert's weights are dequantized to the activation dtype
  and multiplied in that dtype, as a Marlin-style FP4 GEMM does inside the kernel. No BF16 copy of all
  experts ever exists; resident memory is 4.5 bits per weight plus a few scalars per expert.
- `w4a4`: Blackwell numerics, emulated for quality evaluation. Each GEMM input is quantized per 16-block
  with the expert's calibrated `input_scale` (nvfp4.quantize_activation), the products `e2m1 * SF` of
  activations and weights are multiplied in fp32 (exact: both factors have few mantissa bits) and the
  sum is scaled by `alpha = input_scale * weight_scale_2`. GEMM outputs are rounded to the activation
  dtype, as a kernel writes them.

Both modes run on the MoE kernel backend picked at start-up (namazu.kernels.backends); `forward_reference`
is the torch oracle the backends are tested against.

Storage (the layout the NVFP4 kernels consume, ModelOpt's per-expert tensors stacked over experts):
w13_packed uint8 [E, 2I, H/2] (gate rows then up rows), w13_scale e4m3 [E, 2I, H/16], w13_gs fp32 [E]
(gate and up share one weight_scale_2), w2_packed uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16],
w2_gs fp32 [E], a13_scale / a2_scale fp32 [E] (input_scale of gate/up and of down).
"""
from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from namazu.layers.experts import PROJS, RoutedExperts, TorchExperts, register_experts_format, sort_by_expert
from namazu.quant.nvfp4 import (
    BLOCK,
    dequantize_weight,
    fake_quantize_activation,
    global_scale_for,
    input_scale_for,
    quantize_weight,
)

logger = logging.getLogger(__name__)

MODES = ("w4a16", "w4a4")
MODE_ENV = "NAMAZU_NVFP4_MODE"
_default_mode: str | None = None


def set_default_mode(mode: str) -> None:
    """Mode of NVFP4 experts built from now on (the loader builds them through the format registry)."""
    global _default_mode
    _check_mode(mode)
    _default_mode = mode


def default_mode() -> str:
    """set_default_mode's value, else $NAMAZU_NVFP4_MODE, else w4a16 (the Hopper serving path)."""
    mode = _default_mode or os.environ.get(MODE_ENV) or "w4a16"
    _check_mode(mode)
    return mode


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"NVFP4 mode {mode!r}: expected one of {MODES}")


def set_mode(model: torch.nn.Module, mode: str) -> int:
    """Switches every NVFP4 module (experts and linears) in `model` to `mode`; returns how many."""
    _check_mode(mode)
    n = 0
    for m in model.modules():
        if hasattr(m, "nvfp4_mode"):
            m.nvfp4_mode = mode
            n += 1
    return n


class NvFP4Experts(RoutedExperts):
    """Routed experts in NVFP4 (see the module docstring for layout and modes)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, mode: str | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if hidden_size % BLOCK or intermediate_size % BLOCK:
            raise ValueError(f"NVFP4 experts need hidden_size ({hidden_size}) and moe_intermediate_size "
                             f"({intermediate_size}) divisible by {BLOCK}")
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.nvfp4_mode = mode or default_mode()
        _check_mode(self.nvfp4_mode)
        # Both modes run on the MoE kernel backend; False keeps them on this module's torch reference.
        self.use_kernels = True
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        self.register_buffer("w13_packed", torch.zeros(e, 2 * i, h // 2, dtype=u8, device=device))
        self.register_buffer("w13_scale", torch.zeros(e, 2 * i, h // BLOCK, dtype=f8, device=device))
        self.register_buffer("w13_gs", torch.zeros(e, dtype=f32, device=device))
        self.register_buffer("w2_packed", torch.zeros(e, h, i // 2, dtype=u8, device=device))
        self.register_buffer("w2_scale", torch.zeros(e, h, i // BLOCK, dtype=f8, device=device))
        self.register_buffer("w2_gs", torch.zeros(e, dtype=f32, device=device))
        self.register_buffer("a13_scale", torch.zeros(e, dtype=f32, device=device))
        self.register_buffer("a2_scale", torch.zeros(e, dtype=f32, device=device))
        # gate and up each carry weight_scale_2 / input_scale in a checkpoint; remember the first to check
        # the second against it.
        self._w13_seen: dict[tuple[int, str], str] = {}

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not touch the packed codes or the fp32 scales (fp8 and fp32 count as
        # floating point to torch): only the device moves; activations bring their own dtype.
        probe = fn(torch.zeros((), device=self.w13_gs.device))
        for name, buf in list(self._buffers.items()):
            if buf is not None:
                self._buffers[name] = buf.to(probe.device)
        return self

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, inter={self.intermediate_size}, "
                f"mode={self.nvfp4_mode}")

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_experts(cls, src: RoutedExperts, a13_amax: torch.Tensor | None = None,
                     a2_amax: torch.Tensor | None = None, mode: str | None = None,
                     name: str = "experts", scale_search: bool = False) -> NvFP4Experts:
        """Quantizes high-precision experts (any RoutedExperts yielding `weight`s). gate and up share
        weight_scale_2 = the max of their own.

        a13_amax / a2_amax [E] are calibrated input amaxes (gate/up input, down input); without them the
        input scales stay 0 and only W4A16 can run (W4A4 and saving refuse such experts). `scale_search`:
        see nvfp4.quantize_weight.
        """
        e_count, h, i = src.num_experts, src.hidden_size, src.intermediate_size
        w = {(e, proj): t for e, proj, param, t in src.expert_params() if param == "weight"}
        out = cls(e_count, h, i, mode=mode, device=next(iter(w.values())).device)
        for e in range(e_count):
            gate, up, down = (w[(e, p)] for p in PROJS)
            s13 = torch.maximum(global_scale_for(gate), global_scale_for(up))
            for r, (proj, t) in enumerate((("gate_proj", gate), ("up_proj", up))):
                packed, sf, _ = quantize_weight(t, s13, name=f"{name}.{e}.{proj}.weight", scale_search=scale_search)
                out.w13_packed[e, r * i:(r + 1) * i] = packed
                out.w13_scale[e, r * i:(r + 1) * i] = sf
            out.w13_gs[e] = s13
            packed, sf, s2 = quantize_weight(down, name=f"{name}.{e}.down_proj.weight", scale_search=scale_search)
            out.w2_packed[e], out.w2_scale[e], out.w2_gs[e] = packed, sf, s2
        if a13_amax is not None or a2_amax is not None:
            out.set_input_amax(a13_amax, a2_amax)
        return out

    @torch.no_grad()
    def set_input_amax(self, a13_amax: torch.Tensor | None, a2_amax: torch.Tensor | None) -> None:
        """Calibrated activation amaxes [E] -> input scales (amax / (6 * 448))."""
        for amax, dst in ((a13_amax, self.a13_scale), (a2_amax, self.a2_scale)):
            if amax is None:
                continue
            amax = torch.as_tensor(amax, dtype=torch.float32)
            if amax.shape != dst.shape:
                raise ValueError(f"input amax has shape {tuple(amax.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(input_scale_for(amax))

    def missing_input_scales(self) -> list[int]:
        """Experts whose gate/up or down input scale is not a positive finite number."""
        ok = lambda s: torch.isfinite(s) & (s > 0)  # noqa: E731
        return (~(ok(self.a13_scale) & ok(self.a2_scale))).nonzero().flatten().tolist()

    # -- checkpoint I/O (ModelOpt per-expert tensors) ----------------------------------------------------
    def expected_params(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Shapes are gate_proj's / up_proj's ([I, H/2], [I, H/16]); down_proj's swap I and H."""
        i, h = self.intermediate_size, self.hidden_size
        return {"weight": ((i, h // 2), torch.uint8), "weight_scale": ((i, h // BLOCK), torch.float8_e4m3fn),
                "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32)}

    def _rows(self, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.intermediate_size
        if proj == "gate_proj":
            return self.w13_packed[expert, :i], self.w13_scale[expert, :i]
        if proj == "up_proj":
            return self.w13_packed[expert, i:], self.w13_scale[expert, i:]
        if proj == "down_proj":
            return self.w2_packed[expert], self.w2_scale[expert]
        raise KeyError(f"unknown projection {proj!r}; expected one of {PROJS}")

    @torch.no_grad()
    def load_expert_param(self, expert: int, proj: str, param: str, tensor: torch.Tensor) -> None:
        where = f"expert {expert} {proj}.{param}"
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"{where}: expert index out of range [0, {self.num_experts})")
        packed, scale = self._rows(expert, proj)
        if param in ("weight", "weight_scale"):
            dst, want = (packed, torch.uint8) if param == "weight" else (scale, torch.float8_e4m3fn)
            if tensor.dtype != want:
                raise TypeError(f"{where}: dtype {tensor.dtype}, expected {want} (NVFP4 ModelOpt layout)")
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"{where}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            return
        if param not in ("weight_scale_2", "input_scale"):
            raise KeyError(f"{where}: unexpected parameter for NVFP4 experts")
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise ValueError(f"{where}: expected one fp32 scalar, got {tuple(tensor.shape)} {tensor.dtype}")
        value = tensor.float().reshape(())
        if not (torch.isfinite(value) and value > 0):
            # A zero or missing input_scale is how uncalibrated experts show up; serving one gives NaNs.
            raise ValueError(f"{where} = {value.item()}: must be positive and finite "
                             f"(an uncalibrated expert? recalibrate with full expert coverage)")
        if proj == "down_proj":
            (self.w2_gs if param == "weight_scale_2" else self.a2_scale)[expert] = value
            return
        dst = self.w13_gs if param == "weight_scale_2" else self.a13_scale
        other = self._w13_seen.get((expert, param))
        if other is not None and other != proj and dst[expert] != value:
            if param == "weight_scale_2":
                raise ValueError(f"{where} = {value.item()} differs from the {other} one "
                                 f"({dst[expert].item()}); NVFP4 gate and up must share weight_scale_2")
            logger.warning("%s = %g differs from %s's %g; using the larger", where, value.item(), other,
                           dst[expert].item())
            value = torch.maximum(value, dst[expert])
        dst[expert] = value
        self._w13_seen[(expert, param)] = proj

    def expert_params(self) -> Iterator[tuple[int, str, str, torch.Tensor]]:
        missing = self.missing_input_scales()
        if missing:
            raise ValueError(f"NVFP4 experts {missing} have no calibrated input_scale; calibrate them "
                             f"(or impute explicitly) before saving")
        for e in range(self.num_experts):
            for proj in PROJS:
                packed, scale = self._rows(e, proj)
                down = proj == "down_proj"
                yield e, proj, "weight", packed
                yield e, proj, "weight_scale", scale
                # gate and up carry the same scalars; clones, so writers do not see aliased tensors
                yield e, proj, "weight_scale_2", (self.w2_gs if down else self.w13_gs)[e].clone()
                yield e, proj, "input_scale", (self.a2_scale if down else self.a13_scale)[e].clone()

    # -- memory -----------------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of every tensor this module holds (unique storages), measured, not computed."""
        seen, total = set(), 0
        for t in self.buffers():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def num_weights(self) -> int:
        return 3 * self.num_experts * self.hidden_size * self.intermediate_size

    # -- compute ----------------------------------------------------------------------------------------
    def moe_weights(self):
        """The packed tensors as the kernels' NVFP4MoEWeights (input scales only in W4A4 mode)."""
        from namazu.kernels.moe_dispatch import NVFP4MoEWeights

        w4a4 = self.nvfp4_mode == "w4a4"
        return NVFP4MoEWeights(self.w13_packed, self.w13_scale, self.w13_gs, self.w2_packed, self.w2_scale,
                               self.w2_gs, self.a13_scale if w4a4 else None, self.a2_scale if w4a4 else None)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.use_kernels:
            # The MoE backend chosen at start-up (C++ on CPU, Triton/CUDA on GPU); each backend runs the
            # W4A4 emulation with the same rounding points as forward_reference (tested).
            from namazu.kernels.backends import get_moe_backend

            return get_moe_backend(x.device).nvfp4(x, topk_ids, topk_weights, self.moe_weights())
        return self.forward_reference(x, topk_ids, topk_weights)

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The torch reference of both modes, the oracle of every backend. In W4A4 the GEMM outputs and the
        SwiGLU product are rounded to the activation dtype before the next quantization, as Blackwell MoE
        pipelines write them (bf16 between GEMMs)."""
        n, k = topk_ids.shape
        order, counts, _ = sort_by_expert(topk_ids, self.num_experts)
        token = order // k
        xs = x.index_select(0, token)
        ys = torch.empty(n * k, self.hidden_size, dtype=torch.float32, device=x.device)
        start = 0
        # Expert sizes are read on the host: this is the torch reference; kernels run grouped GEMMs instead.
        for e, m in enumerate(counts.tolist()):
            if m:
                ys[start:start + m] = self.expert_forward(e, xs[start:start + m])
                start += m
        w = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(-1)
        out = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, ys * w).to(x.dtype)

    def expert_forward(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP on its rows [m, H] -> [m, H] (fp32), in the current mode."""
        if self.nvfp4_mode == "w4a4":
            h = _w4a4_gemm(xe, self.w13_packed[e], self.w13_scale[e], self.w13_gs[e], self.a13_scale[e])
            h = h.to(xe.dtype)
            gate, up = h.chunk(2, dim=-1)
            act = (F.silu(gate.float()) * up.float()).to(xe.dtype)
            return _w4a4_gemm(act, self.w2_packed[e], self.w2_scale[e], self.w2_gs[e], self.a2_scale[e])
        w13 = dequantize_weight(self.w13_packed[e], self.w13_scale[e], self.w13_gs[e], xe.dtype)
        gate, up = F.linear(xe, w13).chunk(2, dim=-1)
        w2 = dequantize_weight(self.w2_packed[e], self.w2_scale[e], self.w2_gs[e], xe.dtype)
        return F.linear(F.silu(gate) * up, w2).float()


def _w4a4_gemm(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, w_gs: torch.Tensor,
               input_scale: torch.Tensor) -> torch.Tensor:
    """Emulated block-scaled FP4 GEMM: alpha * sum_b SFa_b SFw_b <qa_b, qw_b>, fp32 accumulation."""
    qa = fake_quantize_activation(a, input_scale, include_global=False)
    qw = dequantize_weight(packed, scale, 1.0, torch.float32)
    return (qa @ qw.T) * (input_scale * w_gs)


def _experts_excluded(cfg, layer_idx: int) -> bool:
    q = cfg.quantization_config or {}
    patterns = q.get("exclude_modules") or (q.get("quantization") or {}).get("exclude_modules") or []
    names = (f"model.layers.{layer_idx}.mlp.experts", f"model.layers.{layer_idx}.mlp.experts.0.gate_proj")
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def _nvfp4_factory(cfg, layer_idx: int, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> RoutedExperts:
    # exclude_modules may keep some layers' experts in high precision (ModelOpt semantics).
    if _experts_excluded(cfg, layer_idx):
        return TorchExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device)
    # The packed weights have no dtype to follow; activations bring theirs.
    return NvFP4Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, device=device)


register_experts_format("nvfp4", _nvfp4_factory)
