"""One decision per step under tensor parallelism: rank 0's sampled tokens, acceptance counts and
drafts (a chain's, or a draft tree's nodes and what its acceptance rule reads), broadcast to every rank.

Every rank computes the same logits up to the order of floating-point sums, and so would almost always
sample the same tokens by itself; "almost" is the problem. If one rank accepted a different number of
drafts, its KV cache and token history would drift from the others' and the ranks would stall or
disagree from then on. So the ranks never decide on their own: rank 0's result is the one every rank
commits. The broadcasts run on the device inside the step (no host read).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from namazu.distributed.group import broadcast
from namazu.spec.proposer import Proposal
from namazu.spec.tree import DraftTree


def share_decision(tokens: torch.Tensor, accepted: torch.Tensor, size: int, path: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """tokens [S, K+1], accepted [S] and, for a step that verified draft trees, each sequence's accepted
    path [S, D] (`tree_step.TreePlan.path`: which node's latents move where) -> rank 0's, on every rank, in
    one broadcast. A rank that moved its own path's latents would hold another cache than rank 0's."""
    k = tokens.shape[1]
    parts = [tokens, accepted.to(tokens.dtype).unsqueeze(1)] + ([path.to(tokens.dtype)] if path is not None else [])
    packed = torch.cat(parts, dim=1).contiguous()
    broadcast(packed, size)
    shared_path = packed[:, k + 1:].to(path.dtype) if path is not None else None
    return packed[:, :k], packed[:, k].to(accepted.dtype), shared_path


def share_device_tree(tree: DraftTree, size: int) -> DraftTree:
    """A drafter's trees -> rank 0's on every rank (two broadcasts: the integer tables, q). Every rank
    feeds the node tokens to its shard of the verify forward, and the acceptance rule reads the rest."""
    s, r, kc = tree.child_ids.shape
    ints = torch.cat([tree.tokens.long(), tree.cand_index.long(), tree.child_ids.long().flatten(1)], 1).contiguous()
    broadcast(ints, size)
    q = broadcast(tree.child_q.contiguous(), size)
    return DraftTree(ints[:, :r].to(tree.tokens.dtype), ints[:, r:2 * r].to(tree.cand_index.dtype),
                     ints[:, 2 * r:].view(s, r, kc).to(tree.child_ids.dtype), q)


def share_device_proposal(proposal: Proposal, size: int) -> Proposal:
    """A device proposer's drafts (ids [S, k], counts [S], probs [S, k, V]) -> rank 0's on every rank.
    When the proposal says where its probs can be non-zero (`support` [S, k, K]), only those K values per
    position travel, and every other rank rebuilds the same [S, k, V] (zero elsewhere): at a 163,840-token
    vocabulary that is 5,120 times fewer bytes for 32 candidates."""
    ids = proposal.ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError("a device proposer returns draft ids as a tensor")
    s, k = ids.shape
    counts = proposal.counts if proposal.counts is not None else torch.full(
        (s,), k, dtype=torch.long, device=ids.device)
    probs, support = proposal.probs, proposal.support
    sparse = isinstance(probs, torch.Tensor) and support is not None
    parts = [ids.long(), counts.long().unsqueeze(1)] + ([support.long().flatten(1)] if sparse else [])
    packed = torch.cat(parts, dim=1).contiguous()
    broadcast(packed, size)
    shared_support = None
    if sparse:
        shared_support = packed[:, k + 1:].view(s, k, -1).to(support.dtype)
        values = broadcast(probs.gather(-1, support.long()).contiguous(), size)
        if dist.get_rank() != 0:        # rank 0's own q is what the others rebuild
            probs = torch.zeros_like(probs).scatter_(-1, shared_support.long(), values)
    elif isinstance(probs, torch.Tensor):
        probs = broadcast(probs.contiguous(), size)
    return dataclasses.replace(proposal, ids=packed[:, :k].to(ids.dtype), counts=packed[:, k], probs=probs,
                               support=shared_support)
