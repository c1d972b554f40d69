"""Selective quantization: which modules become NVFP4.

A policy is a list of fnmatch patterns with ModelOpt's `exclude_modules` meaning: a linear whose module
name (checkpoint naming, e.g. `model.layers.3.self_attn.q_a_proj`) matches any pattern stays in high
precision; every other linear the policy's scope covers is quantized. The default keeps everything but
the routed experts in BF16: attention, router, shared experts, dense MLPs, embeddings and lm_head.

Module classes (the unit of the sensitivity sweep):
  routed_experts  model.layers.L.mlp.experts.E.{gate,up,down}_proj
  shared_experts  model.layers.L.mlp.shared_experts.{gate,up,down}_proj
  dense_mlp       model.layers.L.mlp.{gate,up,down}_proj of the first_k_dense_replace layers
  attention       model.layers.L.self_attn.* linear projections
  router          model.layers.L.mlp.gate
  lm_head         lm_head
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

MODULE_CLASSES = ("routed_experts", "shared_experts", "dense_mlp", "attention", "router", "lm_head")
PRESETS: dict[str, tuple[str, ...]] = {
    "experts": ("routed_experts",),
    # "every linear of the transformer blocks"; the router and lm_head are their own sensitivity rows
    # and stay BF16 in every public NVFP4 checkpoint.
    "all-linear": ("routed_experts", "shared_experts", "dense_mlp", "attention"),
}

_EXPERTS_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts$")
_CLASS_OF = (
    (re.compile(r"^model\.layers\.\d+\.mlp\.experts(\.\d+\.(gate|up|down)_proj)?$"), "routed_experts"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj$"), "shared_experts"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$"), "dense_mlp"),
    (re.compile(r"^model\.layers\.\d+\.self_attn\.\w+_proj(_with_mqa)?$"), "attention"),
    (re.compile(r"^model\.layers\.\d+\.mlp\.gate$"), "router"),
    (re.compile(r"^lm_head$"), "lm_head"),
)


def module_class(name: str) -> str | None:
    """The module class of a linear's name, or None for anything that is not a quantizable linear."""
    for pattern, cls in _CLASS_OF:
        if pattern.match(name):
            return cls
    return None


def exclude_patterns(keep: tuple[str, ...] | list[str]) -> list[str]:
    """ModelOpt exclude_modules that leave exactly the classes in `keep` quantized."""
    unknown = set(keep) - set(MODULE_CLASSES)
    if unknown:
        raise ValueError(f"unknown module class(es) {sorted(unknown)}; known: {MODULE_CLASSES}")
    pats: list[str] = []
    if "lm_head" not in keep:
        pats.append("lm_head")
    if "attention" not in keep:
        pats.append("model.layers.*.self_attn*")
    if "router" not in keep:
        pats.append("model.layers.*.mlp.gate")
    if "shared_experts" not in keep:
        pats.append("model.layers.*.mlp.shared_experts*")
    if "routed_experts" not in keep:
        pats.append("model.layers.*.mlp.experts*")
    if "dense_mlp" not in keep:
        # `*` crosses dots in fnmatch, but only a dense layer's MLP name ends in `.mlp.gate_proj`
        pats += [f"model.layers.*.mlp.{p}_proj" for p in ("gate", "up", "down")]
    return pats


@dataclass
class QuantPolicy:
    """exclude_modules patterns (ModelOpt meaning) deciding which linears are NVFP4."""

    exclude_modules: list[str] = field(default_factory=list)

    @classmethod
    def from_classes(cls, keep: tuple[str, ...] | list[str], extra_exclude: list[str] | None = None) -> QuantPolicy:
        return cls(exclude_patterns(keep) + list(extra_exclude or []))

    @classmethod
    def preset(cls, name: str, extra_exclude: list[str] | None = None) -> QuantPolicy:
        if name not in PRESETS:
            raise ValueError(f"unknown quantization preset {name!r}; known: {sorted(PRESETS)}")
        return cls.from_classes(PRESETS[name], extra_exclude)

    @classmethod
    def parse(cls, spec: str, extra_exclude: list[str] | None = None) -> QuantPolicy:
        """A preset name or a comma list of module classes (e.g. `routed_experts,attention`)."""
        if spec in PRESETS:
            return cls.preset(spec, extra_exclude)
        return cls.from_classes([s.strip() for s in spec.split(",") if s.strip()], extra_exclude)

    def excluded(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.exclude_modules)

    def quantized(self, name: str) -> bool:
        """True if `name` is a quantizable linear and no exclude pattern matches it."""
        m = _EXPERTS_MODULE.match(name)
        if m:
            return self.experts_quantized(int(m.group(1)))
        return module_class(name) is not None and not self.excluded(name)

    def experts_quantized(self, layer_idx: int) -> bool:
        """Routed experts are one module per layer in namazu; excluded if the layer or its expert 0 matches."""
        prefix = f"model.layers.{layer_idx}.mlp.experts"
        return not (self.excluded(prefix) or self.excluded(prefix + ".0.gate_proj"))
