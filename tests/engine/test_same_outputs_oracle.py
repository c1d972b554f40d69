"""The oracle behind `assert_same_outputs` (tests/harness/engine_helpers.py), which the tests of namazu's
identity promises (speculation on and off, graph mode and eager, TP 1 and 4, batch 1 and 16, async and
sync scheduling) use: it replays each sampling decision with the dense model, and only a difference at a
decision that is a near-tie there is excused."""
import engine_helpers
import pytest
from engine_helpers import assert_same_outputs, decision_gap, decision_scores, dense_greedy, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams

ASCII = list(range(65, 91))
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=3, top_k=30, max_tokens=8, presence_penalty=0.8, frequency_penalty=0.5,
                   repetition_penalty=1.4, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=4, max_tokens=8, allowed_token_ids=ASCII),
    SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=ASCII, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.1, seed=9, max_tokens=8, ignore_eos=True),
]


@pytest.fixture(scope="module")
def run():
    batch = prompts(len(PARAMS), lo=3, hi=30, seed=13)
    with LLM(tiny_checkpoint(), executor="inline") as llm:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=PARAMS, use_tqdm=False)
    return batch, [[c.token_ids for c in o.outputs] for o in outs]


def test_replayed_decisions_are_the_engines(run):
    """Greedy and seeded rows, penalties, allowed ids, top-k/top-p/min-p, a second sequence's seed: the
    argmax of every replayed decision is the token the engine emitted (the dense model's logits are the
    engine's to rounding, so a near-tie may pick the other candidate; none is expected in these 60 decisions)."""
    batch, outs = run
    n = 0
    for prompt, params, seqs in zip(batch, PARAMS, outs):
        for index, tokens in enumerate(seqs):
            for i, token in enumerate(tokens):
                scores = decision_scores(tiny_checkpoint(), prompt, tokens[:i], params, index)
                assert scores is not None, (params, index, i)
                behind = float(scores.max() - scores[token]) * (params.temperature or 1.0)   # logit units
                assert behind < engine_helpers.NEAR_TIE, (params, index, i, behind)
                n += 1
    assert n == sum(len(t) for seqs in outs for t in seqs) > 50
    ref, gaps = dense_greedy(tiny_checkpoint(), batch[0], 8)
    assert [decision_gap(tiny_checkpoint(), batch[0], ref[:i], PARAMS[0]) for i in range(8)] == gaps


def test_only_a_near_tie_excuses_a_difference(run, monkeypatch):
    batch, outs = run
    assert assert_same_outputs(tiny_checkpoint(), batch, PARAMS, outs, outs) == set()
    changed = [[list(t) for t in seqs] for seqs in outs]
    changed[4][0][3] = (changed[4][0][3] + 1) % 256           # another token where the model is not near a tie
    with pytest.raises(AssertionError, match="request 4 sequence 0 differs at token 3"):
        assert_same_outputs(tiny_checkpoint(), batch, PARAMS, changed, outs)
    changed[4][0] = changed[4][0][:5]                         # ... and what follows it is not compared
    monkeypatch.setattr(engine_helpers, "NEAR_TIE", float("inf"))
    assert assert_same_outputs(tiny_checkpoint(), batch, PARAMS, changed, outs) == {4}
    # A decision the oracle cannot replay (a grammar, an engine-drawn seed) is never excused.
    unseeded = [SamplingParams(temperature=0.9, max_tokens=8)] * len(PARAMS)
    with pytest.raises(AssertionError, match="gap there: None"):
        assert_same_outputs(tiny_checkpoint(), batch, unseeded, changed, outs)
