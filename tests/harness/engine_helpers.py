"""Shared pieces of the engine tests: a tiny random checkpoint, prompts, and the dense greedy oracle."""
from __future__ import annotations

import dataclasses
import functools
import tempfile

import numpy as np
import torch

from namazu.assets.random_model import write_random_checkpoint
from namazu.models.loader import load_model

# Two fp32 evaluations of namazu-tiny-sized logits (|logit| < ~20) that differ only in summation order
# (another GEMM blocking: batch size, verify vs decode rows, threads, CPU, TP partial sums, a compiled
# kernel) agree to ~1e-5 (measured: docs/engine.md, "What is bit-identical, and where"). A decision whose
# two best candidates are closer than this may go either way; any real defect moves logits by far more.
NEAR_TIE = 1e-4


@functools.cache
def tiny_checkpoint(seed: int = 0) -> str:
    """Written once per test process (deterministic: same seed, same files)."""
    path = tempfile.mkdtemp(prefix=f"namazu-tiny-random-{seed}-")
    write_random_checkpoint(path, size="tiny", seed=seed)
    return path


@functools.cache
def dense_model(path: str):
    return load_model(path, dtype="float32", progress=False)


def prompts(n: int, lo: int = 3, hi: int = 40, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    """Random byte-token prompts (ids < 256: never a special token)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        body = rng.integers(0, 256, int(rng.integers(lo, hi + 1))).tolist()
        out.append((prefix or []) + body)
    return out


@torch.no_grad()
def dense_greedy(path: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recomputation without any cache (the oracle), and the top-2 logit gap
    at each generated position."""
    model = dense_model(path)
    ids = list(prompt)
    gaps = []
    for _ in range(max_tokens):
        hidden, _ = model(torch.tensor([ids]))
        logits = model.compute_logits(hidden[0, -1])
        top = logits.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps


def assert_greedy_equal(got: list[int], ref: list[int], gaps: list[float]) -> None:
    """Equal up to the first position where the reference itself is a near-tie (then either pick is right)."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"differs at {i}: {a} vs {b} (reference top-2 gap {gaps[i]:.2e})"
            return
    assert len(got) == len(ref), f"length {len(got)} vs {len(ref)}"


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def decision_scores(path: str, prompt: list[int], prefix: list[int], params, index: int = 0
                    ) -> torch.Tensor | None:
    """The scores [V] whose argmax is the sampler's decision for the token after `prompt + prefix`,
    recomputed with the dense fp32 model and the engine's own sampling functions (penalties,
    `allowed_token_ids`, temperature, top-k/top-p/min-p, the seeded race of sequence `index`). None
    where the decision depends on more than these (a grammar, `min_tokens`' banned end tokens, an
    engine-drawn seed)."""
    from namazu.layers.sampler import SamplingTensors, gumbel_noise, pack_bitmask, process_logits

    if (params.grammar_factory or params.json_schema or params.json_object or params.regex or params.grammar
            or params.tool_calls or len(prefix) < params.min_tokens
            or (params.temperature > 0 and params.seed is None)):
        return None
    model = dense_model(path)
    hidden, _ = model(torch.tensor([prompt + prefix]))
    logits = model.compute_logits(hidden[0, -1:]).float()
    v = logits.shape[-1]
    greedy = params.temperature == 0
    penalty = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1

    def one(x, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([x], dtype=dtype)

    seed = (params.seed + 1_000_003 * index) % 2**63 if params.seed is not None else 0
    t = SamplingTensors(
        temperature=one(params.temperature), top_k=one(params.top_k if params.top_k > 0 else v, torch.int64),
        top_p=one(params.top_p), min_p=one(params.min_p), presence_penalty=one(params.presence_penalty),
        frequency_penalty=one(params.frequency_penalty), repetition_penalty=one(params.repetition_penalty),
        seeds=one(seed, torch.int64), counters=one(len(prefix), torch.int64),
        output_counts=torch.bincount(torch.tensor(prefix, dtype=torch.int64), minlength=v)[None, :v].float()
        if penalty else None,
        prompt_mask=torch.zeros(1, v, dtype=torch.bool).index_fill_(1, torch.tensor(prompt), True)
        if penalty else None,
        bitmask=None, any_penalty=penalty, any_top_k_top_p=0 < params.top_k < v or params.top_p < 1,
        any_min_p=params.min_p > 0, all_greedy=greedy)
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(1, v, dtype=torch.bool)
        allowed[0, params.allowed_token_ids] = True
        t.bitmask = pack_bitmask(allowed)
    scores = process_logits(logits, t)
    return (scores if greedy else scores + gumbel_noise(t.seeds, t.counters, v))[0]


def decision_gap(path: str, prompt: list[int], prefix: list[int], params, index: int = 0) -> float | None:
    """How far apart, in logit units, the best and second-best candidates of that decision are (None:
    `decision_scores` cannot replay it, so a difference there cannot be excused as a near-tie)."""
    scores = decision_scores(path, prompt, prefix, params, index)
    if scores is None:
        return None
    top = scores.topk(2).values
    return float(top[0] - top[1]) * (params.temperature if params.temperature > 0 else 1.0)


def assert_same_outputs(path: str, prompts: list[list[int]], params, got: list, want: list) -> set[int]:
    """Two runs of the same requests that promise the same tokens (with and without speculation, graph
    mode and eager, TP 1 and 4, batch 1 and 16, async and sync scheduling) produced them. The two runs
    multiply in GEMMs of other shapes, so their logits agree to rounding, not to the bit: where the
    runs part, the decision there must be a near-tie of the dense model (`decision_gap` < NEAR_TIE),
    and the rest of that sequence is not compared. got / want: per request, its token list or the
    token lists of its n sequences; params: one SamplingParams or one per request. Returns the indices
    of the requests that parted at a near-tie (their logprobs differ from there on)."""
    assert len(got) == len(want), f"{len(got)} vs {len(want)} requests"
    per_request = params if isinstance(params, list) else [params] * len(want)
    parted = set()
    for r, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        gs, ws = ([g], [w]) if not g or isinstance(g[0], int) else (g, w)
        assert len(gs) == len(ws), f"request {r}: {len(gs)} vs {len(ws)} sequences"
        for index, (a, b) in enumerate(zip(gs, ws)):
            i = _first_difference(list(a), list(b))
            if i is None:
                continue
            gap = decision_gap(path, prompts[r], list(b[:i]), per_request[r], index)
            assert gap is not None and gap < NEAR_TIE, (
                f"request {r} sequence {index} differs at token {i}: {list(a[i:i + 1])} vs {list(b[i:i + 1])}"
                f" (the decision's top-2 gap there: {gap})")
            parted.add(r)
    return parted


def assert_same_fields(x, y, where: str, exact_types: bool = True) -> None:
    """Two dataclass instances (step batches, their parts) field by field, nested ones too; an assertion
    names the first field that differs. `exact_types`: arrays of the same dtype and values of the same
    type, not only equal values."""
    for f in dataclasses.fields(x):
        a, b = getattr(x, f.name), getattr(y, f.name)
        if dataclasses.is_dataclass(a):
            assert_same_fields(a, b, f"{where}.{f.name}", exact_types)
        elif isinstance(a, np.ndarray):
            if exact_types:
                assert isinstance(b, np.ndarray), f"{where}.{f.name}"
                assert a.dtype == b.dtype, f"{where}.{f.name}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
            assert a.shape == b.shape and np.array_equal(a, b), f"{where}.{f.name}: {a} != {b}"
        else:
            assert a == b and (not exact_types or type(a) is type(b)), f"{where}.{f.name}: {a!r} != {b!r}"


def tree_engine(budget: int, **kw):
    """namazu-tiny with its shipped drafter drafting at every batch size, a draft tree of `budget` nodes per
    drafted block (0: the chain); budget -1: no speculation. The tree tests' engine (inline worker)."""
    from namazu import LLM
    from namazu.assets import default_model_path
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    model = default_model_path()
    spec = dict(speculative_model=str(model / SHIPPED_DRAFTER_DIR), num_speculative_tokens=6,
                speculative_disable_batch_size=0, speculative_tree_budget=budget) if budget >= 0 \
        else dict(num_speculative_tokens=0)
    return LLM(str(model), executor="inline", **spec, **kw)
