"""The step's data-dependent kernels as torch custom ops with shape functions, so torch.compile traces
the whole decode / verify forward as one graph instead of breaking (or failing) at them.

- `namazu::paged_mla`: absorbed MLA attention through the block table (kernels/paged_mla.py). Its walk
  over block tiles is Python control flow over the table's width; as an op it is one node whose output
  shape is known from the inputs alone. (Graph mode traces the one-tile form instead where the ladder's
  widest table is small: step_graphs.TRACED_ATTENTION_BYTES.)
- `namazu::write_latents`: stores a step's latents at their cache slots (mutates the cache in place).
- `namazu::moe_grouped_mm`: the routed experts' grouped-GEMM path (sort by expert, two grouped GEMMs,
  weighted sum). torch's own `grouped_mm` has a fake implementation that accepts only bf16, so tracing
  an fp32 model through it fails; the op hides it behind a shape function that holds for every dtype.
- `namazu::moe_grouped_mm_ws`: the same computation into a ladder entry's MoE workspace
  (kernels/moe_workspace.py): every intermediate and the result are the workspace's buffers, which it
  declares mutated; graph mode uses it when the entry has a workspace.

Each fake implementation returns an empty tensor of the output's shape and dtype; the real one runs
the eager kernel. Callers go through the op only while torch.compile traces (`torch.compiler.
is_compiling()`): eager steps call the same functions directly, because a custom op's Python dispatch
costs tens of microseconds a call, about 15% of a batch-1 decode step of namazu-tiny.
"""
from __future__ import annotations

import torch

from namazu.kernels.moe_types import sort_by_expert
from namazu.kernels.moe_workspace import MoEWorkspace, moe_grouped_mm_into
from namazu.kernels.paged_mla import paged_latent_attention, write_latents


@torch.library.custom_op("namazu::paged_mla", mutates_args=())
def paged_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
              q_index: torch.Tensor, q_pos: torch.Tensor, out_index: torch.Tensor, kv_lora_rank: int,
              scale: float, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    return paged_latent_attention(q_lat, q_pe, kv_cache, block_tables, q_index, q_pos, out_index,
                                  kv_lora_rank, scale, tree_mask=tree_mask)


@paged_mla.register_fake
def _paged_mla_fake(q_lat, q_pe, kv_cache, block_tables, q_index, q_pos, out_index, kv_lora_rank, scale,
                    tree_mask=None):
    return q_lat.new_empty(out_index.shape[0], q_lat.shape[1], kv_lora_rank)


@torch.library.custom_op("namazu::write_latents", mutates_args=("kv_cache",))
def write_latents_op(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                     k_pe: torch.Tensor) -> None:
    write_latents(kv_cache, slot_mapping, c_kv, k_pe)


@write_latents_op.register_fake
def _write_latents_fake(kv_cache, slot_mapping, c_kv, k_pe):
    return None


def moe_grouped_mm_eager(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor) -> torch.Tensor:
    """x [N, H], topk_ids [N, k], topk_weights [N, k], w13 [E, 2I, H], w2 [E, H, I] -> [N, H] in x's dtype."""
    n, k = topk_ids.shape
    order, _, offsets = sort_by_expert(topk_ids, w13.shape[0])
    offs = offsets[1:].to(torch.int32)
    xs = x[order // k]
    gate, up = torch.nn.functional.grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out_sorted = torch.nn.functional.grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    # Un-permute by scatter (deterministic, unlike index_add_ on GPU), then the weighted top-k sum.
    out_pairs = torch.empty_like(out_sorted)
    out_pairs[order] = out_sorted
    w = topk_weights.to(torch.float32).unsqueeze(-1)
    return (out_pairs.view(n, k, -1).float() * w).sum(1).to(x.dtype)


@torch.library.custom_op("namazu::moe_grouped_mm", mutates_args=())
def moe_grouped_mm(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    return moe_grouped_mm_eager(x, topk_ids, topk_weights, w13, w2)


@moe_grouped_mm.register_fake
def _moe_grouped_mm_fake(x, topk_ids, topk_weights, w13, w2):
    return x.new_empty(x.shape)


@torch.library.custom_op("namazu::moe_grouped_mm_ws", mutates_args=("ws",))
def moe_grouped_mm_ws(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, ws: list[torch.Tensor]) -> None:
    moe_grouped_mm_into(MoEWorkspace.view(ws), x, topk_ids, topk_weights, w13, w2)


@moe_grouped_mm_ws.register_fake
def _moe_grouped_mm_ws_fake(x, topk_ids, topk_weights, w13, w2, ws):
    return None
