"""A contiguous latent KV cache for a batch of equal-length rows: the simplest cache context.

Used for token-by-token decoding outside the engine (tests, evaluation scripts, the tiny model's sampler).
It runs the absorbed MLA form over [c_kv | k_pe] exactly as the engine's paged cache does, so it doubles as
the check that prefill + decode through a latent cache equals full-sequence attention.
"""
from __future__ import annotations

import torch

from namazu.config import ModelConfig
from namazu.layers.mla import latent_attention_ref


class ContiguousLatentCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu"):
        n = cfg.num_hidden_layers
        self.ckv = torch.zeros(n, batch, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.kpe = torch.zeros(n, batch, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len
        self.length = 0  # tokens cached per row before the current forward
        self._step = 0  # tokens in the current forward (per row)

    def begin(self, tokens_per_row: int) -> ContiguousLatentCache:
        if self.length + tokens_per_row > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {self.length}+{tokens_per_row} requested")
        self._step = tokens_per_row
        return self

    def end(self) -> None:
        self.length += self._step
        self._step = 0

    def attend(self, layer, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        b, t, start = self.batch, self._step, self.length
        li = layer.layer_idx
        self.ckv[li, :, start:start + t] = c_kv.view(b, t, -1).to(self.ckv.dtype)
        self.kpe[li, :, start:start + t] = k_pe.view(b, t, -1).to(self.kpe.dtype)
        q_lat = layer.absorb_q(q_nope).view(b, t, layer.num_heads, -1)
        q_pe = q_pe.view(b, t, layer.num_heads, -1)
        q_pos = torch.arange(start, start + t, device=q_nope.device)
        k_pos = torch.arange(start + t, device=q_nope.device)
        outs = [latent_attention_ref(q_lat[i], q_pe[i], self.ckv[li, i, :start + t], self.kpe[li, i, :start + t],
                                     layer.softmax_scale, q_pos, k_pos) for i in range(b)]
        return layer.absorb_out(torch.stack(outs).view(b * t, layer.num_heads, -1))


@torch.no_grad()
def forward_with_cache(model, input_ids: torch.Tensor, cache: ContiguousLatentCache) -> torch.Tensor:
    """input_ids [B, T] continuing each row of `cache`; returns fp32 logits [B, T, V]."""
    from namazu.layers.forward_context import forward_context

    b, t = input_ids.shape
    positions = torch.arange(cache.length, cache.length + t, device=input_ids.device).expand(b, t)
    with forward_context(cache.begin(t)):
        hidden, _ = model(input_ids.reshape(-1), positions.reshape(-1))
    cache.end()
    return model.compute_logits(hidden).view(b, t, -1)
