"""/v1/responses through the official openai client's `responses.create` against namazu-tiny: plain text,
streamed (the event sequence, deltas that add up to the final text), a function tool (arguments validate
against its schema; streamed argument deltas add up to them), a json_schema text format, previous_response_id
within the server's bounded store, function_call_output round trips, the legacy chat `functions`, a tool
named in Japanese, and (when the package is installed) the openai-agents SDK running a tool loop."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import LiveServer

from namazu.assets import default_model_path
from server.serving_responses import ResponseStore

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "name": "天気", "description": "都市の天気を調べる",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ROOM = {"type": "function", "name": "reserve_room", "strict": True,
        "parameters": {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12}},
                       "required": ["people"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"会社名": {"type": "string", "maxLength": 20},
                                           "従業員数": {"type": "integer", "minimum": 1, "maximum": 9999}},
          "required": ["会社名", "従業員数"], "additionalProperties": False}
ASK = "大阪の天気を調べて、4人で会議室を予約してください"


@pytest.fixture(scope="module")
def srv():
    with LiveServer(default_model_path(), "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                    "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_plain_and_streamed(client):
    r = client.responses.create(model="tiny", input="こんにちは", max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.output_tokens <= 24 and r.usage.input_tokens > 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 24
    events = list(client.responses.create(model="tiny", input="こんにちは", max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == r.output_text     # greedy: the same answer either way
    assert final.usage.output_tokens == r.usage.output_tokens


def test_instructions_and_retrieve(client):
    a = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    b = client.responses.create(model="tiny", input="hi", instructions="あなたは親切です", max_output_tokens=4)
    assert b.usage.input_tokens > a.usage.input_tokens and b.instructions == "あなたは親切です"
    got = client.responses.retrieve(b.id)
    assert got.id == b.id and got.output_text == b.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def _check_call(item, tools):
    schema = {t["name"]: t["parameters"] for t in tools}[item.name]
    jsonschema.validate(json.loads(item.arguments), schema)
    assert item.call_id and item.status == "completed"


def test_tool_call_plain_and_streamed(client):
    for seed in range(2):
        r = client.responses.create(model="tiny", input=ASK, tools=[WEATHER, ROOM], tool_choice="required",
                                    temperature=0.7, max_output_tokens=200, extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls, r.output
        for c in calls:
            _check_call(c, [WEATHER, ROOM])
        events = list(client.responses.create(model="tiny", input=ASK, tools=[WEATHER, ROOM], tool_choice="required",
                                              temperature=0.7, max_output_tokens=200, stream=True,
                                              extra_body={"seed": seed}))
        args: dict[str, str] = {}
        for e in events:
            if e.type == "response.function_call_arguments.delta":
                args[e.item_id] = args.get(e.item_id, "") + e.delta
        done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
        assert [args.get(d.id, "") for d in done] == [d.arguments for d in done]
        assert [(d.name, d.arguments) for d in done] == [(c.name, c.arguments) for c in calls]
    named = client.responses.create(model="tiny", input=ASK, tools=[WEATHER, ROOM],
                                    tool_choice={"type": "function", "name": "天気"}, max_output_tokens=200)
    assert {o.name for o in named.output if o.type == "function_call"} == {"天気"}


def test_json_schema_text_format(client):
    fmt = {"format": {"type": "json_schema", "name": "会社", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        r = client.responses.create(model="tiny", input="会社情報をJSONで", text=fmt, temperature=1.0,
                                    max_output_tokens=200, extra_body={"seed": seed})
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"


def test_previous_response_id_and_tool_outputs(client):
    first = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=120)
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "晴れ、25度"}], max_output_tokens=16)
    # The stored conversation (the question, the call) comes before the new input.
    assert second.usage.input_tokens > first.usage.input_tokens + len("晴れ")
    assert second.previous_response_id == first.id
    # The same conversation sent in full costs the same prompt.
    full = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=16, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "晴れ、25度"}])
    assert full.usage.input_tokens == second.usage.input_tokens
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="y", previous_response_id=unstored.id, max_output_tokens=2)


def test_bad_requests_are_named(client):
    for kw, param in ((dict(messages=[{"role": "user", "content": "x"}]), "messages"),
                      (dict(background=True), "background"),
                      (dict(top_logprobs=2), "top_logprobs"),
                      (dict(tools=[{"type": "web_search"}]), "tools[0].type")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body=kw)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_image"}]}])


def test_legacy_functions_answer_with_function_call(client):
    fn = {"name": "天気", "parameters": WEATHER["parameters"]}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}], functions=[fn],
                                       function_call={"name": "天気"}, max_tokens=120, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.function_call.name == "天気"
    jsonschema.validate(json.loads(c.message.function_call.arguments), WEATHER["parameters"])
    assert not c.message.tool_calls
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}],
                                                 functions=[fn], function_call={"name": "天気"}, max_tokens=120,
                                                 temperature=0, stream=True))
    name = "".join(ch.choices[0].delta.function_call.name or "" for ch in chunks
                   if ch.choices and ch.choices[0].delta.function_call)
    args = "".join(ch.choices[0].delta.function_call.arguments or "" for ch in chunks
                   if ch.choices and ch.choices[0].delta.function_call)
    assert (name, args) == ("天気", c.message.function_call.arguments)
    assert chunks[-1].choices[0].finish_reason == "function_call"


def test_chat_tool_named_in_japanese(client):
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}], tools=[tool],
                                       tool_choice="required", max_tokens=120)
    assert r.choices[0].message.tool_calls[0].function.name == "天気"


def test_store_is_bounded():
    store = ResponseStore(max_items=3, max_chars=10_000)
    for i in range(5):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x" * 10}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")                          # used: r3 is now the oldest
    store.put({"id": "r5", "output": []}, [])
    assert store.get("r3") is None and store.get("r2") is not None
    big = ResponseStore(max_items=100, max_chars=2_000)
    for i in range(10):
        big.put({"id": f"b{i}", "output": []}, [{"role": "user", "content": "y" * 500}])
    assert big.chars <= 2_000 and len(big) < 10


def test_openai_agents_runs_a_tool_loop(srv):
    agents = pytest.importorskip("agents", reason="the openai-agents SDK is not installed")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool(name_override="天気")
    def weather(city: str) -> str:
        """都市の天気を調べる"""
        calls.append(city)
        return f"{city}: 晴れ"

    model = agents.OpenAIResponsesModel(model="tiny", openai_client=AsyncOpenAI(base_url=srv.url + "/v1",
                                                                                api_key="none", max_retries=0))
    # The first turn must call the tool; the SDK then resets tool_choice to auto, and the model answers (or
    # calls again) with the tool's output in its input.
    agent = agents.Agent(name="helper", instructions="天気を調べてから答える", tools=[weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
    agents.set_tracing_disabled(True)
    try:
        result = agents.Runner.run_sync(agent, "大阪の天気は?", max_turns=4)
        assert isinstance(result.final_output, str)
        items = [type(i).__name__ for i in result.new_items]
        assert "ToolCallItem" in items and "ToolCallOutputItem" in items and items[-1] == "MessageOutputItem"
    except agents.MaxTurnsExceeded:
        pass                                  # it kept calling the tool: still a working loop
    assert calls
