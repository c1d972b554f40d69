"""What the router believes one replica caches, keyed by the replica's chained block hashes.

`EventIndex` is fed by the replica's KV events (`GET /kv/events`): stored / removed / all-cleared
deltas after a cursor, or a full snapshot when the cursor cannot be replayed (the replica restarted,
the log wrapped). `RoutingHistory` is the fallback when events are missing: the blocks of the prompts
the router itself sent there, each forgotten after a TTL (a replica evicts what it is not asked for).
Events lag a request by its prefill and a poll, so prompts sent in the last seconds count too.
Both answer the same question: how many leading blocks of this prompt are cached there. Block hashes
are chained, so a prompt's i-th hash being present means its whole prefix up to block i is.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


def leading_matches(hashes: Sequence[int], present: Any) -> int:
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


class EventIndex:
    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.replica_id: str | None = None
        self.cursor = 0                       # id of the last event applied
        self.synced_at: float | None = None   # monotonic time of the last successful poll
        self.num_resets = 0

    def apply(self, page: dict[str, Any], now: float | None = None) -> bool:
        """Applies one `/kv/events` answer; returns True if more events are waiting."""
        rid = page["replica_id"]
        if rid != self.replica_id:
            # A new life of the replica (or the first contact): nothing we knew about it holds.
            self.hashes.clear()
            self.replica_id = rid
            self.cursor = 0
            self.num_resets += 1
        if "snapshot" in page:
            self.hashes = set(page["snapshot"])
            self.cursor = page["last_id"]
        for e in page["events"]:
            if e["id"] <= self.cursor:
                continue
            kind = e["type"]
            if kind == "stored":
                self.hashes.update(e["block_hashes"])
            elif kind == "removed":
                self.hashes.difference_update(e["block_hashes"])
            elif kind == "all_cleared":
                self.hashes.clear()
            self.cursor = e["id"]
        self.synced_at = time.monotonic() if now is None else now
        return bool(page.get("more"))

    def clear(self) -> None:
        self.hashes.clear()
        self.replica_id = None
        self.cursor = 0
        self.synced_at = None

    def fresh(self, max_age: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.synced_at is not None and now - self.synced_at <= max_age

    def matched(self, hashes: Sequence[int]) -> int:
        return leading_matches(hashes, self.hashes)


class RoutingHistory:
    """Block hashes this router sent to one replica, each kept for `ttl` seconds after its last use."""

    def __init__(self, ttl: float = 120.0, max_entries: int = 200_000):
        self.ttl = ttl
        self.max_entries = max_entries
        self._expiry: OrderedDict[int, float] = OrderedDict()

    def record(self, hashes: Sequence[int], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + self.ttl
        for h in hashes:
            self._expiry[h] = expiry
            self._expiry.move_to_end(h)
        while len(self._expiry) > self.max_entries:
            self._expiry.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._expiry:
            h, t = next(iter(self._expiry.items()))
            if t > now:
                break
            del self._expiry[h]

    def matched(self, hashes: Sequence[int], now: float | None = None, within: float | None = None) -> int:
        """Leading blocks of `hashes` sent there and not expired; with `within`, only those sent in the
        last `within` seconds (what a replica's events may not show yet)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if within is None:
            return leading_matches(hashes, self._expiry)
        cutoff = now - within + self.ttl
        n = 0
        for h in hashes:
            t = self._expiry.get(h)
            if t is None or t < cutoff:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._expiry.clear()

    def __len__(self) -> int:
        return len(self._expiry)
