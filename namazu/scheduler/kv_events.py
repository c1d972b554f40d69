"""KV events: what a replica's prefix cache holds, published for the KV-aware router.

The block manager reports every block it registers in the prefix cache (stored), every cached block it
evicts or drops (removed), and the log itself starts with one all-cleared event. Events carry the same
chained block hashes the prefix cache is keyed by, a monotonic id, and the replica id: a random id drawn
when the log is created, so a restarted replica announces a reset twice over (new replica id, event ids
from 1 again, an all-cleared event first). The log is bounded; a reader whose cursor fell off its start
(or belongs to another life of the replica) gets a snapshot of every stored hash instead of a delta.

`PromptHasher` computes a prompt's block hashes outside the engine (same tokenizer, same block size,
`block_hash.py`, from the root of the request's `cache_salt`, as the block manager does), so the router can
ask "how much of this prompt is cached there".
"""
from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from namazu.scheduler.block_hash import extend_block_hashes, root_hash

STORED, REMOVED, ALL_CLEARED = "stored", "removed", "all_cleared"


@dataclass(frozen=True)
class KVEvent:
    id: int
    type: str                       # stored | removed | all_cleared
    block_hashes: tuple[int, ...]   # empty for all_cleared

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "block_hashes": list(self.block_hashes)}


class KVEventLog:
    """Thread-safe bounded log of prefix-cache events (the engine thread writes, the server reads)."""

    def __init__(self, replica_id: str | None = None, max_events: int = 4096):
        if max_events < 1:
            raise ValueError(f"max_events={max_events}: the KV event log must hold at least one event")
        self.replica_id = replica_id or uuid.uuid4().hex[:16]
        self.max_events = max_events
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._stored: set[int] = set()      # what the cache holds now: the snapshot for lagging readers
        self._last_id = 0
        self._lock = threading.Lock()
        self.cleared()

    def _append(self, kind: str, hashes: tuple[int, ...]) -> None:
        self._last_id += 1
        self._events.append(KVEvent(self._last_id, kind, hashes))

    def stored(self, hashes: Iterable[int]) -> None:
        hashes = tuple(hashes)
        if hashes:
            with self._lock:
                self._stored.update(hashes)
                self._append(STORED, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        hashes = tuple(hashes)
        if hashes:
            with self._lock:
                self._stored.difference_update(hashes)
                self._append(REMOVED, hashes)

    def cleared(self) -> None:
        with self._lock:
            self._stored.clear()
            self._append(ALL_CLEARED, ())

    @property
    def last_id(self) -> int:
        return self._last_id

    def stored_hashes(self) -> set[int]:
        with self._lock:
            return set(self._stored)

    def since(self, after: int, limit: int = 1024, replica_id: str | None = None) -> dict[str, Any]:
        """Events with id > `after` (at most `limit`), as JSON. When they cannot be replayed (the cursor
        is older than the log's start, ahead of its end, or `replica_id` names another life of this
        replica) the answer has `"snapshot"`: every stored hash as of `last_id`, and no events."""
        if limit < 1:
            raise ValueError(f"limit={limit}: ask for at least one event")
        with self._lock:
            first = self._events[0].id
            resync = after < first - 1 or after > self._last_id or (
                replica_id is not None and replica_id != self.replica_id)
            out: dict[str, Any] = {"replica_id": self.replica_id, "last_id": self._last_id}
            if resync:
                out.update(snapshot=sorted(self._stored), events=[], more=False)
                return out
            start = after - first + 1        # ids are consecutive, so the cursor maps to a position
            events = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
            out.update(events=[e.to_json() for e in events], more=start + len(events) < len(self._events))
            return out


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids`, exactly as the block manager computes them for
    a request with this cache salt."""
    return extend_block_hashes([], list(token_ids), block_size, root_hash(cache_salt))


def request_cache_salt(body: Any) -> str | None:
    """An OpenAI request body's `cache_salt`, which seeds the replica's block hashes of its prompt: a
    router must hash from the same root to find the blocks. Anything but a non-empty string is the
    replica's 4xx to give (the router never second-guesses validation)."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None


class PromptHasher:
    """A request's prompt -> token ids -> block hashes, the way a namazu server would tokenize it."""

    def __init__(self, tokenizer: Any, block_size: int):
        self.tokenizer = tokenizer
        self.block_size = block_size

    @classmethod
    def from_pretrained(cls, path: str | Path | None, block_size: int) -> PromptHasher:
        """`path` None: the embedded default model's tokenizer (what a server without --model uses)."""
        from namazu.assets import default_model_path
        from namazu.tokenizer import Tokenizer

        return cls(Tokenizer.from_pretrained(path or default_model_path()), block_size)

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        return prompt_block_hashes(token_ids, self.block_size, cache_salt)
