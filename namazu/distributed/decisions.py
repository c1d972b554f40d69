"""One decision per step under tensor parallelism: rank 0's sampled tokens, acceptance counts and
drafts, broadcast to every rank.

Every rank computes the same logits up to the order of floating-point sums, and so would almost always
sample the same tokens by itself; "almost" is the problem. If one rank accepted a different number of
drafts, its KV cache and token history would drift from the others' and the ranks would stall or
disagree from then on. So the ranks never decide on their own: rank 0's result is the one every rank
commits. The broadcasts run on the device inside the step (no host read).
"""
from __future__ import annotations

import dataclasses

import torch

from namazu.distributed.group import broadcast
from namazu.spec.proposer import Proposal


def share_decision(tokens: torch.Tensor, accepted: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [S, K+1], accepted [S] -> rank 0's, on every rank (one broadcast)."""
    packed = torch.cat([tokens, accepted.to(tokens.dtype).unsqueeze(1)], dim=1).contiguous()
    broadcast(packed, size)
    return packed[:, :-1], packed[:, -1].to(accepted.dtype)


def share_device_proposal(proposal: Proposal, size: int) -> Proposal:
    """A device proposer's drafts (ids [S, k], counts [S], probs [S, k, V]) -> rank 0's on every rank."""
    ids = proposal.ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError("a device proposer returns draft ids as a tensor")
    counts = proposal.counts if proposal.counts is not None else torch.full(
        (ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device)
    packed = torch.cat([ids.long(), counts.long().unsqueeze(1)], dim=1).contiguous()
    broadcast(packed, size)
    probs = proposal.probs
    if isinstance(probs, torch.Tensor):
        probs = broadcast(probs.contiguous(), size)
    return dataclasses.replace(proposal, ids=packed[:, :-1].to(ids.dtype), counts=packed[:, -1], probs=probs)
