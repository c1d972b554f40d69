"""Incremental detokenization with stop strings.

Decoding token by token is wrong twice over: one character can span several byte-level tokens
(Japanese is 3 UTF-8 bytes and often split), and some decoders change a token's text depending on its
left neighbour (leading spaces). So each new token is decoded together with a few tokens of left
context (prefix_offset .. end) and compared with the same context decoded without it; text is released
only once it no longer ends in an incomplete character (U+FFFD).

Stop strings are matched on the released text, so a stop string split across tokens is found. While a
sequence runs, the last (longest stop string - 1) characters are held back from streaming, because they
may be the start of a stop string that the next token completes.
"""
from __future__ import annotations

from collections.abc import Sequence

from namazu.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # Left context from the prompt makes the first output token decode as it would mid-sequence.
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.finished = False
        self.stop_hit: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith(_INCOMPLETE)):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Adds one generated token. Returns the stop string it completed, if any (the text is then cut
        before it, or after it with include_stop_str_in_output). check_stop=False (min_tokens not yet
        reached) only decodes."""
        self.ids.append(token_id)
        before = len(self.text)
        self.text += self._release(final=False)
        if check_stop and self.stop and len(self.text) > before:
            # Only a window that reaches into the new text can hold a new match.
            start = max(0, before - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                self.stop_hit = s
                self.finished = True
                return s
        return None

    def finish(self) -> None:
        """The sequence ended: release whatever is left (an incomplete character becomes U+FFFD)."""
        if not self.finished:
            self.text += self._release(final=True)
            self.finished = True

    @property
    def stream_text(self) -> str:
        """Text safe to show now: all of it once finished, else without the possible stop-string start."""
        if self.finished or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
