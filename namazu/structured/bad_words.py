"""Token sequences a request must not generate (`SamplingParams.bad_words_ids`, vLLM's `bad_words`).

A one-token word is banned everywhere. For a longer word, its last token is banned at a position whose
preceding generated tokens are the rest of the word, so the whole word can never complete; its first
tokens stay allowed (they start other words too). This is vLLM's rule. The mask depends on the values of
the tokens just generated, so the grammar sets `depends_on_values`.
"""
from __future__ import annotations

import numpy as np

from namazu.structured.grammar import ids_to_words, pack_allowed, token_mask_words


class BadWordsGrammar:
    depends_on_values = True

    def __init__(self, words: list[list[int]], vocab_size: int):
        self.vocab_size = vocab_size
        singles = sorted({w[0] for w in words if len(w) == 1})
        allowed = np.ones(token_mask_words(vocab_size) * 32, dtype=bool)
        allowed[singles] = False
        self.always = pack_allowed(allowed) if singles else None
        self.single_ids = set(singles)
        self.longer = [tuple(w) for w in words if len(w) > 1]
        self.history: list[int] = []

    def _banned_next(self, history: list[int]) -> set[int]:
        banned = set(self.single_ids)
        for w in self.longer:
            k = len(w) - 1
            if len(history) >= k and tuple(history[len(history) - k:]) == w[:-1]:
                banned.add(w[-1])
        return banned

    def validate_tokens(self, tokens: list[int]) -> int:
        h = list(self.history)
        for i, t in enumerate(tokens):
            if int(t) in self._banned_next(h):
                return i
            h.append(int(t))
        return len(tokens)

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.validate_tokens(tokens) < len(tokens):
            return False
        self.history.extend(int(t) for t in tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self.history[len(self.history) - num_tokens:]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self.always is not None:
            bitmask[row] &= self.always
        late = self._banned_next(self.history) - self.single_ids
        if late:
            bitmask[row] &= ~ids_to_words(sorted(late), self.vocab_size)

    def is_terminated(self) -> bool:
        return False
