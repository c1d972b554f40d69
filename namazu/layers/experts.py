"""The routed-experts interface and its BF16 implementation.

Every format (BF16, NVFP4) and every backend (torch, C++ CPU, Triton, CUDA) of the routed experts is a
`RoutedExperts`: the MoE block hands it the tokens and the router's choice and gets back the weighted sum
of the chosen experts' outputs. The model never looks inside, so quantization and kernels plug in here.

Weights are addressed the way checkpoints name them: expert `e`, projection `gate_proj` / `up_proj` /
`down_proj`, parameter `weight` (plus `weight_scale`, `weight_scale_2`, `input_scale` for NVFP4).
"""
from __future__ import annotations

import abc
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from namazu.kernels import graph_ops, small_gemm  # graph_ops registers torch.ops.namazu.moe_grouped_mm
from namazu.kernels.moe_types import PROJS, MoERuntime, sort_by_expert
from namazu.kernels.moe_workspace import active_workspace, gathers_in_graph
from namazu.layers.weight_loading import Loaded, TPShard, load_shard

# torch's grouped GEMM (CPU and sm90+ GPUs); older torch falls back to the gathered path.
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


class RoutedExperts(nn.Module, abc.ABC):
    """Base class of every routed-experts implementation.

    `forward(x [N, H], topk_ids [N, k] int64, topk_weights [N, k] fp32) -> [N, H]` in x's dtype.
    `runtime` is the MoERuntime the model was built with (which kernel backend runs the forward).
    Under tensor parallelism (`tp`) every expert is held sliced along its intermediate dimension: gate and
    up rows, down columns; `intermediate_size` is the slice this module holds.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    runtime: MoERuntime
    tp: TPShard

    @property
    def full_intermediate_size(self) -> int:
        return self.intermediate_size * self.tp.size

    def shard_of(self, proj: str) -> tuple[tuple[int, int], int]:
        """(full checkpoint shape [out, in] of one expert's `proj` weight, the dimension ranks split)."""
        if proj not in PROJS:
            raise KeyError(f"unknown projection {proj!r}; expected one of {PROJS}")
        i, h = self.full_intermediate_size, self.hidden_size
        return ((h, i), 1) if proj == "down_proj" else ((i, h), 0)

    @abc.abstractmethod
    def load_expert_param(self, expert: int, proj: str, param: str, tensor: Loaded) -> None:
        """The weight loader of the stacked expert tensors: copies this rank's part of one checkpoint tensor
        (expert `expert`, projection `proj`, parameter `param`; a tensor or a LazyTensor) in."""

    @abc.abstractmethod
    def expert_params(self) -> Iterator[tuple[int, str, str, torch.Tensor]]:
        """Yields (expert, proj, param, tensor) in checkpoint layout, for saving."""

    @abc.abstractmethod
    def expected_params(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """param name -> (shape per proj, dtype) that `load_expert_param` accepts, for load-time checks."""


class TorchExperts(RoutedExperts):
    """BF16/FP32 experts stored as stacked tensors; differentiable, used for training and as the reference.

    w13 [E, 2I, H] holds gate rows then up rows (as transformers fuses them); w2 [E, H, I].
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 runtime: MoERuntime | None = None, tp: TPShard = TPShard()):
        super().__init__()
        intermediate_size = tp.split(intermediate_size, "moe_intermediate_size")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.runtime, self.tp = runtime or MoERuntime(), tp
        kw = {"dtype": dtype, "device": device}
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.w13, std=std)
        nn.init.normal_(self.w2, std=std)

    def _slice(self, expert: int, proj: str) -> torch.Tensor:
        i = self.intermediate_size
        if proj == "gate_proj":
            return self.w13.data[expert, :i]
        if proj == "up_proj":
            return self.w13.data[expert, i:]
        if proj == "down_proj":
            return self.w2.data[expert]
        raise KeyError(proj)

    def expected_params(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return {"weight": ((0,), None)}

    def load_expert_param(self, expert: int, proj: str, param: str, tensor: Loaded) -> None:
        if param != "weight":
            raise KeyError(f"unexpected expert parameter '{param}' for a BF16 expert")
        full, dim = self.shard_of(proj)
        try:
            load_shard(self._slice(expert, proj), tensor, full, dim, self.tp.rank)
        except (ValueError, TypeError) as err:
            raise type(err)(f"expert {expert} {proj}: {err}") from err

    def expert_params(self) -> Iterator[tuple[int, str, str, torch.Tensor]]:
        for e in range(self.num_experts):
            for proj in PROJS:
                yield e, proj, "weight", self._slice(e, proj)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a gathered (token, slot) pair reads)."""
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (self.w13.requires_grad or x.requires_grad):
            return self._forward_grouped(x, topk_ids, topk_weights)
        # A kernel backend with its own BF16 kernel (the fused Triton MoE on GPU) takes inference; the
        # torch paths below are the CPU default and the fallback.
        backend = self.runtime.backend_for(x.device)
        if backend is not None and backend.bf16_impl != "torch":
            return backend.bf16(x, topk_ids, topk_weights, self.w13, self.w2)
        if _HAS_GROUPED_MM and x.dtype == self.w13.dtype and x.dtype in (torch.bfloat16, torch.float32):
            return self._forward_grouped_mm(x, topk_ids, topk_weights)
        return self._forward_gathered(x, topk_ids, topk_weights)

    def _forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Training path: one matmul per expert over its sorted tokens (differentiable)."""
        n, k = topk_ids.shape
        order, counts, _ = sort_by_expert(topk_ids, self.num_experts)
        token = order // k
        xs = x[token]
        # Expert sizes are read on the host to slice; training only. Inference uses the sync-free paths.
        chunks, start = [], 0
        for e, m in enumerate(counts.tolist()):
            if m:
                gate, up = F.linear(xs[start:start + m], self.w13[e]).chunk(2, dim=-1)
                chunks.append(F.linear(F.silu(gate) * up, self.w2[e]))
                start += m
        out_sorted = torch.cat(chunks, 0) if chunks else xs.new_zeros(0, x.shape[-1])
        w = topk_weights.reshape(-1)[order].to(out_sorted.dtype).unsqueeze(-1)
        # Under autocast the expert matmuls come out in bf16 while x is fp32: accumulate in their dtype.
        out = out_sorted.new_zeros(x.shape).index_add_(0, token, out_sorted * w)
        return out.to(x.dtype)

    @torch.no_grad()
    def _forward_grouped_mm(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Inference: pairs sorted by expert, one grouped GEMM per projection driven by device-side offsets
        (each expert's weights read once, static shapes, no host sync). A custom op (kernels/graph_ops.py),
        so graph mode traces through it."""
        # bf16 on a CPU with AVX512_BF16, the few pairs of decode and verify steps (eager or compiled): the
        # small-row kernel, pairs grouped by expert. The grouped op pays oneDNN's set-up per expert product,
        # and inductor's traced gather-and-sum reads an expert per pair at a fraction of the kernel's rate.
        pairs = small_gemm.moe_pairs(x, topk_ids, self.w13, self.w2)
        if pairs is not None:
            n, k = topk_ids.shape
            return (pairs.view(n, k, -1).float() * topk_weights.to(torch.float32).unsqueeze(-1)).sum(1).to(x.dtype)
        if torch.compiler.is_compiling():
            if gathers_in_graph(topk_ids.numel(), self.num_experts, self.expert_bytes):
                return self._forward_gathered_traced(x, topk_ids, topk_weights)
            # Graph mode: the ladder entry's workspace, when it has one for these shapes, holds every
            # intermediate and the result (nothing allocated per step).
            ws = active_workspace()
            if ws is not None and ws.fits(x, topk_ids, self.w13, self.w2):
                torch.ops.namazu.moe_grouped_mm_ws(x, topk_ids, topk_weights, self.w13, self.w2, ws.tensors())
                return ws.out
            return torch.ops.namazu.moe_grouped_mm(x, topk_ids, topk_weights, self.w13, self.w2)
        return graph_ops.moe_grouped_mm_eager(x, topk_ids, topk_weights, self.w13, self.w2)

    def _forward_gathered_traced(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                                 ) -> torch.Tensor:
        """Graph mode with few pairs per expert: each pair's expert weights gathered and multiplied as a
        product-and-sum the compiler fuses into loops over the weights (nothing gathered into memory),
        the weighted top-k sum in fp32 as the grouped path computes it."""
        n, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        xs = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, 1, -1)
        gate, up = (self.w13[ids] * xs).sum(-1).chunk(2, dim=-1)
        out = (self.w2[ids] * (F.silu(gate) * up).unsqueeze(1)).sum(-1)
        w = topk_weights.to(torch.float32).unsqueeze(-1)
        return (out.view(n, k, -1).float() * w).sum(1).to(x.dtype)

    @torch.no_grad()
    def _forward_gathered(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          pairs_per_chunk: int = 256) -> torch.Tensor:
        """Inference fallback (for dtypes grouped_mm lacks) with static shapes and no host sync: gathers each
        (token, slot)'s expert weights and runs batched mat-vecs, chunked to bound the gathered-weight memory."""
        n, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)
        w = topk_weights.reshape(-1, 1).to(x.dtype)
        outs = []
        for s in range(0, n * k, pairs_per_chunk):
            e = ids[s:s + pairs_per_chunk]
            h = torch.bmm(self.w13[e], xs[s:s + pairs_per_chunk].unsqueeze(-1)).squeeze(-1)
            gate, up = h.chunk(2, dim=-1)
            o = torch.bmm(self.w2[e], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
            outs.append(o * w[s:s + pairs_per_chunk])
        if not outs:
            return torch.zeros_like(x)
        return torch.cat(outs, 0).view(n, k, -1).sum(1)
