"""The async front under faults and load, in-process (inline executor, tiny random checkpoint): a failed
step fails only its requests, slow readers cost one buffered output, admission control, round-robin
fairness between client requests, deadlines, and the int64 bounds of sampling settings."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from engine_helpers import tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    RequestFailedError,
    RequestTimeoutError,
)
from namazu.engine_config import EngineConfig

LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def _engine(**kw) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", max_model_len=128, **kw))


async def _collect(engine: AsyncEngine, prompt: str, params: SamplingParams = LONG, **kw):
    last = None
    async for out in engine.generate(prompt, params, **kw):
        last = out
    return last


def _all_blocks_free(engine: AsyncEngine) -> bool:
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


class _FaultyCollect:
    """Wraps the executor's collect: raises once when armed, optionally sleeps every call."""

    def __init__(self, executor, delay: float = 0.0):
        self.inner, self.delay = executor.collect, delay
        self.armed = threading.Event()
        executor.collect = self

    def __call__(self):
        if self.delay:
            time.sleep(self.delay)
        result = self.inner()
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("injected step failure")
        return result


def test_a_failed_step_fails_only_its_requests_and_the_engine_keeps_serving():
    engine = _engine()
    fault = _FaultyCollect(engine.engine.executor)

    async def main():
        async def victim():
            async for _ in engine.generate("victim", LONG):
                fault.armed.set()       # the next step raises
        with pytest.raises(RequestFailedError, match="injected step failure"):
            await victim()
        assert engine.is_running
        after = await _collect(engine, "after the failure", SamplingParams(temperature=0, max_tokens=5,
                                                                             ignore_eos=True))
        assert after.finished and len(after.outputs[0].token_ids) == 5
        assert _all_blocks_free(engine)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_reader_that_stops_reading_costs_one_buffered_output():
    # Outputs are cumulative: a backlog of one per step would grow with the square of the output length.
    engine = _engine()

    async def main():
        gen = engine.generate("slow reader", LONG)
        first = await gen.__anext__()
        assert not first.finished
        for _ in range(200):                    # the request finishes while nobody reads
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.05)
        rest = [out async for out in gen]
        assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) == 60

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_admission_control_refuses_past_capacity():
    engine = _engine(max_num_seqs=2, max_waiting_seqs=1)
    fault = _FaultyCollect(engine.engine.executor, delay=0.02)     # keeps the first request running a while
    assert fault.delay

    async def main():
        running = asyncio.ensure_future(_collect(engine, "three", SamplingParams(n=3, max_tokens=60,
                                                                                 ignore_eos=True)))
        await asyncio.sleep(0.2)
        assert engine.num_admitted_seqs == 3
        with pytest.raises(EngineOverloadedError) as e:
            await _collect(engine, "one more")
        assert e.value.retry_after >= 1
        with pytest.raises(ValueError, match="more than this server ever admits"):
            engine.check_admission(4)
        await running
        assert engine.num_admitted_seqs == 0
        assert (await _collect(engine, "room again", SamplingParams(max_tokens=2))).finished

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_large_request_does_not_starve_a_small_one():
    # One client request of 6 engine requests (one group) arrives first; a small one right after must not
    # wait for all 6 (FIFO would run it last).
    engine = _engine(max_num_seqs=2)
    order: list[str] = []

    async def one(name: str, group: str) -> None:
        await _collect(engine, name, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), group=group)
        order.append(name)

    async def main():
        big = [asyncio.ensure_future(one(f"big{i}", "big")) for i in range(6)]
        await asyncio.sleep(0)
        small = asyncio.ensure_future(one("small", "small"))
        await asyncio.gather(*big, small)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    # FIFO would finish it last (index 6). Round-robin admits it at the first free slot: it finishes with
    # the first big requests that ran after the first two (which free their slots together).
    assert order.index("small") <= 3, order


def test_request_deadline_aborts_and_frees():
    engine = _engine(request_timeout=0.5)
    _FaultyCollect(engine.engine.executor, delay=0.05)      # 60 steps take 3 s: past the deadline

    async def main():
        t0 = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            await _collect(engine, "too slow")
        assert time.monotonic() - t0 < 2.0
        for _ in range(100):
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.05)
        assert not engine.engine.requests and _all_blocks_free(engine)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_seed_near_int64_max_with_several_sequences():
    # seed + 1_000_003 * i used to overflow the int64 seed array of the batch and kill the step.
    with LLM(tiny_checkpoint(), executor="inline", max_model_len=64) as llm:
        params = SamplingParams(n=3, seed=2**63 - 1, max_tokens=4, temperature=1.0, ignore_eos=True)
        a = llm.generate(["seed"], params)[0]
        b = llm.generate(["seed"], params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert all(len(o.token_ids) == 4 for o in a.outputs)


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
    ("repetition_penalty", math.inf), ("presence_penalty", math.nan), ("top_k", 10**300), ("top_k", 2**31),
    ("seed", 2**63), ("seed", -1), ("n", 10**6), ("max_tokens", 2**64), ("stop_token_ids", [1.5]),
])
def test_sampling_params_refuse_values_the_engine_cannot_hold(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_request_the_engine_cannot_queue_fails_alone():
    engine = _engine()
    inner = engine.engine.add_request
    calls = []

    def add_request(*args, **kw):
        calls.append(args[0])
        if len(calls) == 1:
            raise RuntimeError("injected add failure")
        return inner(*args, **kw)

    engine.engine.add_request = add_request

    async def main():
        with pytest.raises(RequestFailedError, match="injected add failure"):
            await asyncio.wait_for(_collect(engine, "first"), 30)      # bounded: the bug was a hang
        out = await _collect(engine, "second", SamplingParams(max_tokens=3, ignore_eos=True))
        assert out.finished and len(out.outputs[0].token_ids) == 3

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
