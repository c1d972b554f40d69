"""The block hash: the key of the prefix cache, and of the KV events a router reads.

A full block of `block_size` tokens is keyed by `hash(parent block hash, token ids of this block)`, chained
from `ROOT_HASH`, so equal keys mean equal whole prefixes, not just equal blocks. The hash is blake2b, stable
across processes and machines, so a router computing a prompt's hashes (`kv_events.prompt_block_hashes`) gets
the values the replica's block manager registered. This is the only place the chain is computed.

A request's `cache_salt` (per tenant: `SamplingParams.cache_salt`, or the server's salt per API key) seeds
its chain: the first parent is `root_hash(salt)` instead of `ROOT_HASH`, so requests with different salts
have different hashes for every block, never share one, and one tenant's `cached_tokens` says nothing of
another's prompts; the same salt shares as before. Everyone who hashes a request's prompt (the block
manager, the router) takes its root from the same salt.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0
_SALT_PERSON = b"namazu-salt"    # domain separation: a salted root is never a block's hash by accident


@functools.lru_cache(maxsize=4096)
def root_hash(salt: str | None) -> int:
    """The chain's first parent for a request with this cache salt (None: unsalted, `ROOT_HASH`)."""
    if salt is None:
        return ROOT_HASH
    h = hashlib.blake2b(digest_size=8, person=_SALT_PERSON)
    h.update(ROOT_HASH.to_bytes(8, "little"))
    h.update(salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") >> 1


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Chained block hash: a 63-bit int from the parent's hash and this block's token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        root: int = ROOT_HASH) -> list[int]:
    """Appends to `hashes` (the chain of the first len(hashes) blocks of `token_ids`, from `root`) the hash
    of every further full block of `token_ids`, and returns it. Tokens only ever append, so a sequence's
    chain is extended, never recomputed."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive")
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
