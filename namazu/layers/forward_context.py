"""The forward context: batch metadata the engine sets before a forward and attention reads.

Keeping it out of every layer's signature lets the same model code run training (no context: dense causal
attention over [B, T]), simple contiguous-cache decoding and the engine's paged batches.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class AttentionContext(Protocol):
    def attend(self, layer: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
               k_pe: torch.Tensor) -> torch.Tensor:
        """Stores this step's latents (c_kv [N, r], k_pe [N, dr]) and returns attention output [N, H, dv]."""
        ...


_CONTEXT: AttentionContext | None = None


def get_forward_context() -> AttentionContext | None:
    return _CONTEXT


def set_forward_context(ctx: AttentionContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


@contextlib.contextmanager
def forward_context(ctx: AttentionContext | None) -> Iterator[AttentionContext | None]:
    prev = get_forward_context()
    set_forward_context(ctx)
    try:
        yield ctx
    finally:
        set_forward_context(prev)
