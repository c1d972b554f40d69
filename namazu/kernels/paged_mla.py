"""Absorbed MLA attention over the paged latent cache, reading keys through the block table.

The cache of one layer is [num_blocks, block_size, r + dr]: the normed latent c_kv and the rotated rope
key k_pe of each token. A step's queries (prefill chunks, decodes, verify rows) are laid out per
sequence as [B, Tq] (padded), and the op walks each sequence's block table a tile of blocks at a time
with an online softmax, so it never gathers a sequence's whole cache: memory per iteration is
B x tile x (r + dr). Visibility is causal by position (key position <= query position); block-table
padding and positions past a sequence's end are never visible because they lie beyond its queries.
Matches `namazu.layers.mla.latent_attention_ref` (tests/kernels/test_paged_mla.py).

Tree verification (`spec/tree.py`) adds an in-block mask: a sequence's verify rows are the nodes of its
draft tree, stored at consecutive slots from the root's in node order, and each row may see the context
(every slot before its sequence's first query) and, among its own step's queries, only its ancestors and
itself (`tree_mask`). "Position" here is the slot's index in the sequence's table; a tree row's rotary
position (its depth past the root) is applied to q_pe / k_pe before, so the two may differ. After the
step `commit_path` moves the accepted path's latents to the slots their positions name, in order.
"""
from __future__ import annotations

import torch

# A finite "minus infinity": a padded query row (no visible key) stays finite instead of becoming NaN.
_MASKED = -1e30


def paged_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_index: torch.Tensor, q_pos: torch.Tensor,
                           out_index: torch.Tensor, kv_lora_rank: int, scale: float,
                           tile_tokens: int | None = 256, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr]: the step's flat queries.
    kv_cache [num_blocks, bs, r + dr] (this layer), block_tables [B, M] int64.
    q_index [B, Tq]: flat query of each (sequence, slot) (padding: any valid index);
    q_pos [B, Tq]: its position (padding: -1); out_index [N]: each flat query's slot in B * Tq.
    `tile_tokens` None: the whole table as one tile, with no Python control flow over its width (what
    a compiled graph traces, the width being a dynamic dimension there).
    tree_mask [B, Tq, Tq] bool (None: causal only): query slot t of sequence b sees key slot
    q_pos[b, 0] + j of its own step's queries only where tree_mask[b, t, j]; keys before q_pos[b, 0]
    (the context) stay visible. All True leaves a sequence causal.
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
        visible = k_pos <= q_pos.unsqueeze(-1)                          # [B, Tq, K]
        if tree_mask is not None:
            visible = visible & _in_block_visible(tree_mask, q_pos, k_pos)
        visible = visible.unsqueeze(2)                                   # [B, Tq, 1, K]
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


def _in_block_visible(tree_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[B, Tq, K]: whether each key of a tile is allowed by the in-block mask (context keys always)."""
    tq = tree_mask.shape[1]
    rel = k_pos - q_pos[:, :1]                                           # [B, K] slot past the first query
    inside = (rel >= 0) & (rel < tq)
    allowed = tree_mask.gather(2, rel.clamp(0, tq - 1).unsqueeze(1).expand(-1, tq, -1))
    return ~inside.unsqueeze(1) | allowed


def path_slots(block_tables: torch.Tensor, block_size: int, root_pos: torch.Tensor, path: torch.Tensor,
               num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence's accepted tree nodes are and where they belong: node path[b, j] (stored at slot
    index root_pos + node) belongs at root_pos + 1 + j, for j < num_accepted[b]. Returns (src, dst) cache
    slots [B * depth] for `move_slots`; entries past num_accepted name one slot twice (a no-op copy), so
    the shapes are fixed and nothing is read back to the host. Rejected nodes stay where they were, past
    the sequence's end: never visible, overwritten when those positions are computed."""
    depth = path.shape[1]
    j = torch.arange(depth, device=path.device)
    dst_pos = root_pos.unsqueeze(-1) + 1 + j
    src_pos = torch.where(j < num_accepted.unsqueeze(-1), root_pos.unsqueeze(-1) + path.clamp_min(0), dst_pos)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        blocks = block_tables.gather(1, (pos // block_size).clamp(max=block_tables.shape[1] - 1))
        return (blocks * block_size + pos % block_size).flatten()

    return slot(src_pos), slot(dst_pos)


def move_slots(cache: torch.Tensor, dim: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies slots src to dst along `dim` of a view whose `dim` is the cache's slots (e.g. the layer
    stack `kv.view(L, -1, D)` with dim 1, the drafter's context cache with dim 2). Every source is read
    before any destination is written: a node's index is at least its depth, so one row's source may be
    another's destination."""
    cache.index_copy_(dim, dst, cache.index_select(dim, src))


def write_latents(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                  k_pe: torch.Tensor) -> None:
    """Stores each new token's [c_kv | k_pe] at its slot (block * block_size + offset)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype))
