"""Presence, frequency and repetition penalties by their effect: greedy outputs under each penalty equal a
step-by-step reference decode that applies the penalty in plain torch to the dense model's logits."""
import pytest
import torch
from engine_helpers import assert_greedy_equal, dense_model, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams

MAX_TOKENS = 16
CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=1.2, presence_penalty=-1.2),   # only second and later occurrences pay
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),              # < 1 favours seen tokens
    dict(presence_penalty=-0.8, frequency_penalty=0.9, repetition_penalty=1.3),
]


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """The OpenAI / vLLM definitions, token by token: repetition divides positive and multiplies negative
    logits of every token seen in the prompt or the output; frequency subtracts per occurrence in the
    output, presence once per token present in the output."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition_penalty if out[t] > 0 else out[t] * repetition_penalty
    for t in set(output):
        out[t] -= frequency_penalty * output.count(t) + presence_penalty
    return out


@torch.no_grad()
def reference_decode(prompt: list[int], penalties: dict) -> tuple[list[int], list[float]]:
    model = dense_model(tiny_checkpoint())
    output: list[int] = []
    gaps = []
    for _ in range(MAX_TOKENS):
        hidden, _ = model(torch.tensor([prompt + output]))
        logits = penalised(model.compute_logits(hidden[0, -1]).float(), prompt, output, **penalties)
        top = logits.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        output.append(int(top.indices[0]))
    return output, gaps


@pytest.fixture(scope="module")
def batch():
    # Two prompts per case; the first repeats a few tokens so the repetition penalty touches the prompt.
    ps = prompts(2 * len(CASES), lo=6, hi=14, seed=41)
    ps[0] = ps[0] + ps[0][:4]
    return ps


@pytest.fixture(scope="module")
def references(batch):
    return [reference_decode(p, CASES[i // 2]) for i, p in enumerate(batch)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_under_penalties_equals_the_reference_decode(batch, references, async_scheduling):
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **CASES[i // 2])
              for i in range(len(batch))]
    with LLM(tiny_checkpoint(), executor="inline", dtype="float32", async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
    for out, (ref, gaps) in zip(outs, references):
        assert_greedy_equal(out.outputs[0].token_ids, ref, gaps)


def test_the_penalties_change_these_outputs(batch, references):
    """Guards the test above against cases the penalties would not affect."""
    plain = [reference_decode(p, {})[0] for p in batch]
    assert all(ref != base for (ref, _), base in zip(references, plain))
