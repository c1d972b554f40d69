"""Verify step end to end: scripted drafts (always right, always wrong, random) leave outputs identical
to decoding without speculation, greedy and seeded sampling alike; the ngram drafter is wired to flags.

"Identical" is `assert_same_outputs`: a verify step scores 1 + k rows per sequence where a decode scores
one, so the target's logits agree to rounding; the runs may part only where the decision is a near-tie."""
import pytest
from engine_helpers import assert_same_outputs, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.spec.drafters import ScriptedDrafter

K = 3


def run(prompt_ids, params, drafter=None, **kw):
    with LLM(tiny_checkpoint(), executor="inline", drafter=drafter,
             num_speculative_tokens=K if drafter is not None or kw.get("speculative_method") else 0,
             **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


@pytest.fixture(scope="module")
def batch():
    return prompts(6, lo=3, hi=20, seed=5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=14, ignore_eos=True),
], ids=["greedy", "seeded-sampling"])
def test_scripted_drafts_leave_outputs_identical(batch, params):
    base, _ = run(batch, params)
    reference = {tuple(p): out for p, out in zip(batch, base)}
    vocab = 264
    right, s_right = run(batch, params, ScriptedDrafter("right", vocab, reference))
    wrong, s_wrong = run(batch, params, ScriptedDrafter("wrong", vocab, reference))
    rand, s_rand = run(batch, params, ScriptedDrafter("random", vocab, seed=3))
    for got in (right, wrong, rand):
        assert_same_outputs(tiny_checkpoint(), batch, params, got, base)
    assert s_right.num_draft_tokens > 0 and s_right.num_accepted_draft_tokens == s_right.num_draft_tokens
    # Every accepted draft saves a step.
    assert s_right.num_steps < s_wrong.num_steps
    assert s_wrong.num_draft_tokens > 0 and s_wrong.num_accepted_draft_tokens == 0
    assert s_rand.num_draft_tokens > 0


def test_stochastic_drafts_are_exact_at_temperature_zero(batch):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base, _ = run(batch, params)
    got, stats = run(batch, params, ScriptedDrafter("random_q", 264, seed=4))
    assert_same_outputs(tiny_checkpoint(), batch, params, got, base)
    assert stats.num_draft_tokens > 0


def test_stochastic_drafts_sample_valid_tokens(batch):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    got, stats = run(batch, params, ScriptedDrafter("random_q", 264, seed=4))
    assert all(len(g) == 10 and all(0 <= t < 264 for t in g) for g in got)
    assert stats.num_draft_tokens > 0


def test_ngram_drafter_from_engine_flags():
    # A prompt that repeats itself gives prompt lookup something to find.
    loop = prompts(1, 12, 12, seed=9)[0] * 4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base, _ = run([loop], params)
    got, stats = run([loop], params, speculative_method="ngram", ngram_max=3)
    assert_same_outputs(tiny_checkpoint(), [loop], params, got, base)
    assert stats.num_draft_tokens > 0


class HiddenStateProposer:
    """A device proposer for tests: drafts from this forward's hidden states (of layer 0, and the final
    ones), on the device, without reading anything back. Its drafts are mostly wrong, sometimes right
    (draft 0 copies the emitted bonus token's successor guess from the final hidden state)."""

    on_device = True
    hidden_layers = (0,)

    def __init__(self):
        self.calls = 0

    def propose(self, inp, k):
        import torch

        from namazu.spec.proposer import Proposal

        self.calls += 1
        h0, final = inp.hidden[0], inp.final_hidden
        assert h0.shape == final.shape and h0.dim() == 2 and inp.rows.shape[0] == inp.tokens.shape[0]
        last = inp.rows.gather(1, inp.accepted.unsqueeze(-1)).squeeze(-1)      # the bonus token's row
        guess = (final[last].abs().argmax(-1) + h0[last].abs().argmax(-1)) % 264
        ids = torch.stack([(guess + j) % 264 for j in range(k)], dim=1)
        counts = torch.full_like(guess, k) - (inp.tokens[:, 0] % 2)          # sometimes fewer than k
        return Proposal(ids, counts=counts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_proposer_reads_hidden_states_and_is_exact(batch, async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base, _ = run(batch, params)
    proposer = HiddenStateProposer()
    got, stats = run(batch, params, proposer, async_scheduling=async_scheduling, debug_no_host_sync=True)
    assert_same_outputs(tiny_checkpoint(), batch, params, got, base)
    assert proposer.calls > 0 and stats.num_draft_tokens > 0
