"""Shared pieces of the engine tests: a tiny random checkpoint, prompts, and the dense greedy oracle."""
from __future__ import annotations

import dataclasses
import functools
import tempfile

import numpy as np
import torch

from namazu.assets.random_model import write_random_checkpoint
from namazu.models.loader import load_model

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
