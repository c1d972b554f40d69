"""logit_bias (OpenAI's token id -> bias) in the sampler, on the device: greedy decoding with a bias equals
the dense oracle's argmax of (logits + bias), with speculation (every verify row biased) and under a
grammar; a verify batch trimmed by the worker keeps each entry on its row."""
import numpy as np
import pytest
import torch
from engine_helpers import NEAR_TIE, dense_model, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.layers.sampler import Sampler, SamplingTensors, leaves_logits_raw, process_logits
from namazu.spec.drafters import ScriptedDrafter
from namazu.step.batch import trim_drafts

VOCAB = 264


def _tensors(rows: int, bias=None, values=None, temperature=0.0) -> SamplingTensors:
    full = lambda v, dt=torch.float32: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingTensors(temperature=full(temperature), top_k=full(VOCAB, torch.long), top_p=full(1.0),
                           min_p=full(0.0), presence_penalty=full(0.0), frequency_penalty=full(0.0),
                           repetition_penalty=full(1.0), seeds=full(1, torch.long), counters=full(0, torch.long),
                           bias=bias, bias_values=values, all_greedy=temperature == 0)


def test_sampler_adds_each_entry_on_its_row_only():
    logits = torch.randn(3, VOCAB)
    bias = torch.tensor([[0, 0, 2], [5, 7, 5]])
    values = torch.tensor([100.0, -3.0, 100.0])
    t = _tensors(3, bias, values)
    out = process_logits(logits, t)
    expected = logits.clone()
    expected[0, 5] += 100.0
    expected[0, 7] -= 3.0
    expected[2, 5] += 100.0
    assert torch.equal(out, expected)
    assert not leaves_logits_raw(t) and leaves_logits_raw(_tensors(3))
    tokens = Sampler()(logits, t).token_ids.tolist()
    assert tokens[0] == 5 and tokens[2] == 5 and tokens[1] == int(logits[1].argmax())
    # -100 bans a token in practice, also when sampling.
    ban = _tensors(1, torch.tensor([[0], [int(logits[1].argmax())]]), torch.tensor([-100.0]), temperature=1.0)
    for seed in range(50):
        ban.seeds.fill_(seed)
        assert Sampler()(logits[1:2], ban).token_ids.item() != int(logits[1].argmax())


@torch.no_grad()
def _oracle(prompt: list[int], n: int, bias: dict[int, float], allowed: list[int] | None = None):
    """Greedy by full recomputation over (logits + bias), masked to `allowed`; the top-2 gaps."""
    model = dense_model(tiny_checkpoint())
    b = torch.zeros(VOCAB)
    for t, v in bias.items():
        b[t] = v
    ids, gaps = list(prompt), []
    for _ in range(n):
        hidden, _ = model(torch.tensor([ids]))
        logits = model.compute_logits(hidden[0, -1]).float()[:VOCAB] + b
        if allowed is not None:
            mask = torch.full_like(logits, float("-inf"))
            mask[allowed] = 0
            logits = logits + mask
        top = logits.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps


def _agree(got: list[int], ref: list[int], gaps: list[float]) -> None:
    for i, (a, r) in enumerate(zip(got, ref)):
        if a != r:
            assert gaps[i] < NEAR_TIE, f"differs at {i}: {a} vs {r} (gap {gaps[i]:.2e})"
            return
    assert len(got) == len(ref)


def _bias(seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(256, 60, replace=False).tolist()
    return {int(t): float(v) for t, v in zip(ids, rng.uniform(-100, 100, len(ids)).round(2))}


def _run(batch, params, **kw):
    with LLM(tiny_checkpoint(), **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=params,
                                                             use_tqdm=False)], llm.engine.get_stats()


@pytest.mark.parametrize("executor", ["inline", "mp"])
def test_greedy_with_bias_is_the_oracles_argmax(executor):
    batch = prompts(4, lo=3, hi=20, seed=11)
    n = 10
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias=_bias(i)) for i in range(4)]
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    got, _ = _run(batch, params, executor=executor, num_speculative_tokens=0)
    base, _ = _run(batch, plain, executor=executor, num_speculative_tokens=0)
    for p, g, b, sp in zip(batch, got, base, params):
        ref, gaps = _oracle(p, n, sp.logit_bias)
        _agree(g, ref, gaps)
        assert g != b            # the bias changed the answer (else this test could not fail)


def test_bias_holds_on_every_verify_row():
    batch = prompts(4, lo=3, hi=20, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=_bias(10 + i))
              for i in range(4)]
    base, _ = _run(batch, params, executor="inline", num_speculative_tokens=0)
    reference = {tuple(p): out for p, out in zip(batch, base)}
    right, s_right = _run(batch, params, executor="inline", drafter=ScriptedDrafter("right", VOCAB, reference),
                          num_speculative_tokens=3)
    rand, s_rand = _run(batch, params, executor="inline", drafter=ScriptedDrafter("random", VOCAB, seed=2),
                        num_speculative_tokens=3)
    assert right == base and rand == base
    # Drafts that are right under the bias are all accepted: the verify rows see the bias too.
    assert s_right.num_draft_tokens > 0 and s_right.num_accepted_draft_tokens == s_right.num_draft_tokens
    assert s_rand.num_draft_tokens > 0


def test_bias_under_a_grammar():
    batch = prompts(2, lo=3, hi=12, seed=13)
    allowed = list(range(97, 123))
    bias = {100: 100.0, 101: 50.0, 102: -100.0}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias, allowed_token_ids=allowed)
    got, _ = _run(batch, params, executor="inline", num_speculative_tokens=0)
    for p, g in zip(batch, got):
        ref, gaps = _oracle(p, 8, bias, allowed)
        _agree(g, ref, gaps)
        assert all(t in allowed for t in g)


def test_trim_drafts_keeps_each_entry_on_its_row():
    from namazu.step.batch import (
        AttentionInputs,
        PromptLogprobInputs,
        SamplingInputs,
        SeqInputs,
        SpecInputs,
        StepBatch,
        attention_layout,
        sampled_row_layout,
    )

    # Two sequences verifying 2 drafts each: rows 0-2 are sequence 0's, rows 3-5 sequence 1's.
    num_new, drafts = np.array([1, 1]), np.array([2, 2])
    attn: AttentionInputs = attention_layout(np.arange(6), np.array([5, 9]), num_new, drafts, np.array([True, True]),
                                             np.zeros((2, 1), np.int64))
    seqs = SeqInputs(np.array([0, 1]), np.array([5, 9]), num_new, drafts, np.zeros(2, np.int64), np.array([3, 3]),
                     np.array([True, True]), np.array([1, 1]))
    r = 6
    f = np.ones(r, np.float32)
    i = np.arange(r, dtype=np.int64)
    sp = SamplingInputs(f * 0, i, f, f * 0, f * 0, f * 0, f, i, i, None, False, False, False, False, True, -1,
                        bias=np.array([[0, 2, 3, 5], [10, 12, 13, 15]]), bias_values=np.array([1, 2, 3, 4], np.float32))
    b = StepBatch(attn, seqs, sp, SpecInputs(sampled_row_layout(drafts), np.array([0, 1]), np.array([False, False])),
                  PromptLogprobInputs(np.zeros(0, np.int64), np.zeros(0, np.int64), -1))
    t = trim_drafts(b, np.array([0, 2]))        # sequence 0 keeps no draft: its rows 1 and 2 go
    assert t.sampling.bias.tolist() == [[0, 1, 3], [10, 13, 15]]     # row 3 is now row 1, row 5 row 3
    assert t.sampling.bias_values.tolist() == [1, 3, 4]
