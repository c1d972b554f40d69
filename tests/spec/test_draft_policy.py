"""The draft policy (engine/draft_policy.py): a sequence drafts while its measured tokens per verify step
beat the measured cost of a drafted step relative to a plain one, stops where they do not, and is probed
again; through the engine, a drafter whose drafts are never accepted stops being verified, and greedy
outputs stay those of speculation off (tests/MUTATIONS.md P2)."""
from collections import deque

import pytest
from engine_helpers import prompts, tiny_checkpoint
from test_dflash import make_proposer

from namazu import LLM, SamplingParams
from namazu.engine.draft_policy import Acceptance, DraftPolicy, expected_tokens


def _measured(p, plain_ms, fixed_ms, row_ms, rows=(1, 3, 6), batch=1):
    for _ in range(4):
        p.observe_step(batch, 0, plain_ms)
        for r in rows:
            p.observe_step(batch, r, fixed_ms + row_ms * r)


def test_expected_tokens_and_the_conditional_rates():
    acc = Acceptance(3)
    acc.observe(verified=3, accepted=1)    # draft 1 accepted, draft 2 rejected, draft 3 never reached
    acc.observe(verified=3, accepted=3)
    keep = 1 - acc.decay
    assert acc.reached == [keep + 1, keep + 1, 1.0] and acc.accepted == [keep + 1, 1.0, 1.0]
    assert acc.rates() == [1.0, 1 / (keep + 1), 1.0]
    assert abs(expected_tokens([0.5, 0.5, 0.5], 3) - (1 + 0.5 + 0.25 + 0.125)) < 1e-12
    assert expected_tokens([0.5, 0.5], 0) == 1.0


def test_the_plan_picks_the_block_length_that_maximises_tokens_per_second():
    p = DraftPolicy(max_tokens_per_step=7, margin=1.0)
    _measured(p, plain_ms=2.0, fixed_ms=3.0, row_ms=1.0)
    plain, fixed, row = p.step_costs(1)
    assert abs(plain - 2.0) < 1e-9 and abs(fixed - 3.0) < 1e-9 and abs(row - 1.0) < 1e-9
    for _ in range(200):                   # draft 1 always accepted, draft 2 half the time, the rest never
        p.observe_verify(1, 0.0, verified=6, accepted=1)
        p.observe_verify(1, 0.0, verified=6, accepted=2)
    rates = p.rates(p.seqs[1])
    best = max(range(7), key=lambda k: expected_tokens(rates, k) / (3.0 + k) if k else 1 / 2.0)
    assert best == 2                       # by hand: E = 1, 2, 2.5, 2.5.. over 2, 4, 5, 6.. ms
    assert p.plan([(1, 0.0)]) == {1: best}
    # Rows cost nothing extra (a compiled step pads to its entry): the whole block.
    q = DraftPolicy(max_tokens_per_step=7, margin=1.0)
    _measured(q, plain_ms=2.0, fixed_ms=3.0, row_ms=0.0)
    q.seqs = p.seqs
    q.buckets = p.buckets
    assert q.plan([(1, 0.0)]) == {1: 6}


def test_with_padded_rows_a_noisy_row_slope_does_not_shorten_the_block():
    # Graph mode: every drafted step computes the entry's 1 + K rows. Noise that grows with the block cut
    # by confidence (3 to 5 drafts) reads as 1 ms per row to a line, which makes 2 drafts the best plan;
    # padded, the cost is the drafted steps' median and the whole block is planned.
    p = DraftPolicy(max_tokens_per_step=7)
    q = DraftPolicy(max_tokens_per_step=7, padded_rows=True)
    for pol in (p, q):
        _measured(pol, plain_ms=2.0, fixed_ms=3.0, row_ms=1.0, rows=(3, 4, 5))
        for _ in range(200):
            pol.observe_verify(1, 0.0, verified=6, accepted=3)
            pol.observe_verify(1, 0.0, verified=6, accepted=5)      # E(k) = 1, 2, 3, 4, 4.5, 5, 5
    assert p.step_costs(1)[2] > 0.9 and p.plan([(1, 0.0)])[1] < 6
    plain, fixed, row = q.step_costs(1)
    assert (plain, fixed, row) == (2.0, 7.0, 0.0)       # the median of 6, 7 and 8 ms
    assert q.plan([(1, 0.0)]) == {1: 6}
    # ... and stops where the whole block does not pay (E(6) near 2 tokens for 7 ms against 2 ms a token).
    for _ in range(400):
        q.observe_verify(1, 0.0, verified=6, accepted=1)
    assert q.plan([(1, 0.0)]) == {1: 0}


def test_a_sequence_stops_where_drafting_does_not_pay_and_is_probed_with_a_full_block():
    p = DraftPolicy(max_tokens_per_step=7, probe_every=4)
    assert p.plan([(1, 0.0)]) == {1: 6}    # optimistic start: unmeasured buckets draft
    _measured(p, plain_ms=2.0, fixed_ms=3.0, row_ms=1.0)
    for _ in range(8):
        p.observe_verify(1, 0.0, verified=6, accepted=0)
    assert p.plan([(1, 0.0)])[1] > 0       # fewer than min_evidence verifies of its bucket: not settled yet
    for _ in range(9):                     # decayed counts: 17 verifies hold 16 of evidence
        p.observe_verify(1, 0.0, verified=6, accepted=0)
    assert p.plan([(1, 0.0)]) == {1: 0}
    p.observe_plain(1)
    for _ in range(3):                     # a plain step: planned, then folded
        assert p.plan([(1, 0.0)]) == {1: 0}
        p.observe_plain(1)
    # its fourth plain step: probed, with a full block, until the verify
    assert p.plan([(1, 0.0)]) == {1: 6} and p.plan([(1, 0.0)]) == {1: 6} and p.num_probes == 1
    p.observe_verify(1, 0.0, verified=6, accepted=0)
    assert p.plan([(1, 0.0)]) == {1: 0}
    # A new sequence of the same temperature is probed at once (evidence of its own, not only its bucket's),
    # then planned from its verify; another bucket drafts from its optimistic start.
    assert p.plan([(2, 0.0)]) == {2: 6}
    p.observe_verify(2, 0.0, verified=6, accepted=0)
    assert p.plan([(2, 0.0)]) == {2: 0} and p.plan([(3, 0.8)]) == {3: 6}


def test_one_slow_step_does_not_turn_drafting_off():
    p = DraftPolicy(max_tokens_per_step=7)
    _measured(p, plain_ms=2.0, fixed_ms=3.0, row_ms=0.2)
    for _ in range(20):
        p.observe_verify(1, 0.0, verified=6, accepted=6)
    assert p.plan([(1, 0.0)]) == {1: 6}
    p.observe_step(1, 6, 5000.0)           # a compile, a collection, a busy neighbour
    p.observe_step(1, 0, 0.01)
    assert p.plan([(1, 0.0)]) == {1: 6}


def test_a_drafted_step_is_never_priced_below_a_plain_one():
    # Blocks cut by confidence: 5 and 6 drafts, a noisy pair whose line would put A far below zero.
    p = DraftPolicy(max_tokens_per_step=7)
    for _ in range(4):
        p.observe_step(1, 0, 6.0)
        p.observe_step(1, 5, 12.0)
        p.observe_step(1, 6, 18.0)
    plain, fixed, row = p.step_costs(1)
    assert fixed >= plain and abs(fixed + row * 5.5 - 15.0) < 1e-9     # through the weighted mean
    for _ in range(50):
        p.observe_verify(1, 0.0, verified=6, accepted=6)
    assert p.plan([(1, 0.0)]) == {1: 6}


def test_drafting_starts_on_a_clear_win_and_stops_only_where_it_loses():
    p = DraftPolicy(max_tokens_per_step=2, margin=1.3)
    _measured(p, plain_ms=1.0, fixed_ms=1.5, row_ms=0.0, rows=(1,))
    for _ in range(400):                   # E(1) = 1.8 against a cost of 1.5 plain steps: a 1.2x win
        p.observe_verify(1, 0.0, verified=1, accepted=1)
        p.observe_verify(1, 0.0, verified=1, accepted=1)
        p.observe_verify(1, 0.0, verified=1, accepted=1)
        p.observe_verify(1, 0.0, verified=1, accepted=1)
        p.observe_verify(1, 0.0, verified=1, accepted=0)
    p.seqs[1].k = -1                       # not drafting: a 1.2x win is below the 1.3 margin to start
    assert p.plan([(1, 0.0)]) == {1: 0}
    p.seqs[1].k = 1                        # drafting: 1.2x still wins, so it goes on
    assert p.plan([(1, 0.0)]) == {1: 1}


def test_every_probe_every_drafted_steps_two_run_without_drafting():
    # The first of the two still verifies what it holds; the second is the plain decode that measures it.
    p = DraftPolicy(max_tokens_per_step=4, probe_every=3)
    due = []
    for _ in range(9):
        due.append(p.plain_probe_due())
        if not due[-1]:
            p.observe_step(2, 3, 1.0)
    assert due == [False, False, False, True, True, False, False, False, True]


def test_a_batch_size_with_drafted_steps_measured_and_plain_ones_not_runs_plain_until_it_is():
    p = DraftPolicy(max_tokens_per_step=4, probe_every=100)
    for _ in range(3):
        p.observe_step(8, 3, 40.0)                 # drafted steps at batch 8, no plain one there yet
    assert p.step_costs(8) == (1.0, 3.0, 0.0)       # the prior: a drafted step is 3 plain ones
    due = []
    for _ in range(8):
        due.append(p.plain_probe_due(8))
        if due[-1] and len(due) % 2 == 0:
            p.observe_step(8, 0, 10.0)             # the second of each pair is a plain decode
    assert due[:6] == [True] * 6 and due[6:] == [False, False]
    assert p.step_costs(8)[:2] == (10.0, 40.0)      # measured before any plain step: priced by those after
    assert not p.plain_probe_due(1)                 # another batch size: nothing measured there, no probe


def test_far_from_break_even_the_plain_cost_is_probed_four_times_less_often():
    p = DraftPolicy(max_tokens_per_step=4, probe_every=3)
    _measured(p, plain_ms=2.0, fixed_ms=3.0, row_ms=0.0, rows=(3,), batch=2)
    for _ in range(50):
        p.observe_verify(1, 0.0, verified=3, accepted=3)
    p.plan([(1, 0.0), (2, 0.0)])            # E = 4 a sequence, 8 tokens for 3 ms against 1 per ms: 2.7x
    assert p._last_win > 1.5
    p._drafted_steps = 0
    due = []
    for _ in range(14):
        due.append(p.plain_probe_due(2))
        if not due[-1]:
            p.observe_step(2, 3, 3.0)
    assert due == [False] * 12 + [True, True]


def test_a_drafter_that_is_never_accepted_stops_being_verified_and_outputs_do_not_change():
    ps = prompts(2, lo=4, hi=10, seed=3)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    counts = {}
    outs = {}
    for adaptive in (False, True):
        with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=3,
                 speculative_adaptive=adaptive) as llm:
            res = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
            outs[adaptive] = [o.outputs[0].token_ids for o in res]
            counts[adaptive] = llm.engine.get_stats().num_draft_tokens
    assert outs[True] == outs[False]
    # Always drafting: 3 drafts a step, every step. The policy: the first verifies, then a probe every 32
    # steps of each sequence.
    assert counts[False] > 400
    assert counts[True] < counts[False] / 4, counts


def test_a_dormant_buckets_steps_skip_the_drafters_context_and_outputs_do_not_change():
    ps = prompts(2, lo=4, hi=10, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=3,
             speculative_adaptive=True) as llm:
        spec = llm.engine.executor.worker.runner.spec
        writes = []
        inner = spec.extend_context
        spec.extend_context = lambda *a, **k: (writes.append(1), inner(*a, **k))
        want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                               use_tqdm=False)]
        assert writes
        policy = llm.engine.draft_policy
        policy.dormant[0], policy.explore_every = True, 10 ** 9
        drafts, writes[:] = llm.engine.get_stats().num_draft_tokens, []
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                              use_tqdm=False)]
        assert got == want and writes == []
        assert llm.engine.get_stats().num_draft_tokens == drafts


def test_without_sampled_drafting_a_sampled_sequence_never_drafts_probes_or_wants_context():
    """Graph mode on CPU, where a sampled drafted step costs about two plain ones for about 2 tokens: the policy
    there drafts for greedy sequences only (tests/MUTATIONS.md P28)."""
    p = DraftPolicy(7, draft_sampled=False)
    for _ in range(3):
        plan = p.plan([(1, 0.0), (2, 0.8)])
        assert plan[1] == 6 and plan[2] == 0, plan
    assert p.wants_context(1, 0.0) and not p.wants_context(2, 0.8)
    for _ in range(64):
        p.observe_plain(2)
        assert p.plan([(2, 0.8)])[2] == 0          # never probed
    assert DraftPolicy(7).plan([(3, 0.8)])[3] == 6  # by default a new sampled sequence is probed


def test_graph_mode_on_cpu_under_inductor_does_not_draft_for_sampled_requests(monkeypatch):
    from namazu.engine_config import EngineConfig, sampled_drafting_off

    monkeypatch.delenv("NAMAZU_GRAPH_BACKEND", raising=False)
    assert sampled_drafting_off(EngineConfig(enforce_eager=False, device="cpu"))
    assert not sampled_drafting_off(EngineConfig(enforce_eager=True, device="cpu"))
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")
    assert not sampled_drafting_off(EngineConfig(enforce_eager=False, device="cpu"))


def test_a_step_in_flight_across_a_pause_of_the_caller_is_not_timed():
    """LLM.generate returns with the next step launched (async scheduling); the next call collects it. Timed
    from its launch, it read the whole pause (other engines' generate calls: 50-120 plain steps) and the
    policy's cost fit stopped drafting where it paid 1.8x. tests/MUTATIONS.md P27."""
    import time

    # Answers that end at a stop token: the engine launches the next step before it sees the stop.
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(range(200, 264)))
    with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=3,
             speculative_adaptive=True) as llm:
        policy, rates = llm.engine.draft_policy, llm.engine.step_rates
        timed = []
        for attr, obj in (("observe_step", policy), ("observe", rates)):
            inner = getattr(obj, attr)
            setattr(obj, attr, lambda *a, _inner=inner: (timed.append(a[-1]), _inner(*a))[1])
        paused = 0
        for p in prompts(4, lo=4, hi=10, seed=5):
            llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)
            paused += llm.engine._in_flight is not None       # a step launched, collected by the next call
            time.sleep(0.3)
        assert paused and timed and max(timed) < 300.0, (paused, sorted(timed)[-3:])


@pytest.mark.parametrize("async_scheduling, schema", [(False, None), (True, {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id", "name"]})])
def test_the_engines_work_between_two_forwards_is_part_of_the_step(monkeypatch, async_scheduling, schema):
    """A grammar sequence is not planned until the step before it returns, so the engine's work on those
    results and on the next step's plan (its grammar walking every draft) runs between the forwards. Timed
    from the launch, a JSON-schema request's drafted step looked as cheap as a plain one plus its rows, and
    the policy drafted where it lost (graph mode, bf16, batch 1: 0.87x of speculation off). Here the plan's
    grammar rows are made slow (50 ms each step): every timed step includes them, with synchronous scheduling
    and with a JSON-schema request under async scheduling. (Where a step's plan overlaps the forward before
    it, that cycle already held it.) tests/MUTATIONS.md P29."""
    import time

    import namazu.engine.llm_engine as engine_mod

    real = engine_mod.fill_step_bitmask
    monkeypatch.setattr(engine_mod, "fill_step_bitmask", lambda *a: (time.sleep(0.05), real(*a))[1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=schema is None, json_schema=schema)
    with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=3,
             speculative_adaptive=True, async_scheduling=async_scheduling) as llm:
        policy = llm.engine.draft_policy
        timed = []
        inner = policy.observe_step
        policy.observe_step = lambda *a: (timed.append(a[-1]), inner(*a))[1]
        llm.generate(prompt_token_ids=prompts(2, lo=4, hi=10, seed=5), sampling_params=params, use_tqdm=False)
    assert len(timed) >= 4 and min(timed) >= 50.0, sorted(timed)[:3]


class ConstantProposer:
    """Drafts one token, always: where a grammar never allows it, every block is cut before its first draft."""

    on_device = True
    hidden_layers = (0,)

    def __init__(self, token: int):
        self.token, self.calls = token, 0

    def propose(self, inp, k):
        import torch

        from namazu.spec.proposer import Proposal

        self.calls += 1
        return Proposal(torch.full((inp.tokens.shape[0], k), self.token, dtype=torch.long, device=inp.tokens.device))


def test_a_draft_the_grammar_cuts_counts_as_rejected_and_the_sequence_stops_drafting():
    """A JSON-schema sequence whose every block the grammar cuts at its first draft verifies nothing, and
    was timed as a plain step: the policy never learnt that its drafts fail, and the drafter ran at every
    step of it. The cut draft counts as reached and rejected, so the policy stops drafting for it once its
    bucket holds the evidence (probes aside). tests/MUTATIONS.md P30."""
    from namazu.tokenizer import Tokenizer

    token = Tokenizer.from_pretrained(tiny_checkpoint()).encode("Q")
    assert len(token) == 1
    schema = {"type": "array", "items": {"enum": [7]}, "minItems": 48, "maxItems": 48}
    params = SamplingParams(temperature=0, max_tokens=200, json_schema=schema)
    prop = ConstantProposer(token[0])
    with LLM(tiny_checkpoint(), executor="inline", drafter=prop, num_speculative_tokens=3,
             speculative_adaptive=True) as llm:
        out = llm.generate(prompt_token_ids=prompts(1, lo=4, hi=10, seed=5), sampling_params=params, use_tqdm=False)
        steps = len(out[0].outputs[0].token_ids)
        reached = llm.engine.draft_policy.buckets[0].reached[0]
    assert steps > 90
    assert reached >= 16                      # the cut drafts were observed as verified and rejected
    assert prop.calls < steps / 2, (prop.calls, steps)


def test_sequences_due_a_probe_in_plain_steps_are_probed_together_once_every_probe_every_steps():
    # At batch 4 with probes due at staggered steps, one probe per sequence every 4 of its steps would draft
    # in most steps (the drafter runs for the whole batch); together they draft once in 4 plain steps.
    p = DraftPolicy(max_tokens_per_step=7, probe_every=4)
    _measured(p, plain_ms=2.0, fixed_ms=3.0, row_ms=1.0, batch=4)
    seqs = [(s, 0.0) for s in range(4)]
    for _ in range(20):
        for s, _t in seqs:
            p.observe_verify(s, 0.0, verified=6, accepted=0)
    plans = []
    for step in range(24):
        plan = p.plan(seqs[:1 + min(step, 3)])     # sequences join one step apart
        plans.append(plan)
        for s, k in plan.items():
            if k:
                p.observe_verify(s, 0.0, verified=6, accepted=0)
            else:
                p.observe_plain(s)
    drafted = [i for i, plan in enumerate(plans) if any(plan.values())]
    assert drafted and len(drafted) <= 24 // 4 + 1
    assert all(b - a >= 4 for a, b in zip(drafted, drafted[1:]))
    assert sum(len([k for k in plans[i].values() if k]) for i in drafted) > len(drafted)   # several per probe step


K = 6
HARD = [0, 1]                  # accepted drafts per verify, cycled: E(6) = 1.5 tokens
EASY = [6]                     # E(6) = 7


def _serve(p, sid, accepts, steps):
    """One request at batch 1 driven as the engine drives the policy: a step planned k > 0 drafts after it, and
    the next verifies the drafts it holds (up to its own plan). Returns the steps that verified."""
    held, verified, n = 0, [], 0
    for step in range(steps):
        k = p.plan([(sid, 0.0)])[sid]
        v = min(k, held)
        if v:
            p.observe_verify(sid, 0.0, verified=v, accepted=min(v, accepts[n % len(accepts)]))
            verified.append(step)
            n += 1
        else:
            p.observe_plain(sid)
        held = K if k else 0
    p.forget(sid)
    return verified


def _costed():
    # A drafted step costs 2.5 plain ones: full blocks win by 2.8x on EASY text and lose (0.6x) on HARD.
    p = DraftPolicy(max_tokens_per_step=K + 1)
    _measured(p, plain_ms=2.0, fixed_ms=5.0, row_ms=0.0, rows=(K,))
    return p


def test_after_hard_requests_an_easy_one_drafts_from_its_second_step():
    # One hard request turned its bucket off; the requests after it were planned from the bucket and seen only
    # through a probe every 32 of their steps (bench/RESULTS.md, round 3: auto 0.99x where drafting gave 1.36x).
    p = _costed()
    first = _serve(p, 1, HARD, 40)
    assert len(first) >= 16 and first[-1] < 39          # measured, then stopped
    second = _serve(p, 2, HARD, 40)                     # the arrival probe, one at 32 steps, then plain
    assert len(second) <= 3, second
    for sid in range(3, 7):
        easy = _serve(p, sid, EASY, 40)
        assert easy[0] == 1 and len(easy) >= 35, (sid, easy)     # drafted at its first step, verified at its second


def test_an_all_hard_stream_stays_off_at_one_drafted_step_a_request():
    p = _costed()
    p.dormant_window = 1000                 # (the dormant bucket: the test below)
    p._choices = [deque(maxlen=1000) for _ in range(4)]
    _serve(p, 1, HARD, 40)
    for sid in range(2, 12):
        verified = _serve(p, sid, HARD, 40)
        assert verified[0] == 1 and len(verified) <= 2, (sid, verified)    # its arrival probe, its 32-step probe
    assert len(p.past[0].rates) == 11


def test_a_bucket_whose_sequences_never_choose_to_draft_goes_dormant_and_an_explorer_wakes_it():
    """After 8 finished sequences of a temperature bucket that never chose to draft (probes aside), its new
    sequences neither draft nor probe, and want no drafter context (the step skips the drafter's context
    write, which they paid on every step); every 8th new one explores as before, and one that chooses to
    draft wakes the bucket. Buckets are independent."""
    p = _costed()
    assert len(_serve(p, 1, HARD, 40)) >= 16            # the optimistic start: it chose to draft, then stopped
    for sid in range(2, 10):
        assert p.wants_context(sid, 0.0) and not p.dormant[0]
        _serve(p, sid, HARD, 40)                         # its arrival probe (not a choice), then plain
    assert p.dormant[0] and not p.dormant[1]
    for sid in range(10, 17):                # arrivals 1-7 of the dormant bucket
        assert not p.wants_context(sid, 0.0)
        assert _serve(p, sid, EASY, 40) == []     # easy, but never tried: dormant
    assert p.dormant[0] and p.wants_context(100, 0.7)        # another bucket drafts on
    assert p.wants_context(17, 0.0)          # the 8th arrival explores
    assert len(_serve(p, 17, EASY, 40)) >= 30
    assert not p.dormant[0] and p.wants_context(18, 0.0)
    assert len(_serve(p, 18, EASY, 40)) >= 30


def test_a_sequence_is_weighed_against_past_sequences_not_their_pooled_verifies():
    # The hard request holds most of the bucket's verifies; the easy ones are as many requests.
    p = _costed()
    for sid, accepts, n in ((1, HARD, 100), (2, EASY, 10), (3, EASY, 10)):
        for i in range(n):
            p.observe_verify(sid, 0.0, verified=K, accepted=accepts[i % len(accepts)])
        p.forget(sid)
    assert p.buckets[0].rates()[1] < 0.5                # pooled: the hard request's verifies
    p.observe_verify(9, 0.0, verified=K, accepted=K)
    assert min(p.rates(p.seqs[9])) > 0.9 and p.plan([(9, 0.0)]) == {9: K}
    p.observe_verify(10, 0.0, verified=K, accepted=0)   # one that rejects its first draft is planned off
    assert p.rates(p.seqs[10])[0] < 0.6 and p.plan([(10, 0.0)]) == {10: 0}


def test_a_probe_does_not_start_drafting_below_the_margin():
    # Drafting's win here is 1.2x: it goes on where it is on, but a probe's full block is not a choice to draft.
    p = DraftPolicy(max_tokens_per_step=2, margin=1.3, probe_every=4)
    _measured(p, plain_ms=1.0, fixed_ms=1.5, row_ms=0.0, rows=(1,))
    for _ in range(400):
        for a in (1, 1, 1, 1, 0):
            p.observe_verify(1, 0.0, verified=1, accepted=a)
    p.seqs[1].k = 0
    for _ in range(4):
        assert p.plan([(1, 0.0)]) == {1: 0}
        p.observe_plain(1)
    assert p.plan([(1, 0.0)]) == {1: 1} and p.plan([(1, 0.0)]) == {1: 1}      # the probe: drafts, verifies
    p.observe_verify(1, 0.0, verified=1, accepted=1)
    assert p.plan([(1, 0.0)]) == {1: 0}


@pytest.mark.parametrize("padded_rows", [False, True])
def test_a_drafted_step_is_priced_against_the_plain_steps_measured_beside_it(padded_rows):
    # bench/RESULTS.md, "The draft policy per sequence": drafting off, the drafted steps' window gained a sample a
    # probe, in a busy spell; the plain steps after it were quick again. In ms, a drafted step stood at 8.8
    # plain ones where it costs 2.2, and an easy request whose probe accepted 6 of 6 drafts never drafted.
    p = DraftPolicy(max_tokens_per_step=K + 1, padded_rows=padded_rows)
    for _ in range(4):                                  # busy: a probe's drafted step among slow plain ones
        for ms in (8.0,) * 4 + (None,) + (8.0,) * 4:
            p.observe_step(1, K if ms is None else 0, 17.6 if ms is None else ms)
    for _ in range(32):                                 # quiet again: only plain steps measured
        p.observe_step(1, 0, 2.0)
    hard = _serve(p, 1, HARD, 40)                       # settles the bucket, and stops
    assert len(hard) >= 16 and hard[-1] < 39
    easy = _serve(p, 2, EASY, 40)
    assert easy[0] == 1 and len(easy) >= 35, easy       # drafted from its second step
    plain, fixed, row = p.step_costs(1)
    assert plain == 2.0 and abs(fixed - 4.4) < 1e-9 and row == 0.0     # 2.2 plain steps of today's


def test_while_drafting_a_drafted_step_is_priced_against_the_plain_steps_after_it_too():
    # Drafting on, plain steps are measured once a probe (here every 8 drafted steps). The machine slows down
    # between two probes; the drafted steps after that are slow, the plain steps before them are not, and
    # drafting stops: the plain steps measured after them (every step now) say what they cost.
    p = DraftPolicy(max_tokens_per_step=K + 1)
    for _ in range(3):
        p.observe_step(1, 0, 2.0)
        for _ in range(8):
            p.observe_step(1, K, 4.4)
    for _ in range(32):
        p.observe_step(1, K, 13.2)                      # busy: 2.2 plain steps, if any had been measured
    for _ in range(8):
        p.observe_step(1, 0, 6.0)
    plain, fixed, row = p.step_costs(1)
    assert plain == 6.0 and abs(fixed - 13.2) < 1e-9 and row == 0.0


def test_blocks_the_plan_chose_calibrate_what_it_expects_of_the_next():
    """The plan drafts where its estimate is high, so the blocks it picks get fewer drafts accepted than it
    expected (the shipped drafter at T=0.8 through the engine: 3.03 tokens a verify expected, 2.44 got).
    Here a sequence's own counts say 3 of 6 drafts are accepted (E = 4 tokens, worth a drafted step that
    costs 3 plain ones), but chosen blocks of other sequences in its temperature bucket keep getting one:
    once 16 such blocks are in, its expectation is scaled by what they realised and the plan stops drafting.
    A probe's block (nobody chose it) teaches the calibration nothing."""
    p = DraftPolicy(max_tokens_per_step=7, margin=1.0, padded_rows=True)
    _measured(p, plain_ms=2.0, fixed_ms=6.0, row_ms=0.0, rows=(6,))
    for _ in range(40):
        p.observe_verify(1, 0.8, verified=6, accepted=3)
    assert p.plan([(1, 0.8)]) == {1: 6}
    cal = p.calibration[p.seqs[1].bucket]
    drafting = 0
    for _ in range(20):                       # sequence 1's own chosen blocks realise 1 of the 3 expected
        k = p.plan([(1, 0.8)])[1]
        drafting += k > 0
        if k:
            p.observe_verify(1, 0.8, verified=k, accepted=1)
        else:
            p.observe_plain(1)
    assert cal.blocks >= 16 and cal.factor < 0.5
    assert p.plan([(1, 0.8)]) == {1: 0}
    assert 16 <= drafting < 20


def test_a_probes_block_does_not_calibrate_the_plan():
    """A probe drafts a block nobody chose (drafting does not pay here: a drafted step costs 10 plain ones),
    so what it realises says nothing of the plan's estimates."""
    p = DraftPolicy(max_tokens_per_step=7, padded_rows=True, dormant_window=1000)
    _measured(p, plain_ms=2.0, fixed_ms=20.0, row_ms=0.0, rows=(6,))
    for _ in range(40):
        p.observe_verify(1, 0.8, verified=6, accepted=0)
    p.forget(1)
    for sid in range(2, 40):
        assert p.plan([(sid, 0.8)]) == {sid: 6} and p.seqs[sid].forced      # its arrival probe
        p.observe_verify(sid, 0.8, verified=6, accepted=0)
        p.forget(sid)
    assert all(c.blocks == 0 for c in p.calibration)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_new_request_verifies_drafts_at_its_first_decode_step(adaptive):
    """The step that prefills a new request drafts after it, so its first decode step verifies, as when always
    drafting. The plan ran before the schedule admitted the request; planned only at its first decode step,
    that step was a plain step that drafted, and every request took a step more (graph mode, batch 1, answers
    of about 25 tokens: the default decoded at 0.86x of always drafting)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=3,
             speculative_adaptive=adaptive) as llm:
        eng = llm.engine
        # Two requests: by the third, the policy has measured drafted steps and no plain one, and runs two
        # plain steps to measure them (`plain_probe_due`), the prefill step among them.
        for i, ids in enumerate(prompts(2, lo=4, hi=10, seed=5)):
            before = eng.get_stats().num_draft_tokens
            eng.add_request(f"r{i}", None, params, prompt_token_ids=ids, stream=True)
            made = 0
            while made < 2:                   # the prefill's token, then the first decode step's
                for out in eng.step():
                    made = len(out.outputs[0].token_ids)
            assert eng.get_stats().num_draft_tokens - before == 3, i
            eng.abort_request([f"r{i}"])
            while eng.has_unfinished_requests():
                eng.step()


def test_a_new_sequence_admitted_after_the_plan_is_probed_unless_the_step_drafts_for_no_one_else():
    p = DraftPolicy(max_tokens_per_step=7)
    assert p.plan_admitted([(1, 0.0)], others_draft=True) == {1: 6}
    assert p.seqs[1].forced and p.seqs[1].probe       # a probe: not a choice, and again at its next plan
    assert p.plan([(1, 0.0)]) == {1: 6}
    assert p.plan_admitted([(2, 0.0)], others_draft=False) == {2: 0}
    p = DraftPolicy(max_tokens_per_step=7, draft_sampled=False)
    assert p.plan_admitted([(3, 0.7)], others_draft=True) == {3: 0}      # never drafts: no probe either


def test_blocks_planned_before_the_bucket_settles_do_not_calibrate_the_plan():
    """A bucket starts optimistic (every draft accepted), so its first blocks expect more than any drafter
    gets; that is the prior, not the choice's bias, and the calibration learns only from blocks planned once
    the bucket holds `min_evidence` verifies (at T = 0, the 16 early blocks had set the factor to 0.58 and a
    sequence whose own estimate was right went plain: 49 steps where drafting took 24)."""
    p = DraftPolicy(max_tokens_per_step=7, padded_rows=True)
    _measured(p, plain_ms=2.0, fixed_ms=4.0, row_ms=0.0, rows=(6,))
    cal = p.calibration[0]
    for _ in range(15):
        assert p.plan([(1, 0.0)]) == {1: 6}
        p.observe_verify(1, 0.0, verified=6, accepted=2)
    assert cal.blocks == 0
    for _ in range(20):
        if p.plan([(1, 0.0)])[1]:
            p.observe_verify(1, 0.0, verified=6, accepted=2)
    assert cal.blocks > 0 and 0.9 < cal.factor <= 1.0      # E from its own counts: about what it gets
