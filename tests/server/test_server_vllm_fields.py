"""vLLM's extra request fields through the official openai client (`extra_body`), live, against a tiny random
checkpoint whose chat template also prints two template variables (so chat_template_kwargs and
reasoning_effort are seen to reach it). Each field is checked against an oracle: the grammar it names
(jsonschema, re.fullmatch, the choice list), the same request written out by hand (truncation = the
truncated ids, prompt_logprobs = echo's logprobs), or the token ids it bans or allows."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_harness import LiveServer, make_tiny_model

from namazu.assets.random_model import CHAT_TEMPLATE

pytest.importorskip("xgrammar")
KEY = "fields-key"
G = {"temperature": 0, "max_tokens": 8}
NO_EOS = {"ignore_eos": True}
MSG = [{"role": "user", "content": "hello"}]
TEMPLATE = CHAT_TEMPLATE + "{% if greeting is defined %}[{{ greeting }}]{% endif %}" \
    "{% if reasoning_effort is defined %}<{{ reasoning_effort }}>{% endif %}"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    (model / "chat_template.jinja").write_text(TEMPLATE)
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "32MiB", "--served-model-name", "tiny",
                    api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def cmpl(client, prompt="The answer:", **extra):
    kw = {k: extra.pop(k) for k in list(extra) if k in ("max_tokens", "temperature", "logprobs", "echo", "stream",
                                                        "stream_options", "n", "seed")}
    return client.completions.create(model="tiny", prompt=prompt, **{**G, **kw}, extra_body=extra)


def chat(client, messages=MSG, **extra):
    kw = {k: extra.pop(k) for k in list(extra) if k in ("max_tokens", "temperature", "stream", "stream_options",
                                                        "logprobs", "top_logprobs")}
    return client.chat.completions.create(model="tiny", messages=messages, **{**G, **kw}, extra_body=extra)


def bad(fn, *args, **kw) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        fn(*args, **kw)
    return e.value


def tokenize(srv, **body) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json=body, headers=srv.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# -- structured output: guided_* and structured_outputs -------------------------------------------------
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_guided_fields_constrain_the_answer(client):
    for endpoint in (cmpl, chat):
        def text(r, endpoint=endpoint):
            return r.choices[0].text if endpoint is cmpl else r.choices[0].message.content
        r = endpoint(client, guided_choice=["はい", "いいえ", "maybe so"], max_tokens=16)
        assert text(r) in ("はい", "いいえ", "maybe so") and r.choices[0].finish_reason == "stop"
        r = endpoint(client, guided_regex=r"[0-9]{3}-[a-z]{2}", max_tokens=16)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(r))
        r = endpoint(client, guided_json=SCHEMA, max_tokens=64)
        jsonschema.validate(json.loads(text(r)), SCHEMA)
        r = endpoint(client, guided_json=json.dumps(SCHEMA), max_tokens=64)       # vLLM also takes the JSON text
        jsonschema.validate(json.loads(text(r)), SCHEMA)
        r = endpoint(client, guided_grammar='root ::= "yes" | "no"', max_tokens=8)
        assert text(r) in ("yes", "no")
        r = endpoint(client, structured_outputs={"choice": ["左", "右"]}, max_tokens=8)
        assert text(r) in ("左", "右")
        r = endpoint(client, structured_outputs={"json": SCHEMA}, max_tokens=64)
        jsonschema.validate(json.loads(text(r)), SCHEMA)
        r = endpoint(client, guided_decoding_backend="xgrammar", guided_choice=["a"], max_tokens=4)
        assert text(r) == "a"


def test_completions_response_format(client):
    r = cmpl(client, response_format={"type": "json_schema", "json_schema": {"name": "会議メモ", "schema": SCHEMA}},
             max_tokens=64)
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    json.loads(cmpl(client, response_format={"type": "json_object"}, max_tokens=48).choices[0].text)


def test_constraint_conflicts_and_bad_grammars_are_named(client):
    e = bad(cmpl, client, guided_choice=["a"], guided_regex="b")
    assert e.status_code == 400 and e.body["param"] in ("guided_regex", "guided_choice")
    assert "'guided_regex' and 'guided_choice'" in e.body["message"]
    e = bad(chat, client, guided_json=SCHEMA, response_format={"type": "json_object"})
    assert e.status_code == 400 and e.body["param"] == "response_format" and "guided_json" in e.body["message"]
    e = bad(cmpl, client, guided_choice=[])
    assert e.status_code == 422 and e.body["param"] == "guided_choice"
    for field, value in (("guided_regex", "[unclosed"), ("guided_grammar", "root ::= ("),
                         ("structured_outputs", {"regex": "(("})):
        e = bad(cmpl, client, **{field: value})
        assert e.status_code == 400 and e.body["param"].startswith(field), e.body
    e = bad(cmpl, client, guided_json="{not json")
    assert e.status_code == 400 and e.body["param"] == "guided_json"
    e = bad(cmpl, client, structured_outputs={"choice": ["a"], "whitespace_pattern": " "})
    assert e.status_code == 400 and e.body["param"] == "structured_outputs.whitespace_pattern"


# -- sampler fields: logit_bias, allowed_token_ids, bad_words ---------------------------------------------
def ids_of(srv, text: str) -> list[int]:
    return tokenize(srv, prompt=text, add_special_tokens=False)


def test_logit_bias_forces_and_bans(srv, client):
    x = ids_of(srv, "x")[0]
    r = cmpl(client, logit_bias={str(x): 100}, **NO_EOS)
    assert set(r.choices[0].text) == {"x"}
    base = gen_ids(client)
    banned = gen_ids(client, logit_bias={str(base[0]): -100, str(base[1]): -100})
    assert banned[0] != base[0] and base[1] not in banned
    assert set(cmpl(client, logit_bias={str(x): 1e9}, **NO_EOS).choices[0].text) == {"x"}   # clamped, not refused
    for lb, status in (({"99999": 1}, 400), ({"x": 1}, 400), ({"5": "high"}, 422)):
        e = bad(cmpl, client, logit_bias=lb)
        assert e.status_code == status and e.body["param"].startswith("logit_bias"), e.body


def gen_ids(client, **extra) -> list[int]:
    """The generated token ids (return_tokens_as_token_ids, itself checked against /detokenize below)."""
    lp = cmpl(client, logprobs=0, return_tokens_as_token_ids=True, **NO_EOS, **extra).choices[0].logprobs
    return [int(t.split(":")[1]) for t in lp.tokens]


def test_allowed_token_ids_and_bad_words(srv, client):
    allowed = ids_of(srv, "abc")
    assert set(gen_ids(client, allowed_token_ids=allowed)) <= set(allowed)
    r = cmpl(client, allowed_token_ids=allowed, max_tokens=24, **NO_EOS)
    assert "ab" in r.choices[0].text or "c" in r.choices[0].text       # else the bans below prove nothing
    # A two-token word: its last token is banned right after its first, nowhere else.
    text = cmpl(client, allowed_token_ids=allowed, bad_words=["ab"], max_tokens=24, **NO_EOS).choices[0].text
    assert "ab" not in text and set(text) <= set("abc")
    text = cmpl(client, allowed_token_ids=allowed, bad_words=["c"], max_tokens=24, **NO_EOS).choices[0].text
    assert "c" not in text and set(text) <= set("ab")
    assert bad(cmpl, client, bad_words=[""]).body["param"] == "bad_words"
    assert bad(cmpl, client, allowed_token_ids=[]).body["param"] == "allowed_token_ids"
    assert bad(cmpl, client, allowed_token_ids=[10**6]).body["param"] == "allowed_token_ids"


# -- prompt-side fields ----------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(srv, client):
    prompt = "a fairly long prompt that will be cut"
    ids = tokenize(srv, prompt=prompt)
    r = cmpl(client, prompt, truncate_prompt_tokens=5, **NO_EOS)
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].text == cmpl(client, ids[-5:], **NO_EOS).choices[0].text
    r = chat(client, truncate_prompt_tokens=4, **NO_EOS)
    assert r.usage.prompt_tokens == 4
    assert bad(cmpl, client, prompt, truncate_prompt_tokens=0).body["param"] == "truncate_prompt_tokens"


def test_prompt_logprobs_match_echo_logprobs(client):
    r = cmpl(client, "Score me", prompt_logprobs=2, max_tokens=1, echo=True, logprobs=2)
    choice = r.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    n = r.usage.prompt_tokens
    assert len(plp) == n and plp[0] is None
    echo_lps = choice.logprobs.token_logprobs[:n]
    echo_tokens = choice.logprobs.tokens[:n]
    for entry, lp, tok in zip(plp[1:], echo_lps[1:], echo_tokens[1:]):
        own = [v for v in entry.values() if v["decoded_token"] == tok]
        assert own and own[0]["logprob"] == pytest.approx(lp, abs=1e-5)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks[:2] == [1, 2]
    r = chat(client, prompt_logprobs=1, max_tokens=2)
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None and all(plp[1:])


def test_chat_template_kwargs_reasoning_effort_and_generation_prompt(srv, client):
    base = chat(client, max_tokens=1).usage.prompt_tokens
    greeted = chat(client, max_tokens=1, chat_template_kwargs={"greeting": "yo"}).usage.prompt_tokens
    assert greeted == base + len("[yo]")          # byte-level: one token per byte
    effort = chat(client, max_tokens=1, reasoning_effort="low").usage.prompt_tokens
    assert effort == base + len("<low>")
    no_gen = chat(client, max_tokens=1, add_generation_prompt=False).usage.prompt_tokens
    assert no_gen == len(tokenize(srv, messages=MSG, add_generation_prompt=False)) < base
    assert bad(chat, client, reasoning_effort="extreme").body["param"] == "reasoning_effort"
    assert bad(chat, client, chat_template_kwargs={"messages": []}).body["param"] == "chat_template_kwargs"


def test_continue_final_message_and_echo(srv, client):
    msgs = MSG + [{"role": "assistant", "content": "Once upon"}]
    ids = tokenize(srv, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert ids[-len("Once upon"):] == tokenize(srv, prompt="Once upon", add_special_tokens=False)
    r = chat(client, msgs, add_generation_prompt=False, continue_final_message=True, echo=True, **NO_EOS)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content.startswith("Once upon") and r.choices[0].message.role == "assistant"
    plain = chat(client, msgs, add_generation_prompt=False, continue_final_message=True, **NO_EOS)
    assert r.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    # Streamed: the echo is the first delta.
    s = chat(client, msgs, add_generation_prompt=False, continue_final_message=True, echo=True, stream=True, **NO_EOS)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content
    # The answer's role is not the last message's: nothing to echo.
    echoed, plain = chat(client, echo=True, **NO_EOS), chat(client, **NO_EOS)
    assert echoed.choices[0].message.content == plain.choices[0].message.content
    e = bad(chat, client, msgs, continue_final_message=True)
    assert e.body["param"] == "continue_final_message"


# -- response-side fields --------------------------------------------------------------------------------
def test_return_tokens_as_token_ids(srv, client):
    r = cmpl(client, logprobs=2, return_tokens_as_token_ids=True, **NO_EOS).choices[0]
    ids = r.logprobs.tokens
    assert all(re.fullmatch(r"token_id:[0-9]+", t) for t in ids) and len(ids) == 8
    assert all(re.fullmatch(r"token_id:[0-9]+", t) for top in r.logprobs.top_logprobs for t in top)
    # The ids are the generated tokens: detokenized, they are the text.
    text = httpx.post(srv.url + "/detokenize", headers=srv.headers(), timeout=30,
                      json={"tokens": [int(t.split(":")[1]) for t in ids]}).json()["prompt"]
    assert text == r.text
    r = chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, **NO_EOS)
    assert all(c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in r.choices[0].logprobs.content)


def test_request_id_names_the_response_and_may_repeat(client):
    a = cmpl(client, request_id="job-42")
    b = cmpl(client, request_id="job-42")        # the engine's ids stay unique
    assert a.id == b.id == "cmpl-job-42"
    assert chat(client, request_id="job-42").id == "chatcmpl-job-42"
    assert bad(cmpl, client, request_id="bad id!").body["param"] == "request_id"


def test_continuous_usage_stats(client):
    for stream in (cmpl(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                        **NO_EOS),
                   chat(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                        **NO_EOS)):
        chunks = list(stream)
        used = [c.usage.completion_tokens for c in chunks if c.choices]
        assert all(c.usage is not None for c in chunks)
        assert used == sorted(used) and used[-1] == 8 and chunks[-1].usage.completion_tokens == 8
    plain = list(cmpl(client, stream=True, stream_options={"include_usage": True}, **NO_EOS))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 8


def test_fields_refused_by_name(client):
    for field, value in (("use_beam_search", True), ("logits_processors", ["x"]),
                         ("prompt_embeds", "AAAA"), ("kv_transfer_params", {}), ("length_penalty", 0.5)):
        e = bad(cmpl, client, **{field: value})
        assert e.status_code == 400 and e.body["param"] == field and e.body["code"] == "unsupported_parameter"
        assert "not supported" in e.body["message"]
    # Their "off" values are served.
    assert cmpl(client, use_beam_search=False, length_penalty=1.0, spaces_between_special_tokens=False).choices


def test_unknown_fields_are_ignored_and_named(srv):
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=30,
                   json={"prompt": "x", "max_tokens": 2, "frobnicate": 1, "zeta": []})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate,zeta"
    r = httpx.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=30,
                   json={"prompt": "x", "max_tokens": 2})
    assert "x-ignored-fields" not in r.headers


def test_non_ascii_names(client):
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "会議メモ", "schema": SCHEMA}},
             max_tokens=64)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    for name in ("a.b", "a b", "x" * 65, ""):
        e = bad(chat, client, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMA}})
        assert e.body["param"] == "response_format.json_schema.name"
