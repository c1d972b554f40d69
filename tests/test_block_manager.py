"""Block manager: prefix hits, LRU eviction order, and invariants under random operation sequences."""
from hypothesis import given, settings
from hypothesis import strategies as st

from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager, hash_block
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


def test_freed_prefix_stays_cached_until_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_seq(range(9))                       # 3 blocks, 2 full -> cached
    run_prefill(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    b = make_seq(list(range(8)) + [5])
    assert run_prefill(bm, b) == 8               # revived from the evictable set
    bm.free_seq(b)
    c = make_seq(range(100, 116))                # needs all 4 blocks: evicts both cached ones
    assert run_prefill(bm, c) == 0
    assert not bm.cached or all(bm.block_hash[b] is not None for b in bm.cached.values())
    bm.check_invariants([c])


def test_admit_fails_cleanly_when_pool_is_short():
    bm = BlockManager(2, 4)
    a = make_seq(range(12))
    assert bm.admit(a, 12) is None
    assert a.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([])


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "abort", "preempt", "finish"]),
                         st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), chunked=st.booleans(), caching=st.booleans())
def test_invariants_under_random_operations(ops, num_blocks, chunked, caching):
    bs = 4
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    max_len = num_blocks * bs
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8 if chunked else max_len,
                      max_model_len=max_len, enable_chunked_prefill=chunked)
    live: list[Sequence] = []
    for op, r in ops:
        if op == "add":
            # Small alphabet and shared stems so prefixes collide often.
            stem = [r % 3] * (bs * (r % 3))
            tail = [(r >> k) % 5 for k in range(1 + r % 7)]
            seq = make_seq((stem + tail)[: max_len - 8])
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            out = sched.schedule(lambda s, k=r % 3: k)
            assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
            assert out.num_batched_tokens <= sched.max_num_batched_tokens
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
