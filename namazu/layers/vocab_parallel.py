"""Vocabulary-parallel embedding and lm_head: each rank holds a contiguous range of the vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size, so every rank holds
`ceil(V / tp)` rows; the padding rows are zero and never read. The embedding looks up the ids in its
range (the others give zeros) and an all-reduce adds the one rank that holds each id, which is exact.
The lm_head computes logits for its range and an all-gather concatenates them, also exact, and drops
the padding. At one rank both are the plain layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from namazu.distributed.group import all_gather, all_reduce
from namazu.kernels import small_gemm
from namazu.layers.weight_loading import Loaded, TPShard, materialize


def rows_per_rank(vocab_size: int, tp: TPShard) -> int:
    return -(-vocab_size // tp.size)


class _VocabRange:
    def _set_range(self, vocab_size: int, tp: TPShard) -> None:
        self.tp, self.vocab_size = tp, vocab_size
        n = rows_per_rank(vocab_size, tp)
        self.vocab_start = min(vocab_size, tp.rank * n)
        self.vocab_end = min(vocab_size, self.vocab_start + n)
        self.weight.weight_loader = self._load_rows

    @torch.no_grad()
    def whole(self) -> torch.Tensor:
        """The whole vocabulary's rows [V, H] on this rank: the weight itself at one rank, else every rank's
        range gathered (a collective: every rank calls it, at the same point)."""
        if self.tp.size == 1:
            return self.weight
        return all_gather(self.weight.detach(), self.tp.size, dim=0)[:self.vocab_size].clone()

    @torch.no_grad()
    def _load_rows(self, param: torch.Tensor, loaded: Loaded) -> None:
        full = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {full}")
        if not loaded.dtype.is_floating_point:
            raise TypeError(f"dtype {loaded.dtype} where a floating-point weight is expected")
        n = self.vocab_end - self.vocab_start
        if self.tp.size == 1:
            src = materialize(loaded)
        else:
            src = loaded.narrow(0, self.vocab_start, n)     # a LazyTensor reads only these rows
        param.data[:n].copy_(src.to(param.dtype))
        param.data[n:].zero_()


class VocabParallelEmbedding(nn.Embedding, _VocabRange):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, device=None,
                 tp: TPShard = TPShard()):
        nn.Embedding.__init__(self, rows_per_rank(vocab_size, tp), hidden_size, dtype=dtype, device=device)
        self._set_range(vocab_size, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp.size)


class ParallelLMHead(nn.Linear, _VocabRange):
    """`forward` gives this rank's logits; `gather_logits` the whole vocabulary's, on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype | None = None, device=None,
                 tp: TPShard = TPShard()):
        nn.Linear.__init__(self, hidden_size, rows_per_rank(vocab_size, tp), bias=False, dtype=dtype, device=device)
        self._set_range(vocab_size, tp)
        # The weight packed for few-row products (bf16 on CPU: `layers/cpu_layout.use_packed_lm_head`, once the
        # weights are loaded); not state: never saved, None elsewhere.
        self.packed: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return small_gemm.packed_linear(hidden, self.weight, self.packed)

    def gather_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self(hidden)   # through the module call: calibration hooks on lm_head observe its input
        if self.tp.size == 1:
            return local
        return all_gather(local, self.tp.size, dim=-1)[..., :self.vocab_size]
