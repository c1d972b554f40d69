"""Structured output and tool calls through the official openai client against namazu-tiny: JSON schema
and JSON object answers, Kimi-K2 tool calls with tool_choice required / named / auto / none, streaming
and not; every call names a declared tool and its arguments validate; bad grammars are 400s that say why."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_harness import LiveServer

from namazu.assets import default_model_path

pytest.importorskip("xgrammar", reason="xgrammar is a pinned dependency; make test installs it")
FORMATS = jsonschema.FormatChecker()

SCHEMA = {"type": "object", "properties": {"会社名": {"type": "string", "maxLength": 20},
                                           "従業員数": {"type": "integer", "minimum": 1, "maximum": 9999},
                                           "上場": {"type": "boolean"}},
          "required": ["会社名", "従業員数", "上場"], "additionalProperties": False}
# Held-out tools (not in namazu-tiny's training schemas).
TOOLS = [
    {"type": "function", "function": {"name": "get_air_quality", "description": "都市の大気質を調べる",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "pollutant": {"enum": ["pm25", "pm10", "o3"]}},
                                          "required": ["city", "pollutant"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "reserve_room", "strict": True,
                                      "parameters": {"type": "object", "properties": {
                                          "date": {"type": "string", "format": "date"},
                                          "people": {"type": "integer", "minimum": 1, "maximum": 12}},
                                          "required": ["date", "people"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "大阪の大気質(pm25)を調べて、明日4人で会議室を予約してください"}]


@pytest.fixture(scope="module")
def srv():
    with LiveServer(default_model_path(), "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                    "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_calls(calls) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.function.name in PARAMS
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name], format_checker=FORMATS)


def streamed_calls(chunks) -> tuple[dict[int, dict], str, str | None]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return calls, content, finish


def test_json_schema_answer_streaming_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "company", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "会社情報をJSONで"}],
                                           response_format=rf, temperature=1.0, seed=seed, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "会社情報をJSONで"}], response_format=rf,
            temperature=1.0, seed=seed, max_tokens=200, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON"}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "reserve_room"}}])
def test_required_and_named_tool_calls_always_validate(client, choice):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           temperature=0.7, seed=seed, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        check_calls(c.message.tool_calls)
        if isinstance(choice, dict):
            assert {t.function.name for t in c.message.tool_calls} == {"reserve_room"}
        assert not c.message.content or "<|" not in c.message.content
        calls, content, finish = streamed_calls(client.chat.completions.create(
            model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0.7, seed=seed,
            max_tokens=200, stream=True))
        assert finish == "tool_calls" and "<|" not in content
        assert [(v["id"], v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
            [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_auto_tool_calls_validate_when_made(client):
    made = 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=0.7, seed=seed,
                                           max_tokens=200)
        c = r.choices[0]
        assert "<|" not in (c.message.content or "")
        if c.message.tool_calls:
            made += 1
            assert c.finish_reason == "tool_calls"
            check_calls(c.message.tool_calls)
    assert made >= 1


def test_no_parallel_calls_when_asked(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=200)
    assert len(r.choices[0].message.tool_calls) == 1


def test_tool_choice_none_hides_the_tools(client):
    with_tools = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=30)
    plain = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=30)
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.choices[0].message.content == plain.choices[0].message.content


def test_a_call_cut_off_by_max_tokens_leaks_no_markers(client):
    for stream in (False, True):
        if stream:
            calls, content, finish = streamed_calls(client.chat.completions.create(
                model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=6,
                stream=True))
        else:
            r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                               temperature=0, max_tokens=6)
            content, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert finish == "length" and "<|" not in content


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "duration"}}}}}},
     "response_format", "'duration' at #/properties/a/format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "array", "items": {"type": "string", "not": {"const": "a"}}}}}}, "response_format", "#/items/not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "anyOf": [{"$ref": "#"}]}}}}, "response_format", "no finite JSON value"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "expected"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name", "declared twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"grammar": "root ::= missing_rule"}, "grammar", "does not compile"),
    ({"regex": "(unclosed"}, "regex", "does not compile"),
    ({"regex": "[0-9]+", "response_format": {"type": "json_object"}}, "response_format", "both constrain"),
])
def test_bad_structured_requests_are_400s(srv, body, param, words):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, **body}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    ok = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_non_strict_schemas_are_best_effort(srv):
    """Without strict, a constraint namazu cannot enforce is dropped (OpenAI's contract there is best
    effort); with strict it is a 400 (above)."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "duration", "maxLength": 15}},
        "required": ["a"], "additionalProperties": False}}}
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 40,
                                                           "response_format": rf}, timeout=60)
    assert r.status_code == 200
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["a"], str)


def test_regex_extra_parameter_and_cache_metrics(srv, client):
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt="電話: ", max_tokens=20, temperature=1.0,
                                      extra_body={"regex": "0[0-9]{1,3}-[0-9]{2,4}-[0-9]{4}"})
        c = r.choices[0]
        if c.finish_reason == "stop":
            import re

            assert re.fullmatch("0[0-9]{1,3}-[0-9]{2,4}-[0-9]{4}", c.text)
    m = srv.metrics()
    assert m["namazu_engine_grammar_cache_hits_total"] >= 1 and m["namazu_engine_grammar_cache_misses_total"] >= 1
