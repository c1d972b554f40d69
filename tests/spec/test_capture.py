"""Capture: exact token ids per finished request, sharded append-only files, torn records skipped; the
output constraint kept, so a replay decodes under the grammar that was served."""
import asyncio
import json
import logging
import os
import zlib
from dataclasses import asdict, fields

import pytest
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.async_engine import AsyncEngine
from namazu.engine_config import EngineConfig
from namazu.outputs import CompletionOutput, RequestOutput
from namazu.spec import capture
from namazu.spec.capture import (
    REQUIRED,
    SAMPLING_FIELDS,
    CaptureRecord,
    CaptureWriter,
    ReadStats,
    read_records,
    record_from_output,
    shard_paths,
    structured_settings,
)
from namazu.spec.training.replay import REPLAY_KEYS, completion_body, completion_constraint, replay_params


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


def _line(payload: dict) -> bytes:
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(data) + data + b"\n"


def test_a_record_from_a_newer_version_keeps_its_known_fields(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(capture, "_unknown_logged", set())      # once per process: this test's process
    newer = {**asdict(rec(1)), "draft_trace": [1, 2], "tenant": "t"}
    (tmp_path / "a.ndjson").write_bytes(_line(newer) + _line(newer))
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="namazu.spec.capture"):
        assert list(read_records(tmp_path, stats)) == [rec(1), rec(1)]
    assert stats.skipped == 0
    [msg] = [r.getMessage() for r in caplog.records]             # logged once, not per record
    assert "draft_trace" in msg and "tenant" in msg


@pytest.mark.parametrize("missing", REQUIRED)
def test_a_record_missing_a_required_field_is_skipped_and_its_neighbours_read(tmp_path, caplog, missing):
    assert REQUIRED == ("request_id", "prompt_token_ids", "output_token_ids", "finish_reasons")
    bad = {k: v for k, v in asdict(rec(1)).items() if k != missing}
    (tmp_path / "a.ndjson").write_bytes(_line(asdict(rec(0))) + _line(bad) + _line(asdict(rec(2))))
    stats = ReadStats()
    with caplog.at_level(logging.WARNING, logger="namazu.spec.capture"):
        assert [r.request_id for r in read_records(tmp_path, stats)] == ["r0", "r2"]
    assert (stats.records, stats.skipped) == (2, 1)
    [msg] = [r.getMessage() for r in caplog.records]
    assert "a.ndjson:2" in msg and missing in msg


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


SCHEMA = {"type": "object", "properties": {"status": {"enum": ["ok", "ng"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["status", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A JSON-schema and a plain greedy request served with --capture-dir, and their records."""
    model = tiny_checkpoint()
    [p] = prompts(1, lo=5, hi=10, seed=2)
    got = {}
    for name, params in (("json", SamplingParams(temperature=0, max_tokens=40, json_schema=SCHEMA)),
                         ("plain", SamplingParams(temperature=0, max_tokens=12))):
        d = tmp_path_factory.mktemp(name)
        [out] = asyncio.run(_serve(EngineConfig(model=model, executor="inline", capture_dir=str(d)), [p], params))
        [got[name]] = [(out, r) for r in read_records(d)]
    return model, got


def test_a_json_schema_request_keeps_its_constraint_through_the_capture(served):
    _, got = served
    out, rec = got["json"]
    assert out.outputs[0].finish_reason == "stop"
    assert rec.structured == {"json_schema": SCHEMA, "json_schema_strict": True}
    assert got["plain"][1].structured == {}
    assert replay_params(rec).json_schema == SCHEMA


def _replay(model: str, rec: CaptureRecord):
    with LLM(model, executor="inline") as llm:
        [o] = llm.generate(prompt_token_ids=[rec.prompt_token_ids], sampling_params=replay_params(rec),
                           use_tqdm=False)
    return o.outputs[0]


def test_a_replayed_constrained_greedy_request_reproduces_its_captured_output(served):
    import jsonschema

    model, got = served
    _, rec = got["json"]
    c = _replay(model, rec)
    assert [c.token_ids] == rec.output_token_ids
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_record_captured_before_the_constraint_was_kept_still_replays(served, tmp_path):
    model, got = served
    _, new = got["plain"]
    payload = {k: v for k, v in asdict(new).items() if k != "structured"}     # the old format
    line = json.dumps(payload, separators=(",", ":")).encode()
    (tmp_path / "old.ndjson").write_bytes(b"%08x " % zlib.crc32(line) + line + b"\n")
    stats = ReadStats()
    [rec] = read_records(tmp_path, stats)
    assert stats.skipped == 0 and rec.structured == {}
    assert completion_constraint(rec) == {}
    assert [_replay(model, rec).token_ids] == rec.output_token_ids


@pytest.mark.parametrize("structured", [
    {"json_schema": SCHEMA, "json_schema_strict": True}, {"json_schema": SCHEMA, "json_schema_strict": False},
    {"json_schema": json.dumps(SCHEMA), "json_schema_strict": True}, {"json_object": True},
    {"regex": "[a-z]{3}"}, {"grammar": 'root ::= "yes" | "no"'}, {}],
    ids=["schema", "schema-not-strict", "schema-text", "json-object", "regex", "grammar", "none"])
def test_an_http_replay_body_carries_the_captured_constraint(structured):
    """bench.replay and bench.shadow_agreement post records to /v1/completions: the server reads the body
    back into the same constraint."""
    from server.protocol import make_sampling_params, parse_completion

    rec = CaptureRecord("r", [1, 2, 3], [[4, 5]], ["stop"], {"temperature": 0.0}, structured=structured)
    body, left = completion_body(rec)
    assert left == []
    req = parse_completion(body, 5)
    params = make_sampling_params(req.sampling, req.max_tokens, None, None, vocab_size=100)
    want = dict(structured, json_schema=SCHEMA) if "json_schema" in structured else structured
    assert structured_settings(params) == want


def test_a_tool_call_constraint_has_no_completions_field():
    tools = {"functions": [{"name": "f", "parameters": {"type": "object"}, "strict": False}],
             "tool_choice": "auto", "parallel_tool_calls": True}
    rec = CaptureRecord("r", [1], [[2]], ["stop"], structured={"tool_calls": tools})
    assert completion_constraint(rec) is None
    assert completion_body(rec)[1] == ["tool_calls"]     # named, so the bench counts it
    assert replay_params(rec).tool_calls == tools        # offline it is applied


# The token-level settings a capture records beyond the first format, each away from its default.
TOKEN_SETTINGS = {"stop_token_ids": [3, 9], "skip_special_tokens": False, "allowed_token_ids": [1, 2, 3, 4, 5],
                  "logit_bias": {5: -100.0, 17: 2.5}, "bad_words_ids": [[4, 5], [6]]}
STRUCTURED = {"json_schema", "json_schema_strict", "json_object", "regex", "grammar", "tool_calls"}
# Fields that cannot change the token ids (logprobs, response text, cache sharing, lossless speculation), and
# grammar_factory, a callable that a file cannot hold.
NOT_CAPTURED = {"logprobs", "prompt_logprobs", "include_stop_str_in_output", "cache_salt", "num_speculative_tokens",
                "grammar_factory"}


def test_every_sampling_field_is_captured_or_known_not_to_change_the_tokens():
    """A field added to SamplingParams fails here until someone decides whether a replay needs it."""
    assert {f.name for f in fields(SamplingParams) if f.init} == set(SAMPLING_FIELDS) | STRUCTURED | NOT_CAPTURED
    assert set(SAMPLING_FIELDS) - set(REPLAY_KEYS) == {"max_tokens", "n"}     # a replay derives these two


def _captured(tmp_path, params: SamplingParams) -> CaptureRecord:
    """`params` through what the serving engine does on a finished request, a shard and the reader."""
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", [4, 5], finish_reason="stop")], True)
    w = CaptureWriter(tmp_path)
    w.write(record_from_output(out, params, 1.0, 2.0))
    w.close()
    [rec] = read_records(tmp_path)
    return rec


@pytest.mark.parametrize("name", TOKEN_SETTINGS)
def test_a_token_level_setting_survives_capture_and_replay(tmp_path, name):
    value = TOKEN_SETTINGS[name]
    assert getattr(SamplingParams(), name) != value
    rec = _captured(tmp_path, SamplingParams(temperature=0.5, seed=3, max_tokens=8, **{name: value}))
    assert getattr(replay_params(rec), name) == value        # logit_bias: int keys again, not JSON's strings


def test_all_token_level_settings_together_survive_capture_and_replay(tmp_path):
    params = replay_params(_captured(tmp_path, SamplingParams(temperature=0.5, seed=3, **TOKEN_SETTINGS)))
    assert {k: getattr(params, k) for k in TOKEN_SETTINGS} == TOKEN_SETTINGS


def test_an_http_replay_body_carries_the_token_level_settings_it_has_fields_for():
    from server.protocol import make_sampling_params, parse_completion

    rec = CaptureRecord("r", [1, 2, 3], [[4, 5]], ["stop"], {"temperature": 0.0, **TOKEN_SETTINGS})
    body, left = completion_body(rec)
    assert left == ["bad_words_ids"]         # the endpoint takes bad words as text only
    req = parse_completion(json.loads(json.dumps(body)), 5)     # as posted
    params = make_sampling_params(req.sampling, req.max_tokens, None, None, vocab_size=100)
    want = {k: v for k, v in TOKEN_SETTINGS.items() if k != "bad_words_ids"}
    assert {k: getattr(params, k) for k in want} == want
