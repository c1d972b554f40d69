"""Request validation and the Kimi-K2 tool-call parser, without an engine (fast)."""
from __future__ import annotations

import json

import pytest

from server.common import OffsetCounter, resolve_max_tokens, top_n
from server.errors import APIError
from server.protocol import make_sampling_params, parse_chat, parse_completion
from server.tool_parser import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, ToolCallParser


def _err(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_completion_prompt_forms():
    assert parse_completion({"prompt": "hi"}, 20).prompts == ["hi"]
    assert parse_completion({"prompt": [1, 2, 3]}, 20).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", [4, 5]]}, 20).prompts == ["a", [4, 5]]
    req = parse_completion({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 3}, 20)
    assert (req.max_tokens, req.echo, req.logprobs) == (0, True, 3)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({}, 422, "prompt"),
    ({"prompt": 3}, 422, "prompt"),
    ({"prompt": []}, 422, "prompt"),
    ({"prompt": [[]]}, 422, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "8"}, 422, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": True}, 422, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "stop": ["a", 1]}, 422, "stop"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, 422, "logit_bias.5"),
    ({"prompt": "x", "logit_bias": [5]}, 422, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus"),
])
def test_completion_rejects(body, status, param):
    e = _err(parse_completion, body, 20)
    assert (e.status, e.param) == (status, param), e.message
    assert e.body()["error"]["message"]


@pytest.mark.parametrize("field,bad,good", [
    ("service_tier", False, "auto"), ("user", None, "u1"), ("user", 3, "u1"), ("metadata", [], {"k": "v"}),
    ("store", "yes", False), ("parallel_tool_calls", 1, True), ("modalities", ["text", 2], ["text"]),
])
def test_fields_accepted_and_ignored_are_still_type_checked(field, bad, good):
    # Ignored is not unchecked: the API document gives these a type, and a body that breaks it is refused.
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": [{"role": "user",
                                                                                        "content": "hi"}]})):
        e = _err(parse, {**body, field: bad}, 20)
        assert (e.status, e.param) == (422, field), e.message
        parse({**body, field: good}, 20)


def test_body_must_be_object():
    assert _err(parse_completion, [1], 20).status == 422
    assert _err(parse_chat, "hi", 20).status == 422


def test_chat_fields():
    req = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]},
                                   {"role": "user", "content": "hi"}],
                      "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
                      "stream": True, "stream_options": {"include_usage": True}, "seed": 3}, 20)
    assert req.messages[0] == {"role": "system", "content": "ab"}
    assert (req.max_tokens, req.top_logprobs, req.sampling.include_usage, req.sampling.seed) == (7, 2, True, 3)
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, 20).top_logprobs is None


def test_chat_optional_message_fields_may_be_null_or_absent():
    req = parse_chat({"messages": [{"role": "user", "content": "x", "name": None, "tool_call_id": None,
                                    "tool_calls": None}, {"role": "assistant"}]}, 20)
    assert req.messages == [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body,status,param", [
    ({}, 422, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 422, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 422, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "r"}]}, 422, "messages[0].tool_call_id"),
    # Optional message fields are typed for every role, as /openapi.json types them.
    ({"messages": [{"role": "user", "content": "x", "name": 7}]}, 422, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": []}]}, 422, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": 0}]}, 422, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]}]}, 422,
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     400, "tools[1].function.name"),
])
def test_chat_rejects(body, status, param):
    e = _err(parse_chat, body, 20)
    assert (e.status, e.param) == (status, param), e.message


def test_sampling_params_mapping():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0, "stop": "END",
                      "presence_penalty": 0.5, "frequency_penalty": -0.5, "n": 3, "seed": 7}, 20)
    p = make_sampling_params(req.sampling, 9, 2, None, vocab_size=100)
    assert (p.temperature, p.stop_strings, p.presence_penalty, p.frequency_penalty, p.n, p.seed, p.max_tokens,
            p.logprobs) == (0.0, ["END"], 0.5, -0.5, 3, 7, 9, 2)
    req = parse_completion({"prompt": "x", "stop_token_ids": [500]}, 20)
    e = _err(make_sampling_params, req.sampling, 4, None, None, 100)
    assert (e.status, e.param) == (400, "stop_token_ids")


@pytest.mark.parametrize("parse,base", [(parse_completion, {"prompt": "x"}),
                                        (parse_chat, {"messages": [{"role": "user", "content": "x"}]})])
def test_priority_is_an_int64_and_its_bounds_are_exact(parse, base):
    # priority has no second check behind the protocol (the scheduler sorts on it as it is), so this
    # range is the only thing keeping a value no int64 holds out of the engine.
    for ok in (-(2**63), 2**63 - 1):
        assert parse({**base, "priority": ok}, 20).sampling.priority == ok
    for bad in (2**63, -(2**63) - 1):
        e = _err(parse, {**base, "priority": bad}, 20)
        assert (e.status, e.param) == (400, "priority"), e.message
        assert "out of range" in e.message


def test_context_limit_message_states_the_limit():
    assert resolve_max_tokens(10, None, 64) == 54
    assert resolve_max_tokens(10, 54, 64) == 54
    e = _err(resolve_max_tokens, 10, 55, 64)
    assert e.status == 400 and "maximum context length is 64 tokens" in e.message and "65" in e.message
    e = _err(resolve_max_tokens, 64, None, 64, "max_tokens", "messages")
    assert e.status == 400 and "64" in e.message and e.param == "messages"


def test_top_n_and_offsets():
    assert top_n({1: -2.0, 2: -0.1, 3: -1.0}, 2) == [(2, -0.1), (3, -1.0)]
    assert top_n(None, 3) == [] and top_n({1: -1.0}, 0) == []
    oc = OffsetCounter()
    raw = "a東b".encode()
    assert [oc.add(raw[i:i + 1]) for i in range(len(raw))] == [0, 1, 1, 1, 2]


# -- Kimi-K2 tool calls -----------------------------------------------------------------------------------
def _section(*calls: tuple[str, str]) -> str:
    body = "".join(f"{CALL_BEGIN}{cid}{ARG_BEGIN}{args}{CALL_END}" for cid, args in calls)
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


class _Tok:
    eos_token = "<|im_end|>"


def test_tool_parser_whole():
    args0, args1 = json.dumps({"city": "東京"}, ensure_ascii=False), json.dumps({"q": "a<b"})
    text = "Let me check." + _section(("functions.get_weather:0", args0), ("functions.search:1", args1)) + "<|im_end|>"
    content, calls = ToolCallParser(_Tok()).parse(text)
    assert content == "Let me check."
    assert calls == [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": args0}},
        {"id": "functions.search:1", "type": "function", "function": {"name": "search", "arguments": args1}},
    ]
    assert ToolCallParser(_Tok()).parse("plain answer<|im_end|>") == ("plain answer", [])
    assert ToolCallParser(_Tok()).parse(_section(("functions.f:0", "{}")))[0] is None


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_tool_parser_streaming_matches_whole(step):
    text = "Hi <b>" + _section(("functions.get_weather:0", '{"city": "Osaka"}'), ("functions.f:1", "{}"))
    p = ToolCallParser(_Tok())
    content, calls = [], {}
    for i in range(0, len(text), step):
        c, deltas = p.feed(text[i:i + step], final=i + step >= len(text))
        content.append(c)
        for d in deltas:
            if "id" in d:
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
        assert "<|" not in c
    assert "".join(content) == "Hi <b>"
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Osaka"}'},
                     1: {"id": "functions.f:1", "name": "f", "arguments": "{}"}}
    assert p.num_calls == 2


def test_tool_parser_drops_calls_to_undeclared_functions():
    text = _section(("functions.rm_rf:0", '{"path": "/"}'), ("functions.get_weather:1", '{"city": "Osaka"}'))
    content, calls = ToolCallParser(_Tok(), declared={"get_weather"}).parse(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_tool_parser_cut_off_output():
    cut = SECTION_BEGIN + CALL_BEGIN + "functions.get_wea"
    assert ToolCallParser(_Tok()).parse("Hi" + cut) == ("Hi", [])     # no marker text leaks into content
    content, calls = ToolCallParser(_Tok()).parse(SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARG_BEGIN + '{"a": ')
    assert content is None and calls == [{"id": "functions.f:0", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": '}}]
