"""Values that vanish in float32 (issue 34, item 9): validation accepted them in float64, the sampler
computed in float32 and emitted padding. They are clamped (temperature to greedy, top_p to a value that
keeps the same token) or refused (repetition_penalty, which divides logits)."""
from __future__ import annotations

import pytest
import torch

from namazu.layers.sampler import Sampler, SamplingTensors
from namazu.sampling_params import MIN_TOP_P, SamplingParams


def _tensors(p: SamplingParams, s: int, v: int) -> SamplingTensors:
    # What the batch builder does with a request's settings: float32 rows.
    return SamplingTensors(
        temperature=torch.full((s,), p.temperature, dtype=torch.float32),
        top_k=torch.full((s,), v, dtype=torch.long), top_p=torch.full((s,), p.top_p, dtype=torch.float32),
        min_p=torch.zeros(s), presence_penalty=torch.zeros(s), frequency_penalty=torch.zeros(s),
        repetition_penalty=torch.ones(s), seeds=torch.arange(s, dtype=torch.long) + 1,
        counters=torch.zeros(s, dtype=torch.long), num_logprobs=-1, all_greedy=p.temperature == 0,
        any_top_k_top_p=p.top_p < 1.0)


@pytest.mark.parametrize("kw", [{"temperature": 1e-45}, {"temperature": 1e-38}, {"temperature": 1e-20},
                                {"top_p": 1e-300}, {"top_p": 1e-46}, {"temperature": 0.8, "top_p": 1e-300}])
def test_vanishing_values_sample_the_most_likely_token(kw):
    torch.manual_seed(0)
    s, v = 16, 500
    logits = torch.randn(s, v) * 4
    p = SamplingParams(**kw)
    assert torch.tensor(p.top_p, dtype=torch.float32) > 0
    assert p.temperature == 0 or p.temperature >= 1e-5
    out = Sampler()(logits, _tensors(p, s, v))
    assert torch.equal(out.token_ids, logits.argmax(-1)), kw


def test_clamps_keep_ordinary_values():
    assert SamplingParams(temperature=0.7, top_p=0.9).temperature == 0.7
    assert SamplingParams(top_p=0.9).top_p == 0.9
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P


@pytest.mark.parametrize("bad", [1e-300, 1e-40, 0.0])
def test_a_vanishing_repetition_penalty_is_refused(bad):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=bad)
