"""Whether a model can be split over `size` ranks, checked before any rank starts.

Each rank holds whole attention heads and an equal slice of every intermediate dimension, so those must
divide by the size (the vocabulary need not: it is padded). Checking here gives one error naming the
field instead of the same failure reported by every rank's loader.
"""
from __future__ import annotations

from namazu.config import ModelConfig


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError naming each dimension of `cfg` that `size` ranks cannot split evenly."""
    if size == 1:
        return
    dims = {"num_attention_heads": cfg.num_attention_heads}
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dims["intermediate_size"] = cfg.intermediate_size
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dims["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{name} ({n})" for name, n in dims.items() if n % size]
    if bad:
        raise ValueError(f"--tensor-parallel-size {size}: {', '.join(bad)} not divisible by {size}; each rank "
                         "holds whole heads and an equal slice of each intermediate dimension")
