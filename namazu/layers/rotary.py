"""Rotary position embedding: default and YaRN, with DeepSeek's interleaved rope layout.

With `interleave=True` the checkpoint stores each rotated pair as adjacent channels (x0, x1), (x2, x3)...;
we rotate pairs in place and emit them de-interleaved ([evens | odds]) for q and k alike, which leaves
q.k unchanged and matches the reference implementation's output layout.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from namazu.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inverse frequencies [dim/2], cos/sin scale)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = cfg.theta ** exponents
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between.
    factor = cfg.factor
    orig = cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    if cfg.attention_factor is not None:
        scale = float(cfg.attention_factor)
    elif cfg.mscale and cfg.mscale_all_dim:
        scale = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        scale = _yarn_mscale(factor)
    return inv_freq, scale


def yarn_softmax_scale(cfg: RopeConfig, head_dim: int) -> float:
    """DeepSeek multiplies the attention softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = head_dim ** -0.5
    if cfg.rope_type == "yarn" and cfg.mscale_all_dim:
        m = _yarn_mscale(cfg.factor, cfg.mscale_all_dim)
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RopeConfig, dim: int, interleave: bool, device: torch.device | str | None = None):
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(cfg, dim)
        # Made on the model's device: no checkpoint tensor moves it there, and a host-to-device copy per
        # forward cannot be captured in a CUDA graph.
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.interleave = interleave

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., dim] with cos/sin [..., dim/2] broadcastable (caller inserts head dims)."""
        dtype = x.dtype
        cos, sin = cos.to(dtype), sin.to(dtype)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
