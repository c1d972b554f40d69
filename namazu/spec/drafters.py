"""Drafters that propose tokens for the verify step.

`NgramDrafter` (prompt lookup) is the model-free drafter a user enables with
`--speculative-method ngram --num-speculative-tokens K`: it finds the latest earlier occurrence of the
sequence's last n tokens and proposes what followed. `ScriptedDrafter` drives the verify path in
tests with drafts that are always right, always wrong or random (optionally with a random draft
distribution q, for the T > 0 rejection-sampling rule). The DFlash2 drafter implements the same
`propose` interface.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np

from namazu.scheduler.sequence import Sequence

Proposal = tuple[list[int], "np.ndarray | None"]


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], k: int) -> dict[int, Proposal]:
        """Draft tokens (and optionally their distributions [k, V]) per seq_id; missing = no drafts."""
        ...


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 4096):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose_tokens(self, tokens: Seq[int], k: int) -> list[int]:
        toks = np.asarray(tokens[-self.window:], dtype=np.int64)
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            suffix = toks[-n:]
            # Every start i < len - n where toks[i:i+n] == suffix; take the latest.
            windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return toks[start:start + k].tolist()
        return []

    def propose(self, seqs: list[Sequence], k: int) -> dict[int, Proposal]:
        out = {}
        for seq in seqs:
            draft = self.propose_tokens(seq.token_ids, k)
            if draft:
                out[seq.seq_id] = (draft, None)
        return out


class ScriptedDrafter:
    """Test drafter. `reference` maps a prompt (tuple of token ids) to the target's own continuation.

    mode "right": the next k reference tokens; "wrong": each shifted by one (never equal);
    "random": uniform random tokens; "random_q": tokens drawn from a random distribution q, returned
    with q (exercises the stochastic acceptance rule)."""

    def __init__(self, mode: str, vocab_size: int, reference: dict[tuple[int, ...], list[int]] | None = None,
                 seed: int = 0):
        if mode not in ("right", "wrong", "random", "random_q"):
            raise ValueError(f"ScriptedDrafter mode {mode!r}: expected right, wrong, random or random_q")
        if mode in ("right", "wrong") and reference is None:
            raise ValueError(f"ScriptedDrafter mode {mode!r} needs the reference continuations")
        self.mode, self.vocab_size, self.reference = mode, vocab_size, reference or {}
        self.rng = np.random.default_rng(seed)
        self.num_proposed = 0

    def propose(self, seqs: list[Sequence], k: int) -> dict[int, Proposal]:
        out: dict[int, Proposal] = {}
        for seq in seqs:
            if self.mode in ("right", "wrong"):
                ref = self.reference[tuple(seq.prompt_token_ids)]
                draft = ref[seq.num_output_tokens:seq.num_output_tokens + k]
                if self.mode == "wrong":
                    draft = [(t + 1) % self.vocab_size for t in draft]
                probs = None
            elif self.mode == "random":
                draft, probs = self.rng.integers(0, self.vocab_size, k).tolist(), None
            else:
                probs = self.rng.dirichlet(np.full(self.vocab_size, 0.3), size=k).astype(np.float32)
                draft = [int(self.rng.choice(self.vocab_size, p=p / p.sum())) for p in probs]
            if draft:
                out[seq.seq_id] = (list(draft), probs)
                self.num_proposed += len(draft)
        return out
