"""A finite-automaton grammar over token ids: the test grammar of the seam, and a simple way to
constrain output to a fixed language (a set of keywords, a token-level pattern).

`transitions[state][token] = next_state`; once in an accepting state, the end tokens are allowed too,
and accepting one terminates the grammar (after which nothing more is allowed). A state with no
transitions that is accepting allows only the end tokens: the grammar is complete.
"""
from __future__ import annotations

import numpy as np

from namazu.structured.grammar import ids_to_words


class AutomatonGrammar:
    depends_on_values = True

    def __init__(self, transitions: dict[int, dict[int, int]], accepting: set[int], end_ids: list[int],
                 vocab_size: int, start: int = 0):
        self.transitions = transitions
        self.accepting = set(accepting)
        self.end_ids = [int(t) for t in end_ids]
        self.vocab_size = vocab_size
        self.history = [start]           # state after each accepted token (rollback pops)
        self.terminated_at: int | None = None   # history length when an end token was accepted
        self._words: dict[int, np.ndarray] = {}

    @property
    def state(self) -> int:
        return self.history[-1]

    def _step(self, state: int, token: int) -> int | None:
        """The next state, -1 for 'terminated by an end token', None if not allowed."""
        if state == -1:
            return None
        if token in self.end_ids and state in self.accepting:
            return -1
        return self.transitions.get(state, {}).get(token)

    def validate_tokens(self, tokens: list[int]) -> int:
        state = self.state
        for i, t in enumerate(tokens):
            state = self._step(state, int(t))
            if state is None:
                return i
        return len(tokens)

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.validate_tokens(tokens) < len(tokens):
            return False
        for t in tokens:
            self.history.append(self._step(self.state, int(t)))
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens >= len(self.history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self.history) - 1} accepted")
        del self.history[len(self.history) - num_tokens:]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        state = self.state
        if state not in self._words:
            ids = [] if state == -1 else list(self.transitions.get(state, {}))
            if state in self.accepting:
                ids += self.end_ids
            self._words[state] = ids_to_words(ids, self.vocab_size)
        bitmask[row] &= self._words[state]

    def is_terminated(self) -> bool:
        return self.state == -1
