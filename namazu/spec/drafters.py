"""Host proposers: n-gram prompt lookup, and scripted drafts for tests.

`NgramProposer` is the model-free drafter a user enables with `--speculative-method ngram
--num-speculative-tokens K`: it finds the latest earlier occurrence of the sequence's last n tokens
and proposes what followed. `ScriptedDrafter` drives the verify path in tests with drafts that are
always right, always wrong or random (optionally with a random draft distribution q, for the T > 0
rejection-sampling rule). Both run in the worker after the step's host read (`namazu/spec/proposer.py`).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from namazu.spec.proposer import Proposal, ProposerInput


class NgramProposer:
    on_device = False
    hidden_layers: tuple[int, ...] = ()

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

    def propose(self, inp: ProposerInput, k: int) -> Proposal:
        return Proposal([self.propose_tokens(h, k) for h in inp.histories])


class ScriptedDrafter:
    """Test drafter. `reference` maps a prompt (tuple of token ids) to the target's own continuation.

    mode "right": the next k reference tokens; "wrong": each shifted by one (never equal);
    "random": uniform random tokens; "random_q": tokens drawn from a random distribution q, returned
    with q (exercises the stochastic acceptance rule)."""

    on_device = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, mode: str, vocab_size: int, reference: dict[tuple[int, ...], list[int]] | None = None,
                 seed: int = 0):
        if mode not in ("right", "wrong", "random", "random_q"):
            raise ValueError(f"ScriptedDrafter mode {mode!r}: expected right, wrong, random or random_q")
        if mode in ("right", "wrong") and reference is None:
            raise ValueError(f"ScriptedDrafter mode {mode!r} needs the reference continuations")
        self.mode, self.vocab_size, self.reference = mode, vocab_size, reference or {}
        self.rng = np.random.default_rng(seed)

    def propose(self, inp: ProposerInput, k: int) -> Proposal:
        ids: list[list[int]] = []
        probs: list[np.ndarray | None] = []
        for hist, plen in zip(inp.histories, inp.prompt_lens):
            q = None
            if self.mode in ("right", "wrong"):
                n_out = len(hist) - plen
                draft = self.reference[tuple(hist[:plen])][n_out:n_out + k]
                if self.mode == "wrong":
                    draft = [(t + 1) % self.vocab_size for t in draft]
            elif self.mode == "random":
                draft = self.rng.integers(0, self.vocab_size, k).tolist()
            else:
                q = self.rng.dirichlet(np.full(self.vocab_size, 0.3), size=k).astype(np.float32)
                draft = [int(self.rng.choice(self.vocab_size, p=p / p.sum())) for p in q]
            ids.append(list(draft))
            probs.append(q)
        return Proposal(ids, probs=probs if self.mode == "random_q" else None)
