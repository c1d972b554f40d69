"""Block manager: prefix hits, LRU eviction order, and invariants under random operation sequences."""
from hypothesis import given, settings
from hypothesis import strategies as st

from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_hash import hash_block
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.scheduler import Scheduler
from namazu.scheduler.sequence import Sequence

_ids = iter(range(10**9))


def make_seq(tokens, **kw) -> Sequence:
    return Sequence(next(_ids), "r", 0, list(tokens), SamplingParams(max_tokens=64), seed=0, **kw)


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    cached = bm.admit(seq, seq.num_tokens)
    assert cached is not None
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return cached


def test_hash_is_chained_and_stable():
    a = hash_block(0, [1, 2, 3, 4])
    assert a == hash_block(0, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(0, [5, 6, 7, 8])
    assert 0 <= a < 2**63


def test_shared_prefix_is_computed_once_and_last_token_recomputed():
    bm = BlockManager(16, 4)
    a = make_seq(range(10))                      # 2 full blocks + 2 tokens
    assert run_prefill(bm, a) == 0
    b = make_seq(list(range(8)) + [99, 98, 97])  # same first 2 blocks
    assert run_prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2
    c = make_seq(range(8))                       # exact 2-block prompt: last block must be recomputed
    assert run_prefill(bm, c) == 4
    bm.check_invariants([a, b, c])
    assert 0 < bm.prefix_hit_rate < 1


def probe(bm: BlockManager, tokens) -> int:
    """Tokens the cache would serve for this prompt right now (admits, then frees at once; the probe's own
    new block is unhashed, so it goes back to the free list and the cache is left as it was)."""
    seq = make_seq(tokens)
    cached = bm.admit(seq, seq.num_tokens)
    assert cached is not None, "the probe did not fit"
    bm.free_seq(seq)
    return cached


def test_a_block_hash_chains_through_its_parent_not_just_its_tokens():
    bm = BlockManager(16, 4)
    p, q, r = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]
    first = make_seq(p + q + r)
    run_prefill(bm, first)
    # Q's KV was computed after P: at position 0 (after nothing) it is a different block.
    assert probe(bm, q + r) == 0
    assert probe(bm, q + p + r) == 0
    assert probe(bm, p + q + [11]) == 8
    assert probe(bm, p + [0, 6, 7, 8, 1]) == 4
    bm.check_invariants([first])


def test_freed_prefixes_are_evicted_least_recently_used_first_and_tails_before_heads():
    bm = BlockManager(8, 4)
    old = make_seq(range(100, 109))               # 2 full blocks + 1 token, freed first
    run_prefill(bm, old)
    bm.free_seq(old)
    new = make_seq(range(200, 209))               # freed later
    run_prefill(bm, new)
    bm.free_seq(new)
    assert len(bm.evictable) == 4 and bm.num_free_blocks == 8
    # 6 blocks, 4 of them evictable: taking 5 evicts exactly one, which must be the oldest prefix's tail.
    hog = make_seq(range(300, 317))
    run_prefill(bm, hog)
    bm.free_seq(hog)                              # its 4 full blocks are now the newest cached ones
    assert probe(bm, list(range(200, 208)) + [0]) == 8, "the most recently used prefix was evicted"
    assert probe(bm, list(range(100, 108)) + [0]) == 4, "the oldest prefix's tail should go first"
    bm.check_invariants([])


def test_admit_fails_cleanly_when_pool_is_short():
    bm = BlockManager(2, 4)
    a = make_seq(range(12))
    assert bm.admit(a, 12) is None
    assert a.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([])


class ShadowKV:
    """What each cache slot holds, as the runner would write it: the KV at a position depends on the token
    there and on every token before it, so a slot is identified by the whole prefix up to it."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.slots: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]

    def write(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """The step computes `tokens` (known tokens, then drafts) at positions start, start + 1, ..."""
        prefix = seq.token_ids[:start]
        for j, t in enumerate(tokens):
            p = start + j
            prefix = prefix + [t]
            self.slots[seq.block_table[p // self.bs]][p % self.bs] = tuple(prefix)

    def check(self, seq: Sequence) -> None:
        """Every position the sequence counts as computed (its own or mapped from the cache) holds the KV of
        exactly this sequence's prefix."""
        for p in range(seq.num_computed_tokens):
            held = self.slots[seq.block_table[p // self.bs]][p % self.bs]
            assert held == tuple(seq.token_ids[:p + 1]), (
                f"seq {seq.seq_id} position {p} (block {seq.block_table[p // self.bs]}) holds the KV of "
                f"another prefix")


# Steps dominate so that prompts get computed and committed before later ones look them up.
ops = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "step", "abort", "preempt", "finish"]),
                         st.integers(0, 10**6)), min_size=8, max_size=80)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(ops=ops, num_blocks=st.integers(4, 24), chunked=st.booleans(), caching=st.booleans())
def test_invariants_under_random_operations(ops, num_blocks, chunked, caching):
    bs = 4
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    max_len = num_blocks * bs
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8 if chunked else max_len,
                      max_model_len=max_len, enable_chunked_prefill=chunked)
    kv = ShadowKV(num_blocks, bs)
    live: list[Sequence] = []
    for op, r in ops:
        if op == "add":
            # Small alphabet and shared stems so prefixes collide often; the same stem also appears at
            # other offsets (after a different first block), which a hash without its parent would confuse.
            stem = [r % 3] * (bs * (r % 3))
            lead = [(r >> 3) % 2 + 1] * bs if r % 5 == 0 else []
            tail = [(r >> k) % 5 for k in range(1 + r % 7)]
            seq = make_seq((lead + stem + tail)[: max_len - 8])
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            out = sched.schedule(lambda s, k=r % 3: k)
            assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
            assert out.num_batched_tokens <= sched.max_num_batched_tokens
            for item in out.scheduled:
                kv.check(item.seq)            # what the step attends to, cache hits included
                known = item.seq.token_ids[item.start:item.start + item.num_new_tokens]
                kv.write(item.seq, item.start, known + [r % 5] * item.num_drafts)   # drafts: all r % 5
            for item in out.scheduled:
                seq = item.seq
                if item.samples:
                    accepted = r % (item.num_drafts + 1)
                    seq.append_tokens([r % 5] * accepted + [r % 5])
                    sched.commit(seq, seq.num_tokens - 1)
                    if seq.num_tokens >= max_len - 8:
                        sched.finish(seq, "length")
                        live.remove(seq)
                else:
                    sched.commit(seq, seq.num_computed_tokens + item.num_new_tokens)
                if not seq.is_finished:
                    kv.check(seq)
        elif op in ("abort", "finish") and live:
            seq = live.pop(r % len(live))
            sched.finish(seq, op)
        elif op == "preempt" and sched.running:
            sched._preempt(sched.running[r % len(sched.running)])
        bm.check_invariants(live)
    for seq in list(live):
        sched.finish(seq, "abort")
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
