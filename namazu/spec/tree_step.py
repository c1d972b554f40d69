"""The draft tree inside one rank's step (`--speculative-tree-budget N`): which sequences verify a tree, the
verify forward's tree inputs, the acceptance over the tree, and the move of the accepted path's latents.

To the engine a tree of N nodes is a verify of N drafts that accepts at most its depth D: it reserves
N + 1 slots, and the sequence's length moves by the n + 1 tokens the step emits, as for a chain; async
scheduling assumes D accepted (`max_accepted`, on both sides), and the worker's corrections move the next
plan back by D - n. Everything that makes it a tree is here, on the worker:
- `plan`: the sequences of this step whose held drafts are a tree (`store` marked their slots when the
  drafter drafted them); their verify rows keep the chain's cache slots (node i at the root's slot + i),
  while each row's rotary position becomes the root's plus the node's depth, its sampler counter the
  root's plus the depth (the output index its token would take), and the attention mask lets each row see
  its own ancestors only (`PagedAttentionMetadata.tree_mask`);
- `accept`: `tree_verify.verify_tree` over those rows, merged with the chain's decision for the others;
- `commit_path`: the accepted nodes' latents (target cache, drafter context cache) copied to the slots
  their positions name, before the drafter reads its context for the next block; rejected nodes stay past
  the sequence's end, never visible, overwritten when those positions are computed;
- `emitted_rows`: the logit row behind each emitted token (for logprobs);
- `store`: the drafter's next trees, their node tokens into the draft buffer (the verify inputs) and the
  rest (candidates and q per node) into per-slot buffers here;
- `path_tokens`: the drafts a node row's token follows (the node's own path), for the penalty rows' counts.
In graph mode the plan's host copies (`host_rope`, `host_mask`) go into a tree entry's buffers and the
compiled forward runs the step (worker/graph_mode.py); `accept`, `commit_path` and the next tree
(`Speculator._propose_tree`) stay eager after it, as a chain step's rest does when the compiled tail does
not cover it.
With a tree budget every drafted block is a tree, whatever the batch's sampling asks: what depends on the
path is filled per node row along that node's own path. Penalties count the output tokens plus the path's
drafts (`path_tokens`, in the runner's penalty rows); a grammar's mask row for node i is the grammar's
state after the root..i path (`structured/tree_masks.py`, filled by the engine, which knows the topology
from `step_topology`). A node whose token the grammar rejects has no mass in its parent's masked row, so
the rule never accepts it (at T > 0 it is a rejected draw, its q taken out of the later siblings' as any
rejected draw's; lossless for any q).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from namazu.layers.sampler import SamplingTensors, seeded_rows
from namazu.spec.tree import DEFAULT_RATES, DraftTree, TreeTopology
from namazu.spec.tree_verify import verify_tree

# Children per node: what bench/tree_acceptance.py measured the budgets with. Beyond the 4th draw a child's
# chance is under 2%, but at 48 nodes and more, 8-wide trees over 64 candidates accepted 1.25x the chain's
# tokens per verify step at T = 0.7 against 4-wide ones' 1.21x.
TREE_WIDTH = 8


@dataclass
class TreePlan:
    """This step's tree sequences: per sampling sequence (S) device tensors, and what `accept` found."""

    is_tree: torch.Tensor          # [S] bool
    num_nodes: torch.Tensor        # [S] nodes verified (the rows the engine planned, at most N)
    root_pos: torch.Tensor         # [S] the root's position (its row is the first sampled one)
    root_slot: torch.Tensor        # [S] its cache slot
    block_tables: torch.Tensor     # [S, M]
    chain_positions: torch.Tensor  # [N_tokens] positions as planned (the proposer counts from them)
    rope_positions: torch.Tensor   # [N_tokens] the forward's rotary positions (node rows: root + depth)
    tree_mask: torch.Tensor        # [B, Tq, Tq] bool, `PagedAttentionMetadata.tree_mask`
    chain_counters: torch.Tensor   # [R_rows] sampler counters as planned
    host_rope: np.ndarray | None = None       # rope_positions and tree_mask on the host: what graph mode
    host_mask: np.ndarray | None = None       # writes into a tree entry's buffers (`StepGraphs.load`)
    path: torch.Tensor | None = None          # [S, depth] accepted node per depth (-1 past n)
    num_accepted: torch.Tensor | None = None  # [S] 0 where the sequence verified a chain


def step_topology(budget: int, num_speculative_tokens: int, cfg, candidates: int = 0) -> TreeTopology:
    """The tree every drafted block has under `--speculative-tree-budget budget` with a DFlash2 drafter of
    config `cfg`: as deep as the drafter's block (and the measured rates) allow, up to TREE_WIDTH children
    drawn from `candidates` per position (`--speculative-tree-candidates`; never fewer than the selector's own
    K, which 0 names: fewer would only take choices away, and a default of 64 held a drafter trained on more
    to 64; at most the draft vocabulary). The worker's tree step and the engine (grammar rows, the assumed
    acceptance) both take it from here."""
    depth = min(num_speculative_tokens, cfg.num_draft_tokens, len(DEFAULT_RATES))
    kc = min(max(candidates, cfg.selector_k), cfg.draft_vocab_size or cfg.vocab_size)
    return TreeTopology.build(budget, depth, min(TREE_WIDTH, kc), candidates=kc)


def max_accepted(depths: tuple[int, ...], num_drafts: int) -> int:
    """The most drafts a verify of the first `num_drafts` nodes of a tree (`depths`: the topology's, root
    first) can accept: the depth of its deepest node (node order is by depth). What async scheduling assumes
    accepted, on the engine and on the worker alike."""
    return depths[min(num_drafts, len(depths) - 1)] if num_drafts > 0 else 0


class TreeStep:
    def __init__(self, topology: TreeTopology, block_size: int, device: torch.device):
        self.topology = topology
        self.tt = self.topology.tensors(device)
        self.rows = self.topology.num_nodes + 1
        self.depths = np.asarray(self.topology.depths, dtype=np.int64)
        self.ancestors = self.tt.ancestors.cpu().numpy()
        # Per node, the draft nodes of its path from the root (itself last, the root not included).
        self._paths = [np.flatnonzero(self.ancestors[i])[1:].tolist() for i in range(self.rows)]
        self.block_size, self.device = block_size, device
        self.held: set[int] = set()          # slots whose held drafts are a tree
        self._trees: DraftTree | None = None  # per slot: [slots, R], [slots, R], [slots, R, K], [slots, R, K]

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    def path_tokens(self, drafts: list[int], node: int) -> list[int]:
        """The held drafts (node tokens, node order) that node `node`'s row's token follows: its path from
        the root (a chain's row j follows drafts[:j])."""
        return [drafts[i - 1] for i in self._paths[node]]

    def max_accepted(self, num_drafts: np.ndarray) -> np.ndarray:
        """`max_accepted` per sequence (the engine's assumption of an async verify's outcome)."""
        return np.asarray([max_accepted(self.topology.depths, int(n)) for n in num_drafts], dtype=np.int64)

    def forget(self, slot: int) -> None:
        self.held.discard(slot)

    # -- before the forward ---------------------------------------------------------------------------
    def plan(self, b, prep, to_device) -> TreePlan | None:
        """The step's tree sequences, or None. Rewrites the sampler counters of their node rows in the batch
        (as async corrections do) and keeps the planned ones for the proposer; the rotary positions go to
        the plan (the planned ones stay in the batch: they name the rows' cache slots and causal limits).
        Host work only: a few rows per tree sequence."""
        nd = prep.num_drafts
        is_tree = np.asarray([int(slot) in self.held for slot in prep.slots], dtype=bool) & (nd > 0)
        if not is_tree.any():
            return None
        a, sq, sp, layout = b.attn, b.seqs, b.sampling, b.spec.row_layout
        rope, chain_counters = a.positions.copy(), sp.counters.copy()
        n_tok = sq.num_new + sq.num_drafts
        flat0 = np.cumsum(n_tok) - n_tok
        tq = a.q_index.shape[1]
        mask = np.ones((len(n_tok), tq, tq), dtype=bool)
        for s in np.flatnonzero(is_tree).tolist():
            i, m = int(b.spec.batch_index[s]), int(nd[s])
            d = self.depths[1:m + 1]
            first = flat0[i] + sq.num_new[i]
            rope[first:first + m] = prep.verify_from[s] + d
            sp.counters[layout[s, 1:m + 1]] = sp.counters[layout[s, 0]] + d
            o = int(sq.num_new[i]) - 1
            r = min(m + 1, tq - o)
            mask[i, o:o + r, o:o + r] = self.ancestors[:r, :r]
        tables = a.block_tables[b.spec.batch_index]
        root = prep.verify_from
        root_slot = tables[np.arange(len(root)), root // self.block_size] * self.block_size + root % self.block_size
        return TreePlan(is_tree=to_device(is_tree), num_nodes=to_device(nd), root_pos=to_device(root),
                        root_slot=to_device(root_slot), block_tables=to_device(tables),
                        chain_positions=to_device(a.positions), chain_counters=to_device(chain_counters),
                        rope_positions=to_device(rope), tree_mask=to_device(mask), host_rope=rope, host_mask=mask)

    # -- inside the step ------------------------------------------------------------------------------
    def accept(self, plan: TreePlan, processed: torch.Tensor, target: torch.Tensor, tokens: torch.Tensor,
               accepted: torch.Tensor, st: SamplingTensors, row_layout: torch.Tensor, slot_index: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's (tokens [S, K+1], accepted [S]) with the tree sequences' rows replaced by the tree's
        decision (`verify_tree`: greedy and seeded rows by exact match with the target's own sample at each
        node, the others by recursive rejection sampling with the drafter's q)."""
        k = row_layout.shape[1] - 1
        cols = torch.arange(self.rows, device=target.device).clamp(max=k)
        first = row_layout[:, 0]
        exact = (st.temperature[first] == 0) | seeded_rows(st.seeds[first])
        # A chain sequence's slot may lie past the tree buffers (a sequence that never drafted a tree).
        slot = torch.where(plan.is_tree, slot_index, 0)
        trees = DraftTree(*(x[slot] for x in self._trees))
        verdict = verify_tree(self.tt, trees, processed[row_layout[:, cols]], target[:, cols], exact,
                              st.seeds[first], st.counters[first], num_nodes=plan.num_nodes,
                              all_exact=bool(st.all_greedy))
        w = min(verdict.tokens.shape[1], k + 1)
        tree_tokens = tokens.clone()
        tree_tokens[:, :w] = verdict.tokens[:, :w]
        plan.path = verdict.path
        plan.num_accepted = torch.where(plan.is_tree, verdict.num_accepted, 0)
        return (torch.where(plan.is_tree.unsqueeze(-1), tree_tokens, tokens),
                torch.where(plan.is_tree, verdict.num_accepted, accepted))

    def commit_path(self, plan: TreePlan, target_kv: torch.Tensor, drafter_cache: torch.Tensor | None) -> None:
        """Node path[j] (at the root's slot + node) to the slot of position root + 1 + j, for j < n, in the
        target's latent stack [L, blocks, bs, D] and the drafter's context cache [L, 2, slots, H, D]. Past n
        (and on chain sequences) an entry copies the root's slot onto itself: fixed shapes, no host read."""
        depth = plan.path.shape[1]
        j = torch.arange(depth, device=plan.path.device)
        take = j < plan.num_accepted.unsqueeze(-1)                                         # [S, depth]
        bs = self.block_size

        def slot(pos: torch.Tensor) -> torch.Tensor:
            blocks = plan.block_tables.gather(1, (pos // bs).clamp(max=plan.block_tables.shape[1] - 1))
            return blocks * bs + pos % bs

        root = plan.root_pos.unsqueeze(-1)
        here = plan.root_slot.unsqueeze(-1).expand(-1, depth)
        src = torch.where(take, slot(root + plan.path.clamp_min(0)), here).flatten()
        dst = torch.where(take, slot(root + 1 + j), here).flatten()
        # Every source is read before any destination is written (a node's index is at least its depth, so
        # one row's source may be another's destination).
        flat = target_kv.view(target_kv.shape[0], -1, target_kv.shape[-1])
        flat.index_copy_(1, dst, flat.index_select(1, src))
        if drafter_cache is not None:
            drafter_cache.index_copy_(2, dst, drafter_cache.index_select(2, src))

    def emitted_rows(self, plan: TreePlan, row_layout: torch.Tensor) -> torch.Tensor:
        """[S, K+1] the logit row whose distribution each emitted token came from: a tree sequence's token j
        from the node at depth j of its accepted path (the root for j = 0); a chain's from row j."""
        k = row_layout.shape[1] - 1
        node = torch.cat([torch.zeros_like(plan.path[:, :1]), plan.path.clamp_min(0)], 1)
        node = torch.cat([node, node[:, -1:].expand(-1, max(0, k + 1 - node.shape[1]))], 1)[:, :k + 1]
        tree_rows = row_layout.gather(1, node.clamp(max=k))
        return torch.where(plan.is_tree.unsqueeze(-1), tree_rows, row_layout)

    # -- the next block -------------------------------------------------------------------------------
    def store(self, tree: DraftTree, slots: np.ndarray, slot_index: torch.Tensor, num_slots: int) -> torch.Tensor:
        """Keeps each sequence's tree by slot; returns the node tokens [S, N], what the draft buffer holds
        (the verify rows' inputs, in node order)."""
        if self._trees is None or self._trees.tokens.shape[0] < num_slots:
            grow = max(num_slots, 2 * (self._trees.tokens.shape[0] if self._trees is not None else 0))
            new = DraftTree(*(torch.zeros(grow, *x.shape[1:], dtype=x.dtype, device=x.device) for x in tree))
            if self._trees is not None:
                for dst, src in zip(new, self._trees):
                    dst[:src.shape[0]] = src
            self._trees = new
        for buf, x in zip(self._trees, tree):
            buf[slot_index] = x
        self.held.update(int(s) for s in slots)
        return tree.tokens[:, 1:]
