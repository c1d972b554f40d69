"""The OpenAI-compatible server against the official `openai` client, live on 127.0.0.1.

One server (tiny random checkpoint, API key on) serves the whole module. Outputs of a random model are
arbitrary bytes, so the tests check structure, counts and self-consistency (streamed == non-streamed,
echo logprobs == generated logprobs, same seed == same text), not particular words.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time

import httpx
import openai
import pytest
from server_harness import LiveServer, make_tiny_model, parse_metrics

from namazu.tokenizer import Tokenizer

KEY = "test-key"
# A floor on each engine step's duration, so the tests that need a request still running when the client
# acts (64 streams at once, disconnects) hold on a machine of any speed: 200 steps take at least 4 s.
STEP_DELAY = 0.02
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    # NAMAZU_SERVER_TEST_ARGS runs the suite under other engine modes, e.g. "--async-scheduling".
    extra = os.environ.get("NAMAZU_SERVER_TEST_ARGS", "").split()
    with LiveServer(model, "--max-model-len", "256", "--max-num-seqs", "64", "--kv-cache-memory", "32MiB",
                    "--served-model-name", "tiny", "--debug-step-delay", str(STEP_DELAY), *extra, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_health_and_auth(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(srv.url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/v1/models/tiny"):
        r = httpx.get(srv.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_completion_counts_and_list_prompts(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8 and r.usage.prompt_tokens == len("Hello")
    r = client.completions.create(model="tiny", prompt=["ab", [104, 105, 106]], n=2, max_tokens=3,
                                  temperature=0, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    assert r.choices[0].text == r.choices[1].text        # greedy: both samples of a prompt agree


def test_completion_echo_logprobs_score_the_prompt(srv, client):
    tok = Tokenizer.from_pretrained(srv.model)
    prompt = tok.encode("Hello wo", add_special_tokens=False)
    g = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=3,
                                  extra_body=NO_EOS)
    lp = g.choices[0].logprobs
    assert len(lp.token_logprobs) == 2 and all(len(t) == 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert math.isclose(lp.token_logprobs[0], max(lp.top_logprobs[0].values()), abs_tol=1e-5)
    # Echo + max_tokens 0 scores a text: the prompt's logprobs, the first one None (lm-eval's loglikelihood).
    e = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    elp = e.choices[0].logprobs
    assert e.choices[0].text == "Hello wo" and elp.tokens == list("Hello wo")
    assert elp.token_logprobs[0] is None and all(x <= 0 for x in elp.token_logprobs[1:])
    assert elp.text_offset == list(range(len(prompt))) and e.usage.completion_tokens == 0
    # Echo with generation: prompt text first, then the continuation, logprobs over both.
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                  temperature=0, extra_body=NO_EOS)
    assert b.choices[0].text == "Hello wo" + g.choices[0].text
    assert len(b.choices[0].logprobs.tokens) == len(prompt) + 2
    assert b.choices[0].logprobs.token_logprobs[:-2] == pytest.approx(elp.token_logprobs)
    assert b.choices[0].logprobs.token_logprobs[-2:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # Teacher forcing: scoring prompt + a generated token gives the logprob it was generated with.
    for text in ("Hello wo", "ab", "The ", "xyz", "12", "東"):
        ids = tok.encode(text, add_special_tokens=False)
        one = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                        extra_body=NO_EOS).choices[0]
        nxt = tok.encode(one.text, add_special_tokens=False)
        if len(nxt) != 1 or one.text == "\ufffd":
            continue                     # a partial UTF-8 byte: its id is not recoverable from the text
        s = client.completions.create(model="tiny", prompt=ids + nxt, max_tokens=0, echo=True, logprobs=1)
        assert math.isclose(s.choices[0].logprobs.token_logprobs[-1], one.logprobs.token_logprobs[0],
                            abs_tol=1e-4)
        break
    else:
        pytest.fail("no prompt produced a whole-character greedy token")


def test_chat_stream_equals_non_stream_with_usage(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京はどこ?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    streamed_lp = [t for c in chunks[:-1] if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed_lp] == \
        [(t.token, round(t.logprob, 4)) for t in full.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]


def test_chat_n_logprobs_and_penalties(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=5, temperature=1.0, seed=1,
                                       logprobs=True, top_logprobs=4, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    for c in r.choices:
        assert len(c.logprobs.content) == 5
        for t in c.logprobs.content:
            tops = [x.logprob for x in t.top_logprobs]
            assert len(tops) == 4 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6
            assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=1.0, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 6


def test_tools_on_a_model_without_tool_call_tokens_are_refused(client):
    """The random test model's tokenizer has no Kimi-K2 tool-call markers: the tool-call grammar cannot
    be built, so the request is a 400 that says why (namazu-tiny's real tool path is tested end to end in
    test_server_structured.py); tool_choice "none" still serves."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": schema}}]
    msgs = [{"role": "user", "content": "weather in Osaka?"}]
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError, match="tool_calls_section_begin"):
            client.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice=choice,
                                           max_tokens=8, temperature=0, extra_body=NO_EOS)
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice="none", max_tokens=8,
                                       temperature=0, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="The quick", max_tokens=16, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    clean = [i for i, ch in enumerate(base) if ch != "\ufffd" and i > 0]
    assert clean, f"no usable stop character in {base!r}"
    stop = base[clean[0]]
    r = client.completions.create(model="tiny", prompt="The quick", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.index(stop)]
    chunks = list(client.completions.create(model="tiny", prompt="The quick", max_tokens=16, temperature=0,
                                            stop=stop, stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_seed_reproducible(client):
    def run(seed):
        return [c.message.content for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "seed"}], n=2, max_tokens=10, temperature=1.0,
            seed=seed, extra_body=NO_EOS).choices]

    a, b, c = run(123), run(123), run(124)
    assert a == b and a != c and a[0] != a[1]


def test_prefix_cache_reported_in_usage(client):
    prompt = "A long shared system prompt that fills several KV blocks. " * 2
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)     # lm-eval's scoring pattern
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16 * ((len(prompt) - 1) // 16) - 16


def test_invalid_inputs_get_4xx_and_server_keeps_serving(srv, client):
    h = {**srv.headers(), "Content-Type": "application/json"}
    post = lambda path, **kw: httpx.post(srv.url + path, headers=h, timeout=30, **kw)  # noqa: E731
    cases = [
        (post("/v1/completions", json={"model": "tiny", "prompt": "x", "suffix": "y"}), 400, "suffix"),
        (post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature"),
        (post("/v1/completions", json={"prompt": "x", "max_tokens": 300}), 400, "max_tokens"),
        (post("/v1/completions", content=b"{not json"), 400, None),
        (post("/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]}), 400, "messages[0].role"),
        (post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404, "model"),
        (httpx.get(srv.url + "/v1/nothing", headers=h), 404, None),
        (httpx.get(srv.url + "/v1/completions", headers=h), 405, None),
        (post("/v1/completions", content=b"[" + b"1," * (5 << 20) + b"1]"), 413, None),
        (post("/v1/completions", json={"prompt": {"text": "x"}}), 422, "prompt"),
        (post("/v1/chat/completions", json={"model": "tiny"}), 422, "messages"),
        (post("/v1/completions", json={"prompt": [999999]}), 400, "prompt"),
    ]
    for r, status, param in cases:
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param and err["message"] and err["type"], r.text
    too_long = post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 1}).json()["error"]["message"]
    assert "maximum context length is 256 tokens" in too_long
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", suffix="y")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny", prompt="x", max_tokens="many")
    r = client.completions.create(model="tiny", prompt="still here", max_tokens=3, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 3


def test_64_concurrent_streams(srv):
    aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300,
                                 http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)))
    # Each stream stops reading after its first chunk until all 64 have one; none can have finished by then
    # (STEP_DELAY per step bounds how fast max_tokens steps can go, on any machine), so at that moment all
    # 64 are running in the engine together: no dependence on how fast this machine opens them.
    n, max_tokens = 64, 200
    all_started = asyncio.Event()
    started: list[int] = []
    running_at_barrier: list[float] = []

    async def one(i: int) -> tuple[int, int, int]:
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS)
        pieces, usage, first = 0, None, True
        async for chunk in stream:
            if first:
                first = False
                started.append(i)
                if len(started) == n:
                    running_at_barrier.append(_metric(await _metrics_async(srv), "namazu_num_requests_running"))
                    all_started.set()
                await all_started.wait()
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
            usage = chunk.usage or usage
        return i, pieces, usage.completion_tokens

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(main())
    assert sorted(r[0] for r in results) == list(range(n))
    assert all(r[2] == max_tokens for r in results), results
    assert all(0 < r[1] <= max_tokens for r in results)
    assert running_at_barrier == [n], running_at_barrier
    m = srv.metrics()
    assert m["namazu_peak_requests_in_flight"] >= n, m["namazu_peak_requests_in_flight"]
    if "namazu_peak_num_running" in m:     # the engine's own high-water mark of sequences in one step
        assert m["namazu_peak_num_running"] >= n
    assert m["namazu_num_requests_running"] == 0 and m["namazu_requests_in_flight"] == 0


async def _metrics_async(srv) -> str:
    async with httpx.AsyncClient() as hc:
        return (await hc.get(srv.url + "/metrics", headers=srv.headers())).text


def _metric(text: str, name: str) -> float:
    return parse_metrics(text)[name]


def test_disconnect_mid_stream_aborts_and_frees_blocks(srv):
    before = srv.metrics()
    # As many tokens as the 256-token context allows: stopping short of them shows the abort took effect.
    body = {"model": "tiny", "prompt": "disconnect me", "max_tokens": 230, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as hc:
        with hc.stream("POST", srv.url + "/v1/completions", json=body, headers=srv.headers()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(x.startswith("data: ") for x in got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m["namazu_num_requests_running"] == 0 and m["namazu_kv_cache_usage_ratio"] == 0.0:
            break
        time.sleep(0.1)
    assert m["namazu_num_requests_running"] == 0 and m["namazu_kv_cache_usage_ratio"] == 0.0
    # Stopped early: fewer than the 230 tokens it asked for, and counted as aborted (not as "length").
    generated = m["namazu_engine_num_generated_tokens_total"] - before["namazu_engine_num_generated_tokens_total"]
    assert generated < 230, generated
    key = 'namazu_request_success_total{finish_reason="abort"}'
    assert m.get(key, 0) == before.get(key, 0) + 1


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(srv):
    before = srv.metrics()
    body = json.dumps({"model": "tiny", "prompt": "give up on me", "max_tokens": 230, "ignore_eos": True}).encode()
    # The client goes away once the server has the request running (not after a fixed read timeout, which
    # a fast machine could outlast).
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while srv.metrics()["namazu_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m["namazu_num_requests_running"] == 0 and m["namazu_kv_cache_usage_ratio"] == 0.0:
            break
        time.sleep(0.1)
    generated = m["namazu_engine_num_generated_tokens_total"] - before["namazu_engine_num_generated_tokens_total"]
    assert m["namazu_kv_cache_usage_ratio"] == 0.0 and generated < 230, generated
    key = 'namazu_request_success_total{finish_reason="abort"}'
    assert m.get(key, 0) == before.get(key, 0) + 1


def test_metrics_cover_latency_tokens_and_statuses(srv, client):
    before = srv.metrics()
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "metrics"}], max_tokens=5,
                                   extra_body={"ignore_eos": True, "priority": -1})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", temperature=5)
    m = srv.metrics()
    delta = lambda k: m.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert delta("namazu_time_to_first_token_seconds_count") == 1
    assert delta("namazu_inter_token_latency_seconds_count") == 4       # 5 tokens, 4 gaps
    assert delta("namazu_e2e_request_latency_seconds_count") == 1
    assert delta("namazu_generation_tokens_total") == 5 and delta("namazu_prompt_tokens_total") > 0
    assert delta('namazu_http_requests_total{route="/v1/chat/completions",status="200"}') == 1
    assert delta('namazu_http_requests_total{route="/v1/completions",status="400"}') == 1
    assert delta('namazu_request_success_total{finish_reason="length"}') == 1
    for gauge in ("namazu_num_requests_waiting", "namazu_kv_cache_usage_ratio", "namazu_prefix_cache_hit_rate",
                  "namazu_engine_num_kv_blocks"):
        assert gauge in m, gauge
