"""Filling a step's grammar bitmask: one row per sampled position, draft and bonus positions included.

For a sequence with a grammar and k drafts to verify, row j is the grammar's mask after the sequence's
committed tokens plus drafts[:j]: the drafts are accepted one by one between rows and rolled back at
the end, so the grammar's state stays that of the committed tokens. A sampled token outside its row's
mask is impossible, so verification never commits a token the grammar rejects. A draft tree's rows follow
each node's own path instead (`tree_masks.py`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from namazu.scheduler.scheduler import ScheduledSeq
from namazu.structured.grammar import PLACEHOLDER, accept_pending, token_mask_words
from namazu.structured.tree_masks import fill_tree_rows


def fill_step_bitmask(samplers: list[ScheduledSeq], vocab_size: int,
                      tree_parents: Sequence[int] | None = None) -> np.ndarray | None:
    """[R, W] int32 for the sampling rows in `samplers` order, or None if no sequence has a grammar.
    `tree_parents`: every verify is of a draft tree of this topology (`--speculative-tree-budget`): rows
    by node, along each node's path (`tree_masks.py`)."""
    if not any(item.seq.grammar is not None for item in samplers):
        return None
    rows = sum(item.num_drafts + 1 for item in samplers)
    words = token_mask_words(vocab_size)
    mask = np.full((rows, words), -1, dtype=np.int32)
    r = 0
    for item in samplers:
        g = item.seq.grammar
        k = item.num_drafts
        if g is not None:
            # A grammar that ignores token values masks draft rows without knowing the drafts.
            drafts = item.seq.next_draft_ids[:k] if g.depends_on_values else [PLACEHOLDER] * k
            if len(drafts) != k:
                raise AssertionError(f"seq {item.seq.seq_id}: {k} drafts planned, {len(drafts)} checked by its grammar")
            if tree_parents is not None:
                fill_tree_rows(g, mask, r, item.seq.num_pending, drafts, tree_parents)
            else:
                fill_sequence_rows(g, mask, r, item.seq.num_pending, drafts)
        r += k + 1
    tail = words * 32 - vocab_size
    if tail:   # bits past the vocabulary are never allowed
        mask[:, -1] &= np.int32(np.uint32((1 << (32 - tail)) - 1).view(np.int32))
    return mask


def fill_sequence_rows(grammar, mask: np.ndarray, row: int, num_pending: int, drafts: list[int]) -> None:
    """Rows row .. row+len(drafts) of one sequence. `num_pending` sampled tokens whose values are still
    on the worker come first (value-independent grammars only: the scheduler holds back the others)."""
    advanced = accept_pending(grammar, num_pending)
    try:
        for j in range(len(drafts) + 1):
            grammar.fill_bitmask(mask, row + j)
            if j < len(drafts):
                if not grammar.accept_tokens([drafts[j]]):
                    # The engine verifies only drafts the grammar accepted; anything else is a bug.
                    raise AssertionError(f"draft {j} ({drafts[j]}) was planned but the grammar rejects it")
                advanced += 1
    finally:
        if advanced:
            grammar.rollback(advanced)
