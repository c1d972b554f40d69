"""Draft trees: a static topology per verify bucket, and the tree of each sequence drafted into it.

A step verifies, per drafted sequence, `1 + N` rows: the root (the last verified token, whose row the
target scores anyway) and N draft nodes, at most `depth` deep, at most `width` children per node. The
topology (who is whose parent, and which draw of its parent each node is) is the same for every sequence
of a bucket and fixed before the step, so a compiled graph can capture the step with it: everything
per sequence is a tensor of fixed shape, filled on the device without a host read.

Node order is by depth, then by parent, then by rank (the rank-th draw among its siblings): the nodes of
one depth are a contiguous range, every parent comes before its children, and a node's index is at least
its depth. `ancestors[i, j]` is True where node j is node i or one of its ancestors: the tree-attention
mask of the verify forward (`kernels/paged_mla.py`, `tree_mask`).

Children are drawn from the drafter's distribution q at their parent (for DFlash2 the selector's softmax
over the position's K candidates after the parent's token, tempered like the chain's walk): at T = 0 the
top-W by score, at T > 0 W draws without replacement, taken at once as the top-W of score / T + Gumbel
noise (the order of those keys is the order of sequential draws without replacement). Each node keeps
its children's q over their candidates; the acceptance rule (`spec/tree_verify.py`) derives the residuals
of the later siblings from it as it rejects the earlier ones.

`TreeTopology.build` picks the shape: the N nodes of largest expected acceptance, given the chance that the
r-th draw at depth d is accepted (`rates[d][r]`, measured by `bench/tree_acceptance.py`). Taking the best
nodes one at a time is optimal when a node's chance never exceeds its parent's or its older sibling's,
which holds for these products.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from namazu.layers.sampler import gumbel_noise

# Noise stream of the tree's draws (the sampler uses 0-2, the chain's walk 3): a seeded request drafts
# reproducibly.
STREAM_TREE_DRAFT = 4

# The chance that the r-th draw at depth d is accepted when its parent is on the accepted path (rows: depth
# 1..6, columns: rank 0..7), of namazu-tiny's shipped drafter at T = 0.7, children drawn from its top 64
# candidates, on the 110 held-out requests captured at 0.7 (`python bench/tree_acceptance.py --requests
# CAPTURE --candidates 64 --widths 8`, its "chance that the rank-r child is accepted" table; bench/RESULTS.md,
# issue 30). Only their order matters for the shape a budget gets; a drafter of another shape, or another
# temperature, should pass its own.
DEFAULT_RATES = (
    (0.632, 0.072, 0.034, 0.021, 0.015, 0.010, 0.007, 0.006),
    (0.553, 0.067, 0.033, 0.020, 0.013, 0.010, 0.008, 0.006),
    (0.522, 0.071, 0.032, 0.019, 0.012, 0.011, 0.008, 0.007),
    (0.502, 0.072, 0.033, 0.019, 0.013, 0.009, 0.008, 0.007),
    (0.486, 0.073, 0.032, 0.019, 0.013, 0.010, 0.008, 0.006),
    (0.461, 0.073, 0.033, 0.022, 0.015, 0.011, 0.008, 0.006),
)


@dataclass(frozen=True)
class TreeTopology:
    """The static shape of a draft tree; node 0 is the root."""

    parents: tuple[int, ...]          # [1 + N], the root's is -1
    # How many of the drafter's candidates per position the children are drawn from (0: its selector's
    # own K). More candidates hold more of the target's distribution at T > 0 (64: 0.85 of p_T at depth
    # 1 at T = 0.7, 32: 0.81), which only a tree's later siblings can use.
    candidates: int = 0

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a tree topology starts with its root (parent -1)")
        if self.candidates < 0:
            raise ValueError(f"candidates must be >= 0 (0: the drafter's selector_k), got {self.candidates}")
        last = (0, -1)
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be an earlier node")
            key = (self.depths[p], p)
            if key < last:
                raise ValueError(f"node {i}: nodes must be ordered by depth, then parent")
            last = key

    @property
    def num_nodes(self) -> int:
        """Draft nodes, the root not counted (verify rows: num_nodes + 1)."""
        return len(self.parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0]
        for p in self.parents[1:]:
            d.append(d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def ranks(self) -> tuple[int, ...]:
        seen: dict[int, int] = {}
        out = [0]
        for p in self.parents[1:]:
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return tuple(out)

    @property
    def width(self) -> int:
        return max(self.ranks) + 1 if self.num_nodes else 0

    @classmethod
    def chain(cls, k: int) -> TreeTopology:
        """k drafts in a row: today's chain."""
        return cls(tuple(range(-1, k)))

    @classmethod
    def build(cls, budget: int, depth: int, width: int,
              rates: tuple[tuple[float, ...], ...] | None = None, candidates: int = 0) -> TreeTopology:
        """The `budget` nodes of largest expected acceptance (module docstring), at most `depth` deep and
        `width` children per node, drawn from `candidates` per position (0: the drafter's selector_k).
        `rates[d][r]`: the chance the r-th draw at depth d + 1 is accepted."""
        if budget < 1 or depth < 1 or width < 1:
            raise ValueError(f"a draft tree needs budget, depth and width >= 1 (got {budget}, {depth}, {width})")
        rates = rates or DEFAULT_RATES
        if len(rates) < depth or any(len(r) < width for r in rates[:depth]):
            raise ValueError(f"rates must cover depth {depth} x width {width}")
        # (negated value, tie-break order, parent's provisional id, depth, rank); the root is id 0.
        nodes = [(-1, 0, 0)]          # (parent provisional id, depth, rank)
        value = [1.0]
        frontier = [(-rates[0][0], 0, 0, 1, 0)]
        order = 1
        while frontier and len(nodes) <= budget:
            neg, _, parent, d, r = heapq.heappop(frontier)
            nodes.append((parent, d, r))
            value.append(-neg)
            me = len(nodes) - 1
            if r + 1 < width:
                heapq.heappush(frontier, (-value[parent] * rates[d - 1][r + 1], order, parent, d, r + 1))
                order += 1
            if d < depth:
                heapq.heappush(frontier, (-value[me] * rates[d][0], order, me, d + 1, 0))
                order += 1
        # Renumber by (depth, parent's new id, rank).
        new_id = {0: 0}
        ordered = [0]
        by_depth: dict[int, list[int]] = {}
        for i in range(1, len(nodes)):
            by_depth.setdefault(nodes[i][1], []).append(i)
        for d in sorted(by_depth):
            for i in sorted(by_depth[d], key=lambda i: (new_id[nodes[i][0]], nodes[i][2])):
                new_id[i] = len(ordered)
                ordered.append(i)
        return cls(tuple(-1 if i == 0 else new_id[nodes[i][0]] for i in ordered), candidates)

    def tensors(self, device: torch.device | str = "cpu") -> TreeTensors:
        """The device tensors a step reads: build once per bucket and keep (a captured graph must not
        create them)."""
        n = len(self.parents)
        depths, ranks, parents = self.depths, self.ranks, self.parents
        w = max(self.width, 1)
        children = torch.full((n, w), -1, dtype=torch.long)
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:
                children[p, ranks[i]] = i
                anc[i] = anc[p]
                anc[i, i] = True
        levels = []
        for d in range(self.depth):
            start = depths.index(d)
            end = depths.index(d + 1)
            kids = [i for i in range(end, n) if depths[i] == d + 1]
            levels.append(Level(start, end, kids[0], kids[-1] + 1,
                                torch.arange(start, end, device=device),
                                torch.tensor([parents[i] - start for i in kids], device=device),
                                torch.tensor([ranks[i] for i in kids], device=device)))
        t = lambda x: torch.tensor(x, device=device)  # noqa: E731
        return TreeTensors(self, t(parents), t(depths), t(ranks), children.to(device), anc.to(device),
                           (t(depths) - 1).clamp_min(0), tuple(levels))


class Level(NamedTuple):
    """The parents at one depth (nodes [start, end)) and their children (nodes [kid_start, kid_end))."""

    start: int
    end: int
    kid_start: int
    kid_end: int
    nodes: torch.Tensor         # [P] the parents' node indices
    kid_parent: torch.Tensor    # [C] each child's parent, counted from `start`
    kid_rank: torch.Tensor      # [C] and its rank among its siblings


class TreeTensors(NamedTuple):
    topology: TreeTopology
    parents: torch.Tensor      # [R] int64 (R = 1 + N rows), -1 at the root
    depths: torch.Tensor       # [R]
    ranks: torch.Tensor        # [R]
    children: torch.Tensor     # [R, W] node of each rank, -1 where none
    ancestors: torch.Tensor    # [R, R] bool: j is i or an ancestor of i
    block_pos: torch.Tensor    # [R] the drafted block position of each node's token (root: 0, unused)
    levels: tuple[Level, ...]  # per depth d = 0 .. depth - 1: the parents there and their children


class DraftTree(NamedTuple):
    """One tree per sequence, in a topology's node order (node 0 = the root)."""

    tokens: torch.Tensor       # [S, R] each node's token (the root's: the anchor)
    cand_index: torch.Tensor   # [S, R] each node's index among its position's candidates (root: 0)
    child_ids: torch.Tensor    # [S, R, K] the candidates a node's children are drawn from (leaves: any)
    child_q: torch.Tensor      # [S, R, K] q over them (fp32, sums to 1; leaves and greedy rows: unused)


def draft_tree(tt: TreeTensors, cand: torch.Tensor, first: torch.Tensor, pairs: torch.Tensor,
               anchor: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor,
               counters: torch.Tensor, scale: list[float] | None = None, greedy_candidates: int = 0) -> DraftTree:
    """Drafts each sequence's tree from the selector's tables (`DFlashDrafter.selector_tables`: cand
    [S, k, K], first [S, K], pairs [S, k-1, K, K], k >= the tree's depth). temperature [S] (None or 0 on a
    row: greedy, children the top-W by score); seeds [S] and counters [S] (the output index the first draft
    takes) seed the draws; scale: the drafter's `q_temperature_scale` per position (None: 1);
    `greedy_candidates`: greedy rows pick their top-W among the first this many candidates only (0: all). A
    selector scores candidates beyond the K it was trained on noisily: at T = 0 the engine's trees over 64
    accepted 3% less than over 32, where at T = 0.7 the extra candidates pay (bench/RESULTS.md, issue 30)."""
    topo = tt.topology
    s, k, kc = cand.shape
    depth, width, r = topo.depth, topo.width, len(topo.parents)
    if depth > k:
        raise ValueError(f"a tree of depth {depth} needs {depth} drafted positions, the block has {k}")
    if width > kc:
        raise ValueError(f"a tree of width {width} needs at least {width} candidates per position, there are {kc}")
    if 0 < greedy_candidates < width:
        raise ValueError(f"greedy rows of a tree of width {width} need at least {width} candidates, "
                         f"not {greedy_candidates}")
    scale = scale or [1.0] * k
    dev = cand.device
    sampled = None if temperature is None else temperature > 0
    # Greedy rows' keys: -inf past the first `greedy_candidates`, so their top-W stays among them.
    beyond = torch.arange(kc, device=dev) >= greedy_candidates if 0 < greedy_candidates < kc else None
    noise = None
    if sampled is not None:
        # One Gumbel key per (node, candidate): the children of every node are drawn at once.
        noise = gumbel_noise(seeds, counters, r * kc, STREAM_TREE_DRAFT).view(s, r, kc)
    cand_index = torch.zeros(s, r, dtype=torch.long, device=dev)
    child_ids = torch.zeros(s, r, kc, dtype=torch.long, device=dev)
    child_q = torch.zeros(s, r, kc, dtype=torch.float32, device=dev)
    for d, lv in enumerate(tt.levels):
        if d == 0:
            scores = first.unsqueeze(1)                                          # [S, 1, K]
        else:
            rows = cand_index[:, lv.start:lv.end]                                # [S, P]
            scores = pairs[:, d - 1].gather(1, rows.unsqueeze(-1).expand(-1, -1, kc))
        child_ids[:, lv.start:lv.end] = cand[:, d].unsqueeze(1)
        keys = scores if beyond is None else scores.masked_fill(beyond, float("-inf"))
        if sampled is not None:
            t = (temperature.float().clamp_min(1e-6) * scale[d]).view(s, 1, 1)
            child_q[:, lv.start:lv.end] = (scores / t).softmax(-1)
            keys = torch.where(sampled.view(s, 1, 1), scores / t + noise[:, lv.nodes], keys)
        else:
            child_q[:, lv.start:lv.end] = scores.softmax(-1)
        picks = keys.topk(width, dim=-1).indices                                 # [S, P, W]
        cand_index[:, lv.kid_start:lv.kid_end] = picks[:, lv.kid_parent, lv.kid_rank]
    tokens = cand[:, tt.block_pos].gather(2, cand_index.unsqueeze(-1)).squeeze(-1)
    tokens[:, 0] = anchor
    return DraftTree(tokens, cand_index, child_ids, child_q)


def tree_positions(tt: TreeTensors, root_pos: torch.Tensor) -> torch.Tensor:
    """The position (RoPE) of every verify row [S, R]: the root's plus the node's depth. A row's cache slot
    is the root's slot plus its node index instead (the rows are stored in node order)."""
    return root_pos.unsqueeze(-1) + tt.depths


def tree_block_mask(tt: TreeTensors, is_tree: torch.Tensor, tq: int) -> torch.Tensor:
    """The in-block mask of a step's queries [B, Tq, Tq] for `paged_latent_attention(tree_mask=...)`: a
    tree sequence's R rows (its first R query slots) see their own ancestors; every other sequence's
    queries are left to the causal rule alone."""
    r = tt.ancestors.shape[0]
    mask = torch.ones(is_tree.shape[0], tq, tq, dtype=torch.bool, device=is_tree.device)
    anc = torch.ones(tq, tq, dtype=torch.bool, device=is_tree.device)
    anc[:r, :r] = tt.ancestors
    return torch.where(is_tree.view(-1, 1, 1), anc, mask)
