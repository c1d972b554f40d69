"""Capture: exact token ids per finished request, sharded append-only files, torn records skipped."""
import asyncio
import os

import pytest
from engine_helpers import prompts, tiny_checkpoint

from namazu import SamplingParams
from namazu.async_engine import AsyncEngine
from namazu.engine_config import EngineConfig
from namazu.spec.capture import CaptureRecord, CaptureWriter, ReadStats, read_records, shard_paths


def rec(i: int) -> CaptureRecord:
    return CaptureRecord(f"r{i}", list(range(i, i + 5)), [[i, i + 1], [7]], ["stop", "length"],
                         {"temperature": 0.7, "seed": i}, {"arrival": 1.0}, "m")


def test_round_trip_and_rotation(tmp_path):
    w = CaptureWriter(tmp_path, shard_bytes=1024)
    for i in range(40):
        w.write(rec(i))
    w.close()
    shards = shard_paths(tmp_path)
    assert len(shards) > 1                                     # rotated by size
    assert all(p.stat().st_size <= 1024 for p in shards)
    # ...and only by size: each shard was closed because the next record did not fit in it, the first
    # shard after a rotation as much as the first one (a size not reset would give one record a file).
    lines = [p.read_bytes().splitlines(keepends=True) for p in shards]
    for this, nxt in zip(lines, lines[1:]):
        assert sum(map(len, this)) + len(nxt[0]) > 1024, [len(x) for x in lines]
    stats = ReadStats()
    assert list(read_records(tmp_path, stats)) == [rec(i) for i in range(40)]
    assert stats.skipped == 0


@pytest.mark.parametrize("cut", [1, 9, 30, -2, -1])
def test_torn_final_record_is_skipped_and_new_writers_never_append(tmp_path, cut):
    w = CaptureWriter(tmp_path)
    for i in range(3):
        w.write(rec(i))
    w.close()
    [shard] = shard_paths(tmp_path)
    data = shard.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    shard.write_bytes(data[:last + cut] if cut > 0 else data[:len(data) + cut])   # a crash mid-write
    stats = ReadStats()
    assert [r.request_id for r in read_records(tmp_path, stats)] == ["r0", "r1"]
    assert stats.skipped == 1
    w2 = CaptureWriter(tmp_path)            # a restarted server: a new shard, the torn one untouched
    w2.write(rec(3))
    w2.close()
    assert shard.read_bytes() == (data[:last + cut] if cut > 0 else data[:len(data) + cut])
    assert [r.request_id for r in read_records(tmp_path)] == ["r0", "r1", "r3"]


def test_a_corrupt_line_is_skipped(tmp_path):
    w = CaptureWriter(tmp_path)
    for i in range(3):
        w.write(rec(i))
    w.close()
    [shard] = shard_paths(tmp_path)
    data = bytearray(shard.read_bytes())
    data[data.index(b'"r1"') + 2] ^= 1      # one flipped bit inside record r1
    shard.write_bytes(bytes(data))
    assert [r.request_id for r in read_records(tmp_path)] == ["r0", "r2"]


async def _serve(config, ps, params):
    engine = AsyncEngine(config)
    try:
        async def one(p):
            last = None
            async for out in engine.generate(None, params, prompt_token_ids=p):
                last = out
            return last
        return await asyncio.gather(*(one(p) for p in ps))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("on", [True, False], ids=["capture-on", "capture-off"])
def test_serving_engine_captures_exact_ids_only_when_on(tmp_path, on):
    ps = prompts(3, lo=3, hi=10, seed=1)
    params = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=6)
    cfg = EngineConfig(model=tiny_checkpoint(), executor="inline", capture_dir=str(tmp_path) if on else None)
    outs = asyncio.run(_serve(cfg, ps, params))
    if not on:
        assert os.listdir(tmp_path) == []
        return
    got = {r.request_id: r for r in read_records(tmp_path)}
    assert len(got) == 3
    for out in outs:
        r = got[out.request_id]
        assert r.prompt_token_ids == out.prompt_token_ids
        assert r.output_token_ids == [c.token_ids for c in out.outputs]
        assert r.sampling["temperature"] == 0.7 and r.sampling["seed"] == 5 and r.sampling["n"] == 2
        assert r.timings["arrival"] <= r.timings["first_token"] <= r.timings["finished"]
