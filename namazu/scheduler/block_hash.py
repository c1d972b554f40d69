"""The block hash: the key of the prefix cache, and of the KV events a router reads.

A full block of `block_size` tokens is keyed by `hash(parent block hash, token ids of this block)`, chained
from `ROOT_HASH`, so equal keys mean equal whole prefixes, not just equal blocks. The hash is blake2b, stable
across processes and machines, so a router computing a prompt's hashes (`kv_events.prompt_block_hashes`) gets
the values the replica's block manager registered. This is the only place the chain is computed.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Chained block hash: a 63-bit int from the parent's hash and this block's token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> list[int]:
    """Appends to `hashes` (the chain of the first len(hashes) blocks of `token_ids`) the hash of every
    further full block of `token_ids`, and returns it. Tokens only ever append, so a sequence's chain is
    extended, never recomputed."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive")
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
