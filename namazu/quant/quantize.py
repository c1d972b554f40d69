"""Applies a quantization policy to a model in memory, given calibrated activation amaxes.

Routed experts become NvFP4Experts, other covered linears NvFP4Linear; the router (not an nn.Linear)
gets its weight replaced by the NVFP4 round trip (fp32) and its input fake-quantized by a hook, which
is all the sensitivity sweep needs from it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from namazu.layers.experts import RoutedExperts
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation, input_scale_for, quantize_weight
from namazu.quant.nvfp4_experts import NvFP4Experts
from namazu.quant.nvfp4_linear import NvFP4Linear
from namazu.quant.selective import QuantPolicy, module_class

logger = logging.getLogger(__name__)


@dataclass
class ActivationStats:
    """Calibrated input amaxes: per MoE layer two [E] vectors, per other linear one scalar."""

    experts_a13: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [E] gate/up input amax
    experts_a2: dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> [E] down_proj input amax
    linears: dict[str, float] = field(default_factory=dict)              # module name -> input amax


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def quantize_model(model: nn.Module, policy: QuantPolicy, stats: ActivationStats | None,
                   mode: str = "w4a4", scale_search: bool = False) -> dict[str, int]:
    """Replaces every module the policy covers by its NVFP4 version, in place; returns counts per class.

    Without stats (None) only W4A16 is possible: input scales stay unset and W4A4 is refused.
    `scale_search` picks MSE-optimal block scales (nvfp4.quantize_weight) instead of the max rule.
    """
    if stats is None and mode == "w4a4":
        raise ValueError("W4A4 needs calibrated activation amaxes (run namazu.quant.calibrate)")
    counts: dict[str, int] = {}
    targets = [(n, m) for n, m in model.named_modules() if policy.quantized(n)]
    for name, mod in targets:
        cls = module_class(name)
        if isinstance(mod, RoutedExperts):
            layer = int(name.split(".")[2])
            a13 = stats.experts_a13.get(layer) if stats else None
            a2 = stats.experts_a2.get(layer) if stats else None
            if stats is not None and (a13 is None or a2 is None):
                raise ValueError(f"{name}: no calibration statistics for this layer's experts")
            q = NvFP4Experts.from_experts(mod, a13, a2, mode=mode, name=name, scale_search=scale_search)
            if stats is not None and q.missing_input_scales():
                raise ValueError(f"{name}: experts {q.missing_input_scales()} have no calibrated input scale")
            _set_submodule(model, name, q)
        elif cls == "router":
            _fake_quantize_router(mod, _amax(stats, name), name)
        elif isinstance(mod, nn.Linear):
            if cls == "lm_head" and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
                raise ValueError("lm_head is tied to the embeddings; quantizing it would untie them")
            _set_submodule(model, name, NvFP4Linear.from_linear(mod, _amax(stats, name), mode, name, scale_search))
        else:
            continue
        counts[cls] = counts.get(cls, 0) + 1
    logger.info("quantized to NVFP4 (%s): %s", mode, counts)
    return counts


def _amax(stats: ActivationStats | None, name: str) -> float | None:
    if stats is None:
        return None
    if name not in stats.linears:
        raise ValueError(f"{name}: no calibrated input amax (was it covered by the calibration policy?)")
    return stats.linears[name]


def _fake_quantize_router(router: nn.Module, amax: float | None, name: str) -> None:
    w = router.weight.data
    packed, sf, s2 = quantize_weight(w, name=f"{name}.weight")
    router.weight = nn.Parameter(dequantize_weight(packed, sf, s2, torch.float32), requires_grad=False)
    if amax is None:
        return
    scale = input_scale_for(amax)

    def quantize_input(_mod, args):
        return (fake_quantize_activation(args[0], scale.to(args[0].device)),) + tuple(args[1:])

    router.register_forward_pre_hook(quantize_input)


def experts_resident_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes held by all NVFP4 routed experts, number of their weights), measured on the live modules."""
    total = weights = 0
    for m in model.modules():
        if isinstance(m, NvFP4Experts):
            total += m.resident_bytes()
            weights += m.num_weights()
    return total, weights
