"""Paged KV-cache bookkeeping: block allocation, reference counts, prefix cache and LRU eviction.

Every block is in exactly one state:
- free       ref 0, no hash: never filled or its cache entry was evicted;
- evictable  ref 0, hashed: its KV is a cached prefix nobody uses right now (LRU order, oldest first);
- in use     ref > 0 (shared by every sequence whose block table holds it).
A full block whose KV is computed is registered under its chained hash
`hash(parent block hash, token ids of this block)`, so a later sequence with the same prefix maps those
blocks into its table instead of recomputing them. The hash is `block_hash.py`'s, stable across processes,
so the KV-aware router can key its view of each replica by the same values.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from namazu.scheduler.block_hash import extend_block_hashes
from namazu.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from namazu.scheduler.kv_events import KVEventLog

logger = logging.getLogger(__name__)

class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}          # block hash -> block id
        # Prefix-cache statistics, in prompt tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Every change to the set of cached hashes is published here (the KV-aware router reads it).
        self.events = events

    # -- state ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extends seq.block_hashes over every full block of its tokens (tokens only ever append)."""
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.cache_root)

    # -- allocation -------------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        """Adds a reference to a cached block (possibly reviving it from the evictable set)."""
        if self.ref_count[block] == 0:
            del self.evictable[block]
        self.ref_count[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block]]
            if self.events is not None:
                self.events.removed((self.block_hash[block],))
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of seq. The last token is always recomputed (its logits are
        needed), so at most (num_tokens - 1) // block_size blocks can hit."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        self.update_block_hashes(seq)
        hits = []
        for h in seq.block_hashes[: (len(seq.token_ids) - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Maps a waiting sequence's cached prefix into its table and allocates blocks for its first
        `num_new_tokens` uncached tokens. Returns the number of cached tokens, or None (and changes
        nothing) if the pool is too small."""
        assert not seq.block_table and seq.num_computed_tokens == 0 and seq.num_pending == 0
        hits = self._prefix_hits(seq)
        num_cached = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - num_cached)
        need_new = self.blocks_for(num_cached + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        if need_new + revived > self.num_free_blocks:
            return None
        for b in hits:
            self._take(b)
        seq.block_table = hits + [self._new_block() for _ in range(need_new)]
        seq.num_computed_tokens = num_cached
        seq.num_committed_blocks = len(hits)
        seq.num_cached_prompt_tokens = num_cached
        if seq.num_preemptions == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += min(num_cached, seq.num_prompt_tokens)
        return num_cached

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Ensures seq's table covers `num_tokens` positions. False (and no change) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._new_block() for _ in range(need))
        return True

    def commit(self, seq: Sequence) -> None:
        """Registers every full block whose KV is now computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        stored = []
        for i in range(seq.num_committed_blocks, full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                stored.append(h)
            # Otherwise an identical block is already cached (two sequences computed the same prefix in
            # the same step): this copy stays unhashed and returns to the free list when released.
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)
        if stored and self.events is not None:
            self.events.stored(stored)

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} released twice"
        if self.ref_count[block] == 0:
            if self.block_hash[block] is not None:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def free_seq(self, seq: Sequence) -> None:
        """Releases all of seq's blocks. Tail blocks go first so LRU eviction takes them before the
        shared prefix they extend."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keeps only the blocks covering the first `num_tokens` positions (rolls back rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        seq.num_committed_blocks = min(seq.num_committed_blocks, keep)

    def reset_prefix_cache(self) -> int:
        """Drops every evictable cached block; returns how many. Blocks in use keep their hashes."""
        n = len(self.evictable)
        dropped = []
        for block in self.evictable:
            del self.cached[self.block_hash[block]]
            dropped.append(self.block_hash[block])
            self.block_hash[block] = None
            self.free.append(block)
        self.evictable.clear()
        if dropped and self.events is not None:
            self.events.removed(dropped)
        return n

    def check_invariants(self, live: list[Sequence]) -> None:
        """Asserts the three-state invariant and that reference counts equal table occurrences."""
        counts = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                counts[b] += 1
        assert counts == self.ref_count, "reference counts differ from block-table occurrences"
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            states = (b in free) + (b in evictable) + (self.ref_count[b] > 0)
            assert states == 1, f"block {b} is in {states} states"
            if b in free:
                assert self.block_hash[b] is None, f"free block {b} still hashed"
            if b in evictable:
                assert self.block_hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache entry {h} -> {b} disagrees with the block's hash"
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
