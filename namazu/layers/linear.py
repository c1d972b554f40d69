"""Linear layers that know which part of a tensor-parallel weight they hold (nn.Linear subclasses, so
quantization and calibration treat them as any linear).

- `ReplicatedLinear`: the whole weight on every rank (MLA's down-projections q_a / kv_a).
- `ColumnParallelLinear`: a slice of the output rows, `out_features / tp.size` of them; its output is
  this rank's slice of the full output (q_b / q, kv_b: whole heads; gate/up). The vocabulary-parallel
  embedding and lm_head are in `vocab_parallel.py`.
- `RowParallelLinear`: a slice of the input columns; its output is this rank's partial sum, which its
  forward completes with the tensor-parallel all-reduce (o_proj, down_proj) unless built with
  `reduce_results=False` (the MoE block reduces its shared and routed experts' partial sums at once).
  Its bias is held whole and added once, after the sum.

Each weight (and bias) carries a `weight_loader` that checks the checkpoint tensor's full shape and
copies only this rank's slice, reading only that slice from a lazy checkpoint tensor. At tp.size == 1
all three are nn.Linear with that loader.
"""
from __future__ import annotations

import torch
from torch import nn

from namazu.distributed.group import all_reduce
from namazu.kernels import small_gemm
from namazu.layers.weight_loading import Loaded, TPShard, load_shard

SINGLE = TPShard()


class _ShardedLinear(nn.Linear):
    # Which dimension of the weight [out, in] is split across ranks (None: replicated), and of the bias.
    weight_shard_dim: int | None = None
    bias_shard_dim: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp: TPShard = SINGLE):
        local_in = tp.split(in_features, "in_features") if self.weight_shard_dim == 1 else in_features
        local_out = tp.split(out_features, "out_features") if self.weight_shard_dim == 0 else out_features
        super().__init__(local_in, local_out, bias=bias, dtype=dtype, device=device)
        self.tp = tp
        self.full_in_features, self.full_out_features = in_features, out_features
        self.weight.weight_loader = self._load_weight
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_gemm.linear(x, self.weight, self.bias)

    def _load_weight(self, param: torch.Tensor, loaded: Loaded) -> None:
        load_shard(param.data, loaded, (self.full_out_features, self.full_in_features), self.weight_shard_dim,
                   self.tp.rank)

    def _load_bias(self, param: torch.Tensor, loaded: Loaded) -> None:
        load_shard(param.data, loaded, (self.full_out_features,), self.bias_shard_dim, self.tp.rank)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else ""
        return super().extra_repr() + tp


class ReplicatedLinear(_ShardedLinear):
    pass


class ColumnParallelLinear(_ShardedLinear):
    weight_shard_dim = 0
    bias_shard_dim = 0


class RowParallelLinear(_ShardedLinear):
    weight_shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp: TPShard = SINGLE, reduce_results: bool = True):
        super().__init__(in_features, out_features, bias, dtype, device, tp)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return small_gemm.linear(x, self.weight, self.bias)   # not super().forward: one frame less per call
        out = small_gemm.linear(x, self.weight)
        if self.reduce_results:
            out = all_reduce(out, self.tp.size)
        return out if self.bias is None else out + self.bias
