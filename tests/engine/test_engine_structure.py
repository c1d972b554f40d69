"""Structure the engine relies on: KV blocks planned on every rank with the minimum allocated, the
result declaration driving both packing and unpacking, and no empty packages."""
import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import prompts, tiny_checkpoint

import namazu
import server
from namazu import SamplingParams
from namazu.engine.batch_builder import build_step_batch
from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig
from namazu.scheduler.scheduler import ScheduledSeq
from namazu.scheduler.sequence import Sequence
from namazu.step.batch import RESULT_FIELDS, StepResult, pack, result_layout, unpack
from namazu.worker.executor import InlineExecutor


def test_engine_allocates_the_smallest_kv_plan_of_all_ranks(monkeypatch):
    import namazu.engine.llm_engine as engine_module

    class TwoRanks(InlineExecutor):
        """Rank 1 reports a third of rank 0's capacity (a GPU with less free memory, say)."""

        def infos(self):
            assert self.worker.runner.cache is None, "a rank allocated before the engine chose the size"
            a = super().infos()[0]
            return [a, dataclasses.replace(a, rank=1, num_kv_blocks=a.num_kv_blocks // 3)]

    monkeypatch.setattr(engine_module, "make_executor",
                        lambda config, path, proposer=None: TwoRanks(config, path, proposer))
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", kv_cache_memory="8MiB"))
    try:
        planned = engine.executor.worker.runner.plan_kv_blocks()
        assert engine.num_kv_blocks == planned // 3
        assert engine.block_manager.num_blocks == planned // 3
        assert engine.executor.worker.runner.cache.num_blocks == planned // 3
        engine.add_request("r", None, SamplingParams(max_tokens=3), prompt_token_ids=[1, 2, 3])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()


def _batch(with_logprobs: bool):
    items = []
    for i, p in enumerate(prompts(3, 4, 9, seed=3)):
        seq = Sequence(i, f"r{i}", 0, p, SamplingParams(logprobs=2 if with_logprobs else None,
                                                       prompt_logprobs=1 if i == 0 else None), seed=i)
        seq.block_table = [i]
        items.append(ScheduledSeq(seq, len(p), 0))
    return build_step_batch(items, 264)[0]


def test_result_declaration_round_trips():
    """Every declared field packs and unpacks to the same values, in the declared shapes."""
    for with_lp in (False, True):
        batch = _batch(with_lp)
        rng = np.random.default_rng(0)
        values = {}
        for f in RESULT_FIELDS:
            shape = f.shape(batch)
            if shape is None:
                continue
            values[f.name] = (torch.from_numpy(rng.integers(0, 100, shape)) if f.kind == "i"
                              else torch.from_numpy(rng.random(shape).astype(np.float32)))
        layout = result_layout(batch)
        ints, floats = pack(layout, values, torch.cat, torch.zeros(0, dtype=torch.long), torch.zeros(0))
        res = unpack(layout, ints.numpy(), floats.numpy())
        for name, t in values.items():
            assert np.array_equal(getattr(res, name), t.numpy()), name
        assert ("logprobs" in values) == with_lp and "prompt_logprobs" in values


def _fields_equal(x, y, where: str) -> None:
    for f in dataclasses.fields(x):
        a, b = getattr(x, f.name), getattr(y, f.name)
        if isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, f"{where}.{f.name}"
            assert np.array_equal(a, b), f"{where}.{f.name}"
        else:
            assert a == b, f"{where}.{f.name}"


def test_step_result_pickles_as_one_blob_and_round_trips():
    """What crosses the process boundary back (worker -> engine): every field comes back equal (dtype,
    shape, values; scalars and None too), and the arrays travel as one blob rather than one pickled array
    each. (A step's batch never travels pickled: the delta encoder's tests cover that way.)"""
    res = StepResult(tokens=np.arange(6).reshape(2, 3), accepted=np.array([2, 0]), num_drafts=np.array([2, 2]),
                     logprobs=np.linspace(-3, 0, 6, dtype=np.float32).reshape(2, 3), next_draft_ids=[[5, 6], []],
                     drafter_seconds=0.25)
    raw = pickle.dumps(res)
    assert b"ndarray" not in raw
    _fields_equal(res, pickle.loads(raw), "result")


def test_no_empty_packages():
    for root in (Path(namazu.__file__).parent, Path(server.__file__).parent):
        for init in root.rglob("__init__.py"):
            pkg = init.parent
            if "__pycache__" in pkg.parts or pkg.name.startswith("."):
                continue
            members = [p for p in pkg.iterdir() if p.name != "__init__.py" and p.name != "__pycache__"]
            assert members, f"{pkg} has nothing but its __init__.py"


def _layout_reference(starts, num_new, num_drafts, samples):
    """The layout spelled out sequence by sequence (as the batch builder once built it)."""
    n = [a + b for a, b in zip(num_new, num_drafts)]
    tq = max(max(n, default=0), 1)
    positions, q_index, q_pos, out_index, logit_rows, flat0 = [], [], [], [], [], 0
    for b, (s, k, d, smp) in enumerate(zip(starts, num_new, num_drafts, samples)):
        pos = list(range(s, s + k + d))
        positions += pos
        q_index.append(list(range(flat0, flat0 + k + d)) + [0] * (tq - k - d))
        q_pos.append(pos + [-1] * (tq - k - d))
        out_index += [b * tq + j for j in range(k + d)]
        if smp:
            logit_rows += list(range(flat0 + k - 1, flat0 + k + d))
        flat0 += k + d
    return positions, q_index, q_pos, out_index, logit_rows


@pytest.mark.parametrize("seed", range(6))
def test_attention_and_row_layouts_equal_the_sequence_by_sequence_definition(seed):
    from namazu.step.batch import attention_layout, sampled_row_layout

    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 7))
    decodes = seed % 2 == 0      # even seeds: one token each (the identity layout's fast path)
    num_new = np.ones(count, np.int64) if decodes else rng.integers(1, 5, count)
    num_drafts = np.zeros(count, np.int64) if decodes else np.where(num_new == 1, rng.integers(0, 4, count), 0)
    samples = np.ones(count, bool) if decodes else rng.random(count) < 0.7
    starts = rng.integers(0, 50, count)
    n = int((num_new + num_drafts).sum())
    a = attention_layout(np.zeros(n, np.int64), starts, num_new, num_drafts, samples, np.zeros((count, 1), np.int64))
    positions, q_index, q_pos, out_index, logit_rows = _layout_reference(
        starts.tolist(), num_new.tolist(), num_drafts.tolist(), samples.tolist())
    assert a.positions.tolist() == positions and a.q_index.tolist() == q_index and a.q_pos.tolist() == q_pos
    assert a.out_index.tolist() == out_index and a.logit_rows.tolist() == logit_rows
    k = num_drafts[samples]
    rows, first = [], 0
    for d in k.tolist():
        rows.append(list(range(first, first + d + 1)) + [first] * (int(k.max(initial=0)) - d))
        first += d + 1
    assert sampled_row_layout(k).tolist() == rows
    assert sampled_row_layout(k).shape == (len(k), int(k.max(initial=0)) + 1)
