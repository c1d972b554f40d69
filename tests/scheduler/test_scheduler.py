"""Scheduler: shared steps, chunked prefill mixed with decodes, preemption without loss, priority."""
from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.scheduler import Scheduler
from namazu.scheduler.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def make_seq(n_prompt, max_tokens=8, priority=0, base=0) -> Sequence:
    return Sequence(next(_ids), f"r{base}", 0, [base + i for i in range(n_prompt)],
                    SamplingParams(max_tokens=max_tokens), seed=0, priority=priority)


def fake_step(sched: Scheduler, out, token=7):
    """Plays the runner: every sampling row appends one token; finished sequences leave."""
    done = []
    for item in out.scheduled:
        seq = item.seq
        if item.samples:
            seq.append_tokens([token])
            sched.commit(seq, seq.num_tokens - 1)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
                done.append(seq)
        else:
            sched.commit(seq, seq.num_computed_tokens + item.num_new_tokens)
    return done


def test_sixteen_sequences_share_one_step():
    sched = Scheduler(BlockManager(128, 4), max_num_seqs=16, max_num_batched_tokens=256, max_model_len=64)
    seqs = [make_seq(5, base=100 * i) for i in range(16)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 16 and all(s.samples for s in out.scheduled)
    fake_step(sched, out)
    out = sched.schedule()
    assert len(out.scheduled) == 16 and all(s.num_new_tokens == 1 for s in out.scheduled)


def test_chunked_prefill_mixes_with_decodes_under_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128)
    a = make_seq(3)
    sched.add(a)
    fake_step(sched, sched.schedule())            # a is now decoding
    b = make_seq(30, base=1000)
    sched.add(b)
    chunks = []
    while b.num_output_tokens == 0:
        out = sched.schedule()
        assert out.num_batched_tokens <= 10
        kinds = {id(s.seq): s.num_new_tokens for s in out.scheduled}
        assert kinds.get(id(a)) == 1              # the decode rides along every step
        chunks.append(kinds[id(b)])
        fake_step(sched, out)
    assert sum(chunks) == 30 and max(chunks) == 9


def test_no_chunking_waits_for_whole_prompt():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128,
                      enable_chunked_prefill=False)
    a, b = make_seq(6), make_seq(6, base=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]   # b's 6 tokens do not fit in the remaining 4


def test_preemption_by_recompute_loses_nothing():
    bm = BlockManager(6, 4)                        # 24 token slots for 3 sequences of up to 16
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=24)
    seqs = [make_seq(6, max_tokens=10, base=100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    finished, steps = [], 0
    while sched.has_unfinished:
        out = sched.schedule()
        finished += fake_step(sched, out)
        bm.check_invariants(sched.running + sched.waiting)
        steps += 1
        assert steps < 200, "scheduler made no progress"
    assert sched.num_preemptions > 0
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert all(s.output_token_ids == [7] * 10 for s in seqs)
    assert bm.num_free_blocks == 6


def test_priority_policy_admits_and_keeps_higher_priority_first():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=16, policy="priority")
    low, high = make_seq(4, priority=5), make_seq(4, priority=-1, base=50)
    sched.add(low)
    sched.add(high)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [high]


def test_abort_while_waiting_and_running_frees_everything():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32)
    a, b = make_seq(9), make_seq(9, base=50)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule())
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished and bm.num_free_blocks == 16 and a.finish_reason == "abort"


def test_drafts_are_trimmed_to_max_tokens():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = make_seq(4, max_tokens=3)
    sched.add(a)
    fake_step(sched, sched.schedule())            # 1 output token; 2 more allowed
    out = sched.schedule(lambda seq: 4)
    assert out.scheduled[0].num_drafts == 1         # 1 draft + the bonus token = 2


def test_preempted_sequence_longer_than_the_budget_still_runs_without_chunking():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=24,
                      enable_chunked_prefill=False)
    a = make_seq(6, max_tokens=10)
    sched.add(a)
    for _ in range(4):
        fake_step(sched, sched.schedule())       # 6 prompt + 4 output tokens > budget 8
    sched._preempt(a)
    steps = 0
    while sched.has_unfinished:
        fake_step(sched, sched.schedule())
        steps += 1
        assert steps < 50, "a recomputed sequence longer than the budget never ran"
    assert a.num_output_tokens == 10


def test_decodes_are_not_stalled_by_a_long_prefill_ahead_of_them():
    bm = BlockManager(64, 4, enable_prefix_caching=False)    # so the recompute is a real long prefill
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128)
    a = make_seq(20, max_tokens=20)               # arrives first
    b = make_seq(4, max_tokens=20, base=500)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        fake_step(sched, sched.schedule())        # both decoding
    sched._preempt(a)                             # a must now recompute 23 tokens, ahead of b in FCFS
    fake_step(sched, sched.schedule())            # nothing admitted in the preempting step... a readmitted
    for _ in range(3):
        out = sched.schedule()
        kinds = {id(s.seq): s.num_new_tokens for s in out.scheduled}
        assert kinds.get(id(b)) == 1, "the running decode was stalled by the recompute"
        fake_step(sched, out)
