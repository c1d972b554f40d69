"""The acceptance rule over a draft tree: recursive rejection sampling over siblings, lossless at any T.

The target scores every node of each sequence's tree (`spec/tree.py`) in one verify forward, each row
seeing the context and its own ancestors. Walking down from the root, at the current node (the target's
distribution there p, after temperature, top-k/top-p/min-p, penalties and the grammar mask: `processed`),
its children x_1 .. x_w were drawn without replacement from the drafter's q at that node:

    p_1 = p, q_1 = q
    for i = 1 .. w:  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));  on acceptance move to x_i
                     else p_{i+1} = norm(max(0, p_i - q_i)),  q_{i+1} = q_i without x_i, renormalised
    if none is accepted, the bonus token is drawn from p_{w+1} and the step ends there.

The emitted token at every depth follows p exactly (docs/speculative.md, "Tree verification", has the
derivation). A leaf reached by acceptance ends the step with the target's own sample at its row
(`target_tokens`, what plain decoding would have drawn there). Greedy rows accept the child equal to
the target's argmax (the longest path of the tree that matches greedy decoding) and end with the
argmax. The chain is the tree of width 1: with the same drafts it gives exactly `verify.verify_stochastic`'s
tokens (same coins, same residual draw; tests/spec/test_tree_verify.py).

Noise, from the sampler's counter-based hash (seed, output index, stream): the coin of the rank-r child
of a node at depth d uses output index counters + d, column r, stream STREAM_ACCEPT (only one sibling
group is evaluated per depth, so the columns never collide); the residual draw at the depth d where the
walk stops uses counters + d, stream STREAM_RESIDUAL, one column per token. No host read: the walk is
depth x width steps of [S, V] tensor ops of fixed shape.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from namazu.layers.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, gumbel_noise, hash_uniform
from namazu.spec.tree import DraftTree, TreeTensors


class TreeVerdict(NamedTuple):
    path: torch.Tensor          # [S, D] accepted node at depth j + 1, -1 past num_accepted
    tokens: torch.Tensor        # [S, D + 1] a row emits tokens[:num_accepted + 1] (the bonus last)
    num_accepted: torch.Tensor  # [S]


def _rows(x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """x [S, R, ...] at node [S] -> [S, ...]."""
    idx = node.view(-1, *([1] * (x.dim() - 1))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, idx).squeeze(1)


def verify_tree(tt: TreeTensors, tree: DraftTree, processed: torch.Tensor, target_tokens: torch.Tensor,
                greedy: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                max_depth: torch.Tensor | None = None, num_nodes: torch.Tensor | None = None,
                all_exact: bool = False) -> TreeVerdict:
    """processed [S, R, V]: the target's processed logits at every node row; target_tokens [S, R] its
    sample there (argmax on greedy rows); greedy [S]; seeds [S]; counters [S] the output index the root
    row's next token takes; max_depth [S] (None: the tree's): nodes deeper than it count as absent (a
    sequence that may emit fewer tokens); num_nodes [S] (None: all): only nodes 1 .. num_nodes exist (the
    engine planned fewer verify rows than the tree has; node order makes any prefix a tree). Greedy rows
    take the exact-match rule against target_tokens, which is also the rule for a request's own seed (its
    text then equals plain seeded decoding's: `verify.verify_stochastic`, `seeded`). `all_exact` (a host
    flag: every row greedy, as in a batch at T = 0) takes that rule without the walk's [S, V] work
    (`_verify_exact`: the same verdict, a few ops per depth)."""
    if all_exact:
        return _verify_exact(tt, tree, target_tokens, max_depth, num_nodes)
    s, r, v = processed.shape
    depth, width = tt.topology.depth, tt.topology.width
    dev = processed.device
    rows = torch.arange(s, device=dev)
    cur = torch.zeros(s, dtype=torch.long, device=dev)
    alive = torch.ones(s, dtype=torch.bool, device=dev)
    limit = torch.full((s,), depth, device=dev) if max_depth is None else max_depth
    path = torch.full((s, depth), -1, dtype=torch.long, device=dev)
    stop_depth = torch.full((s,), depth, dtype=torch.long, device=dev)
    # The walk's final distribution, unnormalised (its log is what the bonus draw uses); `rejected` rows
    # draw their bonus from it, the others take the target's own sample at the final node.
    final_mass = torch.zeros(s, v, device=dev)
    rejected = torch.zeros(s, dtype=torch.bool, device=dev)
    for d in range(depth):
        mass = _rows(processed, cur).float().softmax(-1)              # p_1, unnormalised mass of p_i
        total = torch.ones(s, dtype=torch.float64, device=dev)          # its sum
        support = _rows(tree.child_ids, cur)                            # [S, K]
        q = _rows(tree.child_q, cur).double()                           # q_i over the support
        argmax = _rows(target_tokens.unsqueeze(-1), cur).squeeze(-1)
        coins = hash_uniform(seeds, counters + d, width, STREAM_ACCEPT)  # [S, W]
        took = torch.zeros(s, dtype=torch.bool, device=dev)
        any_rejected = torch.zeros(s, dtype=torch.bool, device=dev)
        nxt = cur
        for rank in range(width):
            child = tt.children[cur, rank]                              # [S]
            c = child.clamp_min(0)
            exists = alive & ~took & (child >= 0) & (tt.depths[c] <= limit)
            if num_nodes is not None:
                exists = exists & (child <= num_nodes)
            x = tree.tokens[rows, c]
            xi = tree.cand_index[rows, c]
            q_x = q.gather(1, xi.unsqueeze(-1)).squeeze(-1)
            p_x = mass.gather(1, x.unsqueeze(-1)).squeeze(-1).double()
            # u < p_i(x) / q_i(x) without dividing; a draw of no mass (q spent) is no draft at all.
            coin = coins[:, rank] * q_x * total < p_x
            drawn = exists & (greedy | (q_x > 0))
            ok = torch.where(greedy, x == argmax, coin) & drawn
            nxt = torch.where(ok, child, nxt)
            took = took | ok
            rej = drawn & ~ok & ~greedy
            any_rejected = any_rejected | rej
            # p_{i+1} = max(0, p_i - q_i) (unnormalised: mass - total * q on the support), q_{i+1} = q_i
            # without x_i. Both change on the support only.
            m_s = mass.gather(1, support).double()
            new_s = (m_s - total.unsqueeze(-1) * q).clamp_min(0.0)
            mass = torch.where(rej.unsqueeze(-1), mass.scatter(1, support, new_s.float()), mass)
            total = torch.where(rej, (total - (m_s - new_s).sum(-1)).clamp_min(0.0), total)
            q_next = q.scatter(1, xi.unsqueeze(-1), 0.0)
            q_next = q_next / q_next.sum(-1, keepdim=True).clamp_min(1e-300)
            q = torch.where(rej.unsqueeze(-1), q_next, q)
        stops = alive & ~took
        stop_depth = torch.where(stops, d, stop_depth)
        final_mass = torch.where((stops & any_rejected).unsqueeze(-1), mass, final_mass)
        rejected = rejected | (stops & any_rejected)
        path[:, d] = torch.where(took, nxt, -1)
        cur = torch.where(took, nxt, cur)
        alive = alive & took
    # The bonus: at a rejection, a draw from the last residual; otherwise the target's sample at the node
    # the walk ended on (its argmax on greedy rows).
    noise = gumbel_noise(seeds, counters + stop_depth, v, STREAM_RESIDUAL)
    resampled = (final_mass.log() + noise).argmax(-1)
    own = target_tokens.gather(1, cur.unsqueeze(-1)).squeeze(-1)
    return _verdict(tree, path, torch.where(rejected & ~greedy, resampled, own))


def _verdict(tree: DraftTree, path: torch.Tensor, bonus: torch.Tensor) -> TreeVerdict:
    """The accepted path [S, D] (-1 past its end) and the bonus token [S] -> what each sequence emits."""
    n = (path >= 0).sum(-1)
    path_tokens = tree.tokens.gather(1, path.clamp_min(0))
    j = torch.arange(path.shape[1] + 1, device=path.device)
    tokens = torch.cat([path_tokens, bonus.unsqueeze(-1)], 1)
    tokens = torch.where(j < n.unsqueeze(-1), tokens, bonus.unsqueeze(-1))
    return TreeVerdict(path, tokens, n)


def _verify_exact(tt: TreeTensors, tree: DraftTree, target_tokens: torch.Tensor, max_depth: torch.Tensor | None,
                  num_nodes: torch.Tensor | None) -> TreeVerdict:
    """`verify_tree` where every row takes the exact-match rule: at each depth the first child (by rank) whose
    token is the target's sample at the current node, and the bonus is the target's sample where the walk
    stops. The general walk's decision on such rows, without its distributions."""
    s = target_tokens.shape[0]
    depth = tt.topology.depth
    dev = target_tokens.device
    cur = torch.zeros(s, dtype=torch.long, device=dev)
    alive = torch.ones(s, dtype=torch.bool, device=dev)
    path = torch.full((s, depth), -1, dtype=torch.long, device=dev)
    for d in range(depth):
        want = target_tokens.gather(1, cur.unsqueeze(-1))                  # [S, 1]
        child = tt.children[cur]                                            # [S, W]
        c = child.clamp_min(0)
        ok = alive.unsqueeze(-1) & (child >= 0) & (tree.tokens.gather(1, c) == want)
        if max_depth is not None:
            ok = ok & (tt.depths[c] <= max_depth.unsqueeze(-1))
        if num_nodes is not None:
            ok = ok & (child <= num_nodes.unsqueeze(-1))
        took = ok.any(-1)
        nxt = c.gather(1, ok.int().argmax(-1, keepdim=True)).squeeze(-1)   # the first match by rank
        path[:, d] = torch.where(took, nxt, -1)
        cur = torch.where(took, nxt, cur)
        alive = alive & took
    return _verdict(tree, path, target_tokens.gather(1, cur.unsqueeze(-1)).squeeze(-1))
