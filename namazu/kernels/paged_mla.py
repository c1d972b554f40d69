"""Absorbed MLA attention over the paged latent cache, reading keys through the block table.

The cache of one layer is [num_blocks, block_size, r + dr]: the normed latent c_kv and the rotated rope
key k_pe of each token. A step's queries (prefill chunks, decodes, verify rows) are laid out per
sequence as [B, Tq] (padded), and the op walks each sequence's block table a tile of blocks at a time
with an online softmax, so it never gathers a sequence's whole cache: memory per iteration is
B x tile x (r + dr). Visibility is causal by position (key position <= query position); block-table
padding and positions past a sequence's end are never visible because they lie beyond its queries.
Matches `namazu.layers.mla.latent_attention_ref` (tests/kernels/test_paged_mla.py).
"""
from __future__ import annotations

import torch

# A finite "minus infinity": a padded query row (no visible key) stays finite instead of becoming NaN.
_MASKED = -1e30


def paged_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_index: torch.Tensor, q_pos: torch.Tensor,
                           out_index: torch.Tensor, kv_lora_rank: int, scale: float,
                           tile_tokens: int | None = 256) -> torch.Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr]: the step's flat queries.
    kv_cache [num_blocks, bs, r + dr] (this layer), block_tables [B, M] int64.
    q_index [B, Tq]: flat query of each (sequence, slot) (padding: any valid index);
    q_pos [B, Tq]: its position (padding: -1); out_index [N]: each flat query's slot in B * Tq.
    `tile_tokens` None: the whole table as one tile, with no Python control flow over its width (what
    a compiled graph traces, the width being a dynamic dimension there).
    Returns o_lat [N, H, r] in q_lat's dtype."""
    b, tq = q_index.shape
    bs, d = kv_cache.shape[1], kv_cache.shape[2]
    r = kv_lora_rank
    h = q_lat.shape[1]
    # [q_lat | q_pe] against the cached [c_kv | k_pe]: one matmul gives both score terms.
    q = torch.cat([q_lat, q_pe], dim=-1).float()[q_index].view(b, tq * h, d)
    num_table_blocks = block_tables.shape[1]
    one_tile = tile_tokens is None
    blocks_per_tile = num_table_blocks if one_tile else max(1, tile_tokens // bs)
    m = denom = acc = None
    for t0 in [0] if one_tile else range(0, num_table_blocks, blocks_per_tile):
        tile = block_tables if one_tile else block_tables[:, t0:t0 + blocks_per_tile]   # [B, nb]
        kv = kv_cache[tile].float().view(b, -1, d)                      # [B, K, r + dr]
        s = torch.matmul(q, kv.transpose(1, 2)).view(b, tq, h, -1) * scale
        k_pos = t0 * bs + torch.arange(kv.shape[1], device=q.device)
        visible = (k_pos <= q_pos.unsqueeze(-1)).unsqueeze(2)          # [B, Tq, 1, K]
        s = s.masked_fill(~visible, _MASKED)
        if one_tile or num_table_blocks <= blocks_per_tile:             # one tile: plain softmax
            p = torch.softmax(s, dim=-1).view(b, tq * h, -1)
            out = torch.matmul(p, kv[..., :r])
            return out.view(b * tq, h, r)[out_index].to(q_lat.dtype)
        tile_max = s.amax(dim=-1)
        m_new = tile_max if m is None else torch.maximum(m, tile_max)
        p = torch.exp(s - m_new.unsqueeze(-1))
        pv = torch.matmul(p.view(b, tq * h, -1), kv[..., :r]).view(b, tq, h, r)
        if m is None:
            denom, acc = p.sum(dim=-1), pv
        else:
            alpha = torch.exp(m - m_new)
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    out = acc / denom.unsqueeze(-1)
    return out.reshape(b * tq, h, r)[out_index].to(q_lat.dtype)


def write_latents(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                  k_pe: torch.Tensor) -> None:
    """Stores each new token's [c_kv | k_pe] at its slot (block * block_size + offset)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype))
