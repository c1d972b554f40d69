"""The engine's paged latent KV cache and the forward context that attention reads it through.

One tensor [layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] holds every layer's
blocks; a block id means the same positions in every layer, so the block manager allocates once per
sequence, not per layer. `PagedAttentionContext.attend` implements the model's `ctx.attend` contract:
store this step's latents at their slots, then run absorbed attention through the block table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from namazu.config import ModelConfig
from namazu.kernels import graph_ops  # noqa: F401  (registers torch.ops.namazu.paged_mla / write_latents)
from namazu.kernels.paged_mla import paged_latent_attention, write_latents


def kv_entry_dim(cfg: ModelConfig) -> int:
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_hidden_layers * block_size * kv_entry_dim(cfg) * torch.empty((), dtype=dtype).element_size()


class PagedLatentCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.num_blocks, self.block_size = num_blocks, block_size
        # One block past the engine's: graph-mode padding tokens write their latents there, so a
        # static-shape step never touches a block the engine handed out.
        self.kv = torch.zeros(cfg.num_hidden_layers, num_blocks + 1, block_size, kv_entry_dim(cfg),
                              dtype=dtype, device=device)
        self.scratch_slot = num_blocks * block_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class PagedAttentionMetadata:
    """Batch layout of one step, built on the host and copied to the device before the forward."""

    slot_mapping: torch.Tensor   # [N] int64: cache slot of each query token
    block_tables: torch.Tensor   # [B, M] int64
    q_index: torch.Tensor        # [B, Tq] int64: flat token of each (sequence, slot)
    q_pos: torch.Tensor          # [B, Tq] int64: its position, -1 for padding
    out_index: torch.Tensor      # [N] int64: slot of each flat token in B * Tq
    # [B, Tq, Tq] bool, a step that verifies draft trees: which of its own step's queries each query sees
    # (`spec/tree.py: tree_block_mask`); None: causal only.
    tree_mask: torch.Tensor | None = None


class PagedAttentionContext:
    def __init__(self, cache: PagedLatentCache, meta: PagedAttentionMetadata):
        self.cache = cache
        self.meta = meta

    def attend(self, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
               k_pe: torch.Tensor) -> torch.Tensor:
        kv = self.cache.kv[layer.layer_idx]
        m = self.meta
        # The custom ops only while torch.compile traces: their dispatch costs a lot per eager call.
        tracing = torch.compiler.is_compiling()
        (torch.ops.namazu.write_latents if tracing else write_latents)(kv, m.slot_mapping, c_kv, k_pe)
        o_lat = (torch.ops.namazu.paged_mla if tracing else paged_latent_attention)(
            layer.absorb_q(q_nope), q_pe, kv, m.block_tables, m.q_index, m.q_pos, m.out_index, layer.kv_lora_rank,
            layer.softmax_scale, tree_mask=m.tree_mask)
        return layer.absorb_out(o_lat)
