"""Grammar rows for a draft tree (`--speculative-tree-budget N`, namazu/spec/tree_step.py).

A tree sequence's verify rows are its root (row 0) and its draft nodes 1..k in node order; node i's row
scores the token after the path root..i. Its mask is therefore the grammar's allowed set after the committed
tokens plus the tokens along that path, not after drafts[:i] as a chain's row i: the tree is walked depth
first, each node's token accepted on the way down and rolled back on the way up, so the grammar ends where
it started.

A node whose token the grammar rejects stays in the tree: its parent's masked row gives it no mass, so the
acceptance rule never takes it (greedy: it is not the argmax; seeded: not the target's sample; sampled: p(x)
= 0 rejects it, and the later siblings' q drops it as for any rejected draw, which is lossless for any q).
Nothing below it can be reached; its rows and its subtree's stay unmasked (all ones): no token is ever
taken from them.

A node that ends the grammar (an end token, or a token after which the grammar is terminated) cannot be
kept that way: it may be accepted, and then the tokens after it (the bonus, deeper nodes) would follow a
finished grammar. As a chain's drafts end before a stop token, a tree is cut before the first such node in
node order (`usable_tree_nodes`): the first m nodes of a tree are a tree, each sibling group a prefix of its
draws, so the rule stays lossless.
"""
from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np

from namazu.structured.grammar import accept_pending


def _children(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], 1):
        kids[p].append(i)
    return kids


def _accepted_paths(grammar, kids: list[list[int]], drafts: list[int], below: list[int] | None = None):
    """Depth first over the nodes whose whole path from the root the grammar accepts (and, with `below`,
    whose index is under below[0], which the caller may lower as it goes): yields each with the grammar
    holding root..node, accepted on the way down and rolled back on the way up; the grammar ends where it
    started, also when the caller stops early."""
    depth = 0
    stack = [(0, 0)]          # (node, index of its next child to visit)
    try:
        while stack:
            node, c = stack.pop()
            if c == len(kids[node]):
                if node:
                    grammar.rollback(1)
                    depth -= 1
                continue
            stack.append((node, c + 1))
            child = kids[node][c]
            if (below is not None and child >= below[0]) or not grammar.accept_tokens([drafts[child - 1]]):
                continue
            depth += 1
            yield child
            stack.append((child, 0))
    finally:
        if depth:
            grammar.rollback(depth)


def fill_tree_rows(grammar, mask: np.ndarray, row: int, num_pending: int, drafts: list[int],
                   parents: Sequence[int]) -> None:
    """Rows row .. row + len(drafts) of one tree sequence (node i at row + i), the first len(drafts) nodes of
    the topology `parents` (node 0 the root). `num_pending` sampled tokens whose values are still on the
    worker come first (value-independent grammars only, as for a chain); `drafts` may be placeholders for
    such a grammar: its rows then depend on each node's depth alone."""
    k = len(drafts)
    if len(parents) < k + 1:
        raise ValueError(f"{k} tree nodes planned, the topology has {len(parents) - 1}")
    kids = _children(parents[:k + 1])
    advanced = accept_pending(grammar, num_pending)
    try:
        grammar.fill_bitmask(mask, row)
        # A rejected node is never accepted; its subtree's rows keep all ones.
        for child in _accepted_paths(grammar, kids, drafts):
            grammar.fill_bitmask(mask, row + child)
    finally:
        if advanced:
            grammar.rollback(advanced)


def usable_tree_nodes(grammar, drafts: list[int], parents: Sequence[int], stop_ids: Container[int]) -> int:
    """How many leading nodes (node order) of a drafted tree a step may verify: all of them, or those before
    the first node the grammar accepts that ends it (a stop token, or a token that terminates the grammar).
    Nodes the grammar rejects, and their subtrees, do not cut the tree (module docstring). The grammar's
    state is left as it was."""
    k = min(len(drafts), len(parents) - 1)
    kids = _children(parents[:k + 1])
    first_end = [k + 1]
    for child in _accepted_paths(grammar, kids, drafts, below=first_end):
        if drafts[child - 1] in stop_ids or grammar.is_terminated():
            first_end[0] = child
    return first_end[0] - 1
