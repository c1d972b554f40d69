"""The per-request grammar seam: what the engine asks of a grammar, and the grammars namazu ships.

A grammar follows the tokens a sequence commits and says which tokens may come next. The engine
(`namazu/structured/bitmask.py`) asks it to fill one bitmask row per sampled position, including the
positions of draft tokens and the bonus position of a verify step: it accepts each draft in turn,
fills the next row, and rolls the drafts back afterwards; after the step it accepts exactly the
committed tokens. Bitmask layout (xgrammar's): int32 words, bit j of word w allows token 32*w + j.

Grammars whose masks depend only on how many tokens came, not on their values (`TokenSetGrammar`,
`MinTokensGrammar`), set `depends_on_values = False`; the engine may then plan a sequence whose last
token is still on the device (async scheduling) by accepting a placeholder for it.
"""
from __future__ import annotations

import abc
from typing import Protocol, runtime_checkable

import numpy as np

PLACEHOLDER = -1   # a token whose value the host does not know yet (value-independent grammars only)


@runtime_checkable
class Grammar(Protocol):
    depends_on_values: bool

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advances over `tokens`; False (and no change) if one of them is not allowed."""
        ...

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of the run the grammar would accept, without advancing."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        ...

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """ANDs this grammar's allowed set for the next token into bitmask[row] (all ones = no limit)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end token."""
        ...


class StepwiseGrammar(abc.ABC):
    """`accept_tokens` and `validate_tokens` for grammars that take one token at a time and can roll
    back (an xgrammar matcher, the tool-call state machine): subclasses give `_accept_one` and `rollback`."""

    @abc.abstractmethod
    def _accept_one(self, token: int) -> bool:
        """Advances over one token; False (and no change) if it is not allowed."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""

    def accept_tokens(self, tokens: list[int]) -> bool:
        n = 0
        for t in tokens:
            if not self._accept_one(int(t)):
                self.rollback(n)
                return False
            n += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if not self._accept_one(int(t)):
                break
            n += 1
        self.rollback(n)
        return n


def token_mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def pack_allowed(allowed: np.ndarray) -> np.ndarray:
    """bool [..., 32*W] -> int32 [..., W] in the bitmask layout (little-endian bits in little-endian words)."""
    return np.packbits(allowed, axis=-1, bitorder="little").view("<u4").view(np.int32)


def ids_to_words(ids: list[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The bitmask row that allows exactly `ids`."""
    allowed = np.zeros(token_mask_words(vocab_size) * 32, dtype=bool)
    allowed[np.asarray(ids, dtype=np.int64)] = True
    return pack_allowed(allowed)


class TokenSetGrammar:
    """Every token must come from a fixed set (`SamplingParams.allowed_token_ids`)."""

    depends_on_values = False

    def __init__(self, allowed_ids: list[int], vocab_size: int):
        self.allowed = set(int(t) for t in allowed_ids)
        self.words = ids_to_words(sorted(self.allowed), vocab_size)

    def _ok(self, t: int) -> bool:
        return t == PLACEHOLDER or t in self.allowed

    def accept_tokens(self, tokens: list[int]) -> bool:
        return all(self._ok(t) for t in tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        for i, t in enumerate(tokens):
            if not self._ok(t):
                return i
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] &= self.words

    def is_terminated(self) -> bool:
        return False


class MinTokensGrammar:
    """End tokens are banned until `min_tokens` tokens were generated (`SamplingParams.min_tokens`)."""

    depends_on_values = False

    def __init__(self, min_tokens: int, end_ids: list[int], vocab_size: int):
        self.min_tokens = min_tokens
        self.end_ids = set(int(t) for t in end_ids)
        allowed = np.ones(token_mask_words(vocab_size) * 32, dtype=bool)
        allowed[sorted(self.end_ids)] = False
        self.ban_words = pack_allowed(allowed)
        self.count = 0

    def accept_tokens(self, tokens: list[int]) -> bool:
        n = self.validate_tokens(tokens)
        if n < len(tokens):
            return False
        self.count += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        for i, t in enumerate(tokens):
            if self.count + i < self.min_tokens and t in self.end_ids:
                return i
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        self.count -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self.count < self.min_tokens:
            bitmask[row] &= self.ban_words

    def is_terminated(self) -> bool:
        return False


class AllOf:
    """Several grammars at once: a token must satisfy each (a JSON schema and min_tokens, say)."""

    def __init__(self, grammars: list[Grammar]):
        self.grammars = grammars
        self.depends_on_values = any(g.depends_on_values for g in grammars)

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.validate_tokens(tokens) < len(tokens):
            return False
        for g in self.grammars:
            g.accept_tokens(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        return min(g.validate_tokens(tokens) for g in self.grammars)

    def rollback(self, num_tokens: int) -> None:
        for g in self.grammars:
            g.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        for g in self.grammars:
            g.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return any(g.is_terminated() for g in self.grammars)


def accept_pending(grammar, num_pending: int) -> int:
    """Advances the grammar over `num_pending` sampled tokens whose values are still on the worker
    (placeholders: value-independent grammars only, the scheduler holds back the others); returns how many
    to roll back."""
    if num_pending:
        if grammar.depends_on_values:
            raise AssertionError("a grammar that reads token values was planned with a pending token")
        grammar.accept_tokens([PLACEHOLDER] * num_pending)
    return num_pending
