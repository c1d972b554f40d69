"""Rank 0's drafts on every rank, with the draft distributions sent as their candidates' values only
(`distributed/decisions.share_device_proposal`), in a real two-rank gloo group."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from namazu.distributed.decisions import share_device_proposal
from namazu.spec.proposer import Proposal

S, K, V, C = 3, 4, 5000, 8


def _proposal(rank: int) -> Proposal:
    """A different proposal per rank: its own drafts, counts, candidates and q over them."""
    g = torch.Generator().manual_seed(100 + rank)
    support = torch.stack([torch.randperm(V, generator=g)[:C] for _ in range(S * K)]).view(S, K, C)
    q = torch.rand(S, K, C, generator=g).softmax(-1)
    probs = torch.zeros(S, K, V).scatter_(-1, support, q)
    ids = support[..., 0]
    counts = torch.randint(1, K + 1, (S,), generator=g)
    return Proposal(ids, counts=counts, probs=probs, support=support)


def _rank(rank: int, path: str, out: str, sparse: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    sent = []
    real = dist.broadcast

    def counting(x, src, *a, **kw):
        sent.append(x.numel() * x.element_size())
        return real(x, src, *a, **kw)

    dist.broadcast = counting
    try:
        mine = _proposal(rank)
        if not sparse:
            mine = Proposal(mine.ids, counts=mine.counts, probs=mine.probs)
        got = share_device_proposal(mine, 2)
        torch.save({"ids": got.ids, "counts": got.counts, "probs": got.probs, "support": got.support,
                    "bytes": sum(sent)}, f"{out}.{rank}")
    finally:
        dist.broadcast = real
        dist.destroy_process_group()


def _share(tmp_path, sparse: bool) -> list[dict]:
    out = str(tmp_path / ("sparse" if sparse else "dense"))
    mp.spawn(_rank, args=(str(tmp_path / f"group-{sparse}"), out, sparse), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def test_every_rank_gets_rank0s_drafts_and_q_from_the_candidates_values_only(tmp_path):
    ref = _proposal(0)
    got = _share(tmp_path, sparse=True)
    # Exact on any machine: the broadcast copies integers and values, never sums them, and `_proposal` runs
    # the same ops on the same shapes in every process.
    for r in got:
        assert torch.equal(r["ids"], ref.ids) and torch.equal(r["counts"], ref.counts)
        assert torch.equal(r["support"], ref.support)
        assert torch.equal(r["probs"], ref.probs)
    dense = _share(tmp_path, sparse=False)
    assert all(torch.equal(r["probs"], ref.probs) for r in dense)
    # What rank 0 sends: ids, counts and candidates as int64, C fp32 values per position; not S x K x V.
    assert got[0]["bytes"] == S * (K + 1 + K * C) * 8 + S * K * C * 4
    assert dense[0]["bytes"] >= S * K * V * 4
