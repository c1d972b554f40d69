"""Absorbed MLA attention over the paged latent cache, reading keys through the block table.

The cache of one layer is [num_blocks, block_size, r + dr]: the normed latent c_kv and the rotated rope
key k_pe of each token. A step's queries (prefill chunks, decodes, verify rows) are laid out per
sequence as [B, Tq] (padded), and the op walks each sequence's block table a tile of blocks at a time
with an online softmax, so it never gathers a sequence's whole cache: memory per iteration is
B x tile x (r + dr). Visibility is causal by position (key position <= query position); block-table
padding and positions past a sequence's end are never visible because they lie beyond its queries.
Matches `namazu.layers.mla.latent_attention_ref` (tests/test_engine_paged_mla.py).
"""
from __future__ import annotations

import torch

# A finite "minus infinity": a padded query row (no visible key) stays finite instead of becoming NaN.
_MASKED = -1e30


def paged_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_index: torch.Tensor, q_pos: torch.Tensor,
                           out_index: torch.Tensor, kv_lora_rank: int, scale: float,
                           tile_tokens: int = 256) -> torch.Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr]: the step's flat queries.
    kv_cache [num_blocks, bs, r + dr] (this layer), block_tables [B, M] int64.
    q_index [B, Tq]: flat query of each (sequence, slot) (padding: any valid index);
    q_pos [B, Tq]: its position (padding: -1); out_index [N]: each flat query's slot in B * Tq.
    Returns o_lat [N, H, r] in q_lat's dtype."""
    b, tq = q_index.shape
    bs = kv_cache.shape[1]
    r = kv_lora_rank
    h = q_lat.shape[1]
    ql = q_lat.float()[q_index]                      # [B, Tq, H, r]
    qp = q_pe.float()[q_index]                       # [B, Tq, H, dr]
    m = torch.full((b, h, tq), _MASKED, device=q_lat.device)
    denom = torch.zeros(b, h, tq, device=q_lat.device)
    acc = torch.zeros(b, h, tq, r, device=q_lat.device)
    blocks_per_tile = max(1, tile_tokens // bs)
    num_table_blocks = block_tables.shape[1]
    for t0 in range(0, num_table_blocks, blocks_per_tile):
        tile = block_tables[:, t0:t0 + blocks_per_tile]             # [B, nb]
        kv = kv_cache[tile].float().view(b, -1, kv_cache.shape[-1])  # [B, nb * bs, r + dr]
        ckv, kpe = kv[..., :r], kv[..., r:]
        s = torch.einsum("bqhr,bkr->bhqk", ql, ckv) + torch.einsum("bqhd,bkd->bhqk", qp, kpe)
        s = s * scale
        k_pos = t0 * bs + torch.arange(kv.shape[1], device=q_lat.device)
        visible = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)       # [B, Tq, K]
        s = s.masked_fill(~visible.unsqueeze(1), _MASKED)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        denom = denom * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bhqk,bkr->bhqr", p, ckv)
        m = m_new
    out = (acc / denom.unsqueeze(-1)).permute(0, 2, 1, 3).reshape(b * tq, h, r)
    return out[out_index].to(q_lat.dtype)


def write_latents(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                  k_pe: torch.Tensor) -> None:
    """Stores each new token's [c_kv | k_pe] at its slot (block * block_size + offset)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype))
