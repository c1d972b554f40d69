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

The mode and the kernel backend come from the MoERuntime the module is handed at construction (resolved
once by the runner, `kernels.backends.resolve_moe_runtime`); a module handed none runs the plain-torch
reference `kernels.moe_dispatch.torch_moe_nvfp4`, in W4A16 unless given a mode. `set_mode` switches a
built model.

Storage: the buffers are the tensors of one `NVFP4MoEWeights` (kernels/moe_types.py, the only place the
layout is spelled out): ModelOpt's per-expert tensors stacked over experts, gate rows then up rows in w13,
gate and up sharing one weight_scale_2; a13_scale / a2_scale are the input scales of gate/up and of down.
`quantize_experts` is the one way high-precision experts become NVFP4.
"""
from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterator

import torch

from namazu.kernels.moe_dispatch import torch_moe_nvfp4
from namazu.kernels.moe_types import PROJS, MoERuntime, NVFP4MoEWeights, check_nvfp4_mode
from namazu.layers.experts import RoutedExperts, TorchExperts
from namazu.layers.moe import register_experts_format
from namazu.layers.weight_loading import Loaded, TPShard, load_shard, materialize
from namazu.quant.nvfp4 import BLOCK, global_scale_for, input_scale_for, quantize_weight

logger = logging.getLogger(__name__)


def set_mode(model: torch.nn.Module, mode: str) -> int:
    """Switches every NVFP4 module (experts and linears) in `model` to `mode`; returns how many."""
    check_nvfp4_mode(mode)
    n = 0
    for m in model.modules():
        if hasattr(m, "nvfp4_mode"):
            m.nvfp4_mode = mode
            n += 1
    return n


@torch.no_grad()
def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, a13_amax: torch.Tensor | None = None,
                     a2_amax: torch.Tensor | None = None, *, name: str = "experts",
                     scale_search: bool = False) -> NVFP4MoEWeights:
    """Stacked high-precision experts (w13 [E, 2I, H] gate rows first, w2 [E, H, I]) -> NVFP4, one expert
    at a time. Gate and up share weight_scale_2 (the max of their own). With calibrated input amaxes [E]
    the result carries W4A4 input scales (amax / (6 * 448)), else none. `scale_search`: see
    nvfp4.quantize_weight; errors name `{name}.{expert}.{proj}.weight`."""
    e_count, i2, h = w13.shape
    i = i2 // 2
    out = NVFP4MoEWeights.zeros(e_count, h, i, device=w13.device).weight_only()
    for e in range(e_count):
        gate, up = w13[e, :i], w13[e, i:]
        s13 = torch.maximum(global_scale_for(gate), global_scale_for(up))
        for r, (proj, t) in enumerate((("gate_proj", gate), ("up_proj", up))):
            packed, sf, _ = quantize_weight(t, s13, name=f"{name}.{e}.{proj}.weight", scale_search=scale_search)
            out.w13_packed[e, r * i:(r + 1) * i] = packed
            out.w13_scale[e, r * i:(r + 1) * i] = sf
        out.w13_gs[e] = s13
        packed, sf, s2 = quantize_weight(w2[e], name=f"{name}.{e}.down_proj.weight", scale_search=scale_search)
        out.w2_packed[e], out.w2_scale[e], out.w2_gs[e] = packed, sf, s2
    if a13_amax is not None and a2_amax is not None:
        out.a13_scale = input_scale_for(torch.as_tensor(a13_amax, dtype=torch.float32)).to(w13.device)
        out.a2_scale = input_scale_for(torch.as_tensor(a2_amax, dtype=torch.float32)).to(w13.device)
    out.validate()
    return out


class NvFP4Experts(RoutedExperts):
    """Routed experts in NVFP4 (see the module docstring for layout and modes)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, mode: str | None = None,
                 device: torch.device | str | None = None, runtime: MoERuntime | None = None,
                 tp: TPShard = TPShard()):
        super().__init__()
        local = tp.split(intermediate_size, "moe_intermediate_size")
        if hidden_size % BLOCK or local % BLOCK:
            raise ValueError(f"NVFP4 experts need hidden_size ({hidden_size}) and moe_intermediate_size "
                             f"({intermediate_size}, {local} per rank) divisible by {BLOCK}")
        e, h, i = num_experts, hidden_size, local
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.runtime, self.tp = runtime or MoERuntime(), tp
        self.nvfp4_mode = check_nvfp4_mode(mode or self.runtime.nvfp4_mode)
        for name, t in NVFP4MoEWeights.zeros(e, h, i, device=device).named_tensors():
            self.register_buffer(name, t)
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
                     name: str = "experts", scale_search: bool = False,
                     runtime: MoERuntime | None = None) -> NvFP4Experts:
        """Quantizes high-precision experts (any RoutedExperts yielding `weight`s). gate and up share
        weight_scale_2 = the max of their own.

        a13_amax / a2_amax [E] are calibrated input amaxes (gate/up input, down input); without them the
        input scales stay 0 and only W4A16 can run (W4A4 and saving refuse such experts). `scale_search`:
        see nvfp4.quantize_weight. The new module keeps `runtime` (default: the source's).
        """
        if src.tp.size > 1:
            # weight_scale_2 is the amax of the whole expert: one rank's slice cannot compute it.
            raise ValueError(f"{name}: quantize the unsharded experts (tp size 1), then load the NVFP4 "
                             f"checkpoint sharded")
        w = {(e, proj): t for e, proj, param, t in src.expert_params() if param == "weight"}
        e_count = src.num_experts
        w13 = torch.stack([torch.cat([w[(e, "gate_proj")], w[(e, "up_proj")]]) for e in range(e_count)])
        w2 = torch.stack([w[(e, "down_proj")] for e in range(e_count)])
        q = quantize_experts(w13, w2, name=name, scale_search=scale_search)
        out = cls(e_count, src.hidden_size, src.intermediate_size, mode=mode, device=w13.device,
                  runtime=runtime if runtime is not None else getattr(src, "runtime", None))
        for field, t in q.named_tensors():
            getattr(out, field).copy_(t)
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
        i, h = self.full_intermediate_size, self.hidden_size
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
    def load_expert_param(self, expert: int, proj: str, param: str, tensor: Loaded) -> None:
        where = f"expert {expert} {proj}.{param}"
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"{where}: expert index out of range [0, {self.num_experts})")
        packed, scale = self._rows(expert, proj)
        if param in ("weight", "weight_scale"):
            dst, want = (packed, torch.uint8) if param == "weight" else (scale, torch.float8_e4m3fn)
            if tensor.dtype != want:
                raise TypeError(f"{where}: dtype {tensor.dtype}, expected {want} (NVFP4 ModelOpt layout)")
            # Packed codes hold two inputs per byte and one scale per 16 inputs; a rank's slice of the
            # intermediate dimension is whole blocks (NVFP4MoEWeights.layout checks I/tp % 16 == 0).
            (out_f, in_f), dim = self.shard_of(proj)
            full = (out_f, in_f // (2 if param == "weight" else BLOCK))
            try:
                load_shard(dst, tensor, full, dim, self.tp.rank, exact_dtype=True)
            except (ValueError, TypeError) as err:
                raise type(err)(f"{where}: {err}") from err
            return
        tensor = materialize(tensor)
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
    def moe_weights(self) -> NVFP4MoEWeights:
        """The buffers as the kernels' NVFP4MoEWeights (input scales only in W4A4 mode)."""
        w = NVFP4MoEWeights(**self._buffers)   # exactly the layout's tensors (registered in __init__)
        return w if self.nvfp4_mode == "w4a4" else w.weight_only()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # The backend resolved at start-up (C++ on CPU, Triton/CUDA on GPU) rounds W4A4 at the same points
        # as the torch reference (tested); without one the reference itself runs.
        backend = self.runtime.backend_for(x.device)
        if backend is None:
            return torch_moe_nvfp4(x, topk_ids, topk_weights, self.moe_weights())
        return backend.nvfp4(x, topk_ids, topk_weights, self.moe_weights())


def _experts_excluded(cfg, layer_idx: int) -> bool:
    q = cfg.quantization_config or {}
    patterns = q.get("exclude_modules") or (q.get("quantization") or {}).get("exclude_modules") or []
    names = (f"model.layers.{layer_idx}.mlp.experts", f"model.layers.{layer_idx}.mlp.experts.0.gate_proj")
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def nvfp4_experts_for_layer(cfg, layer_idx: int, dtype: torch.dtype | None = None,
                            device: torch.device | str | None = None, runtime: MoERuntime | None = None,
                            tp: TPShard = TPShard()) -> RoutedExperts:
    """The routed experts of layer `layer_idx` of an NVFP4 ModelOpt checkpoint."""
    # exclude_modules may keep some layers' experts in high precision (ModelOpt semantics).
    if _experts_excluded(cfg, layer_idx):
        return TorchExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                            runtime=runtime, tp=tp)
    # The packed weights have no dtype to follow; activations bring theirs.
    return NvFP4Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, device=device,
                        runtime=runtime, tp=tp)


register_experts_format("nvfp4", nvfp4_experts_for_layer)
