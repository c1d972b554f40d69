"""The draft policy (engine/draft_policy.py): a sequence drafts while its measured tokens per verify step
beat the measured cost of a drafted step relative to a plain one, stops where they do not, and is probed
again; through the engine, a drafter whose drafts are never accepted stops being verified, and greedy
outputs stay those of speculation off (tests/MUTATIONS.md P2)."""
from engine_helpers import prompts, tiny_checkpoint
from test_dflash import make_proposer

from namazu import LLM, SamplingParams
from namazu.engine.draft_policy import DraftPolicy


def test_a_sequence_stops_drafting_where_its_tokens_per_step_do_not_beat_the_measured_cost():
    p = DraftPolicy(max_tokens_per_step=7, probe_every=4)
    assert p.wants(1, 0.0) and p.ratio(1) == p.prior_ratio
    for _ in range(3):
        p.observe_step(1, True, 6.0)
        p.observe_step(1, False, 2.0)
    assert abs(p.ratio(1) - 3.0) < 1e-9
    for _ in range(8):
        p.observe_verify(1, 0.0, 5, batch=1)      # 5 tokens per drafted step at 3x the cost: pays
    assert p.wants(1, 0.0)
    for _ in range(12):
        p.observe_verify(1, 0.0, 2, batch=1)      # 2 tokens at 3x: a loss
    assert not p.wants(1, 0.0)
    for _ in range(3):
        p.observe_plain(1)
    assert not p.wants(1, 0.0)
    p.observe_plain(1)                            # the fourth plain step: probed again
    assert p.wants(1, 0.0) and p.num_probes == 1
    # A new sequence of the same temperature starts from what its bucket measured; another bucket does not.
    p.bucket_ema[0] = 1.2
    assert not p.wants(2, 0.0) and p.wants(3, 0.8)


def test_every_probe_every_drafted_steps_two_run_without_drafting():
    # The first of the two still verifies what it holds; the second is the plain decode that measures r.
    p = DraftPolicy(max_tokens_per_step=4, probe_every=3)
    due = []
    for _ in range(9):
        due.append(p.plain_probe_due())
        if not due[-1]:
            p.observe_step(2, True, 1.0)
    assert due == [False, False, False, True, True, False, False, False, True]


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
