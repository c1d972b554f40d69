"""Keyed block hashes for the KV events a replica publishes (`GET /kv/events`).

The prefix cache's own block hashes are unkeyed and the same in every process (`hash(parent, tokens)`),
so anyone who can read a replica's events can hash a guessed prompt the same way and confirm, block by
block, that another user sent it. With `--kv-events-key` the replica publishes each hash as
HMAC-style keyed blake2b of it instead, and the router (given the same key) keys the hashes of the
prompts it routes the same way: routing works as before, and a reader without the key learns only that
some blocks were stored. Only what leaves the replica changes: the prefix cache itself is not keyed.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

_MASK = (1 << 63) - 1


def keyed(key: bytes, hashes: Iterable[int]) -> list[int]:
    """Each 63-bit block hash as a 63-bit keyed hash (blake2b with `key`)."""
    return [int.from_bytes(hashlib.blake2b(h.to_bytes(8, "little"), key=key, digest_size=8).digest(),
                           "little") & _MASK for h in hashes]


def key_events(answer: dict[str, Any], key: bytes) -> dict[str, Any]:
    """A `/kv/events` answer (`KVEventLog.since`) with every hash keyed."""
    out = dict(answer)
    if "snapshot" in out:
        out["snapshot"] = sorted(keyed(key, out["snapshot"]))
    out["events"] = [{**e, "block_hashes": keyed(key, e["block_hashes"])} for e in out.get("events", [])]
    return out


def parse_key(value: str | None, flag: str = "--kv-events-key") -> bytes | None:
    """The key's bytes (blake2b takes at most 64), or None; an empty key is refused."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{flag} is empty; give a secret, or none to publish unkeyed hashes")
    raw = value.encode()
    return raw if len(raw) <= 64 else hashlib.blake2b(raw, digest_size=64).digest()
