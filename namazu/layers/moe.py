"""DeepSeek-V3 MoE block: router (gate), routed experts behind the RoutedExperts interface, shared experts."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from namazu.config import ModelConfig
from namazu.distributed.group import all_reduce
from namazu.kernels.moe_types import MoERuntime
from namazu.layers.experts import RoutedExperts, TorchExperts
from namazu.layers.linear import ColumnParallelLinear, RowParallelLinear
from namazu.layers.weight_loading import TPShard

# A routed-experts format: builds one MoE layer's experts from (cfg, layer_idx, dtype, device, runtime, tp).
ExpertsFactory = Callable[[ModelConfig, int, "torch.dtype | None", "torch.device | str | None",
                           "MoERuntime | None", TPShard], RoutedExperts]


def _bf16_experts(cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None, device: torch.device | str | None,
                  runtime: MoERuntime | None, tp: TPShard) -> RoutedExperts:
    return TorchExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                        runtime=runtime, tp=tp)


# The layer knows only its own high-precision format; a quantized format registers itself here from the package
# that owns it (NVFP4: `namazu/quant/nvfp4_experts.py`), so the model never imports quantization code.
_EXPERTS_FORMATS: dict[str, ExpertsFactory] = {"bf16": _bf16_experts}


def register_experts_format(name: str, factory: ExpertsFactory) -> None:
    """Makes checkpoints whose routed experts are in format `name` loadable (`make_experts(name, ...)`)."""
    known = _EXPERTS_FORMATS.get(name)
    if known is not None and known is not factory:
        raise ValueError(f"routed-experts format {name!r} is already registered by {known.__module__}")
    _EXPERTS_FORMATS[name] = factory


def experts_formats() -> list[str]:
    return sorted(_EXPERTS_FORMATS)


def make_experts(fmt: str, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, runtime: MoERuntime | None = None,
                 tp: TPShard = TPShard()) -> RoutedExperts:
    """The routed experts of one MoE layer in checkpoint format `fmt`, running on `runtime`; under tensor
    parallelism every rank holds all experts, each sharded along its intermediate dimension."""
    factory = _EXPERTS_FORMATS.get(fmt)
    if factory is None:
        raise ValueError(f"unknown routed-experts format {fmt!r}; registered: {experts_formats()} (a quantized "
                         "format registers itself when its package is imported: NVFP4 with namazu.quant.nvfp4_experts)")
    return factory(cfg, layer_idx, dtype, device, runtime, tp)


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers' FFN and the shared experts (a rank holds a slice of the intermediate;
    `reduce_results=False` leaves the output a partial sum for the caller to reduce)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype | None = None, device=None,
                 tp: TPShard = TPShard(), reduce_results: bool = True):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device, "tp": tp}
        self.gate_proj = ColumnParallelLinear(hidden, inter, **kw)
        self.up_proj = ColumnParallelLinear(hidden, inter, **kw)
        self.down_proj = RowParallelLinear(inter, hidden, reduce_results=reduce_results, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Scores experts and picks top-k, per the config's scoring_func and topk_method.

    noaux_tc: the correction bias shifts *selection* only; the returned weights are the unbiased scores.
    While training it counts tokens per expert so `update_bias` can apply DeepSeek-V3's auxiliary-loss-free
    balancing (raise the bias of under-loaded experts, lower it for over-loaded ones).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, dtype=dtype, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, device=device))
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        # The correction bias is an fp32 statistic (the reference keeps it fp32 too); dtype casts skip it.
        super()._apply(fn, recurse)
        for name in ("e_score_correction_bias", "tokens_per_expert"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return self

    def _group_mask(self, choice: torch.Tensor, group_reduce: str) -> torch.Tensor:
        n = choice.shape[0]
        grouped = choice.view(n, self.n_group, -1)
        if group_reduce == "top2":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(-1)
        if self.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            if self.n_group > 1:
                choice = choice.masked_fill(~self._group_mask(choice, "top2"), float("-inf"))
        elif self.topk_method == "group_limited_greedy" and self.n_group > 1:
            choice = scores.masked_fill(~self._group_mask(scores, "max"), float("-inf"))
        else:
            choice = scores
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        return topk_ids, weights

    @torch.no_grad()
    def update_bias(self, rate: float) -> torch.Tensor:
        """Aux-loss-free balancing step from the load counted since the last call; returns that load."""
        load = self.tokens_per_expert.clone()
        if load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()
        return load


class MoE(nn.Module):
    """Router (replicated), routed experts and shared experts; under tensor parallelism both kinds of
    experts hold a slice of their intermediate dimension, so each gives a partial sum and one all-reduce
    of their total completes the block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, experts_format: str = "bf16",
                 dtype: torch.dtype | None = None, device=None, runtime: MoERuntime | None = None,
                 tp: TPShard = TPShard()):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg, dtype=dtype, device=device)
        self.experts: RoutedExperts = make_experts(experts_format, cfg, layer_idx, dtype, device, runtime, tp)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, device,
                                   tp, reduce_results=False) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.gate(flat)
        out = self.experts(flat, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return (all_reduce(out, self.tp.size) if self.tp.size > 1 else out).view(shape)
