"""Which sequence preemption takes: the last running one in policy order (FCFS: the latest arrival;
priority: the lowest priority), never the one that asked for the block when another is behind it."""
import pytest

from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.scheduler import Scheduler
from namazu.scheduler.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def make_seq(base: int, n_prompt: int = 8, priority: int = 0) -> Sequence:
    return Sequence(next(_ids), f"r{base}", 0, [base + i for i in range(n_prompt)],
                    SamplingParams(max_tokens=16), seed=0, priority=priority)


def play(sched: Scheduler, out, token: int = 3) -> None:
    """The runner's part: each sampling row appends one token and its KV is committed."""
    for item in out.scheduled:
        if item.samples:
            item.seq.append_tokens([token])
            sched.commit(item.seq, item.seq.num_tokens - 1)
        else:
            sched.commit(item.seq, item.seq.num_computed_tokens + item.num_new_tokens)


def full_pool_of_two(policy: str, first: Sequence, second: Sequence) -> Scheduler:
    """Two 8-token prompts fill a 4-block pool (block size 4); after one sampled token each, both need a
    third block for their next position, and none is free."""
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, policy=policy)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {first.seq_id, second.seq_id}
    play(sched, out)
    assert bm.num_free_blocks == 0 and all(s.num_tokens == 9 for s in (first, second))
    return sched


def test_fcfs_preempts_the_latest_arrival():
    a, b = make_seq(100), make_seq(200)            # a arrives first
    sched = full_pool_of_two("fcfs", a, b)
    out = sched.schedule()
    assert out.preempted == [b], "the victim must be the last running sequence in arrival order"
    assert [s.seq for s in out.scheduled] == [a]
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.token_ids[-1] == 3   # tokens kept
    sched.bm.check_invariants([a])


def test_priority_preempts_the_lowest_priority_even_if_it_arrived_first():
    low, high = make_seq(100, priority=5), make_seq(200, priority=-1)   # low arrives first
    sched = full_pool_of_two("priority", low, high)
    out = sched.schedule()
    assert out.preempted == [low]
    assert [s.seq for s in out.scheduled] == [high]
    sched.bm.check_invariants([high])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_preempted_sequence_waits_at_its_place_and_finishes_unchanged(policy):
    a, b = make_seq(100, priority=0), make_seq(200, priority=1)
    sched = full_pool_of_two(policy, a, b)
    late = make_seq(300, n_prompt=3, priority=2)
    sched.add(late)
    out = sched.schedule()
    assert out.preempted == [b]
    assert sched.waiting == [b, late], "a preempted sequence goes back ahead of later arrivals"
    play(sched, out)
    steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        play(sched, out)
        for s in list(sched.running):
            if s.num_output_tokens >= 4:
                sched.finish(s, "length")
        steps += 1
        assert steps < 100, "no progress"
    assert a.token_ids == list(range(100, 108)) + [3] * 4
    assert b.token_ids == list(range(200, 208)) + [3] * 4
