"""`cache_salt` and `--cache-salt-per-key` over HTTP (issue 34, item 12), with the official `openai` client:
`usage.prompt_tokens_details.cached_tokens` of a request is 0 when the same prompt was sent only under
another salt or by another API key, and counts the shared blocks under the same salt and key, on
/v1/completions, /v1/chat/completions and /v1/responses; a bad salt is a 4xx naming the field. With several
keys, a stored response (`/v1/responses`) is its own key's only."""
from __future__ import annotations

import openai
import pytest
from server_harness import LiveServer, make_tiny_model

KEYS = ("key-a", "key-b")
LONG = "a system prompt long enough to fill several prefix-cache blocks of sixteen tokens. " * 2


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--served-model-name", "tiny",
                    "--api-key", ",".join(KEYS), "--cache-salt-per-key") as s:
        yield s


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def completion_cached(c: openai.OpenAI, prompt: str, **extra) -> int:
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def chat_cached(c: openai.OpenAI, content: str, **extra) -> int:
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=1,
                                  temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_salts_and_keys_share_no_block_and_the_same_salt_and_key_share(srv):
    a, b = client(srv, KEYS[0]), client(srv, KEYS[1])
    for i, ask in enumerate((completion_cached, chat_cached)):
        text = f"{i} {LONG}"
        assert ask(a, text, cache_salt="s1") == 0
        assert ask(a, text, cache_salt="s2") == 0           # another salt of the same key
        assert ask(b, text, cache_salt="s1") == 0           # the same salt under another key
        assert ask(a, text) == 0                            # the key's own unsalted namespace
        assert ask(b, text) == 0
        assert ask(a, text, cache_salt="s1") >= 64          # the same salt and key share
        assert ask(b, text) >= 64


def test_responses_take_the_salt(srv):
    a = client(srv, KEYS[0])
    text = "r " + LONG
    first = a.responses.create(model="tiny", input=text, max_output_tokens=1, extra_body={"cache_salt": "s9"})
    again = a.responses.create(model="tiny", input=text, max_output_tokens=1, extra_body={"cache_salt": "s9"})
    other = a.responses.create(model="tiny", input=text, max_output_tokens=1, extra_body={"cache_salt": "s10"})
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens >= 64
    assert other.usage.input_tokens_details.cached_tokens == 0


def test_a_stored_response_is_its_keys_only(srv):
    import httpx

    a, b = client(srv, KEYS[0]), client(srv, KEYS[1])
    first = a.responses.create(model="tiny", input="remember me", max_output_tokens=2)
    assert a.responses.retrieve(first.id).id == first.id
    assert a.responses.create(model="tiny", input="and then?", max_output_tokens=2, previous_response_id=first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model="tiny", input="and then?", max_output_tokens=2, previous_response_id=first.id)
    r = httpx.get(f"{srv.url}/v1/responses/{first.id}", headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 404 and "no response" in r.json()["error"]["message"]


@pytest.mark.parametrize("salt, status", [(7, 422), (["a"], 422), ({"a": 1}, 422), (True, 422), ("", 400),
                                          ("x" * 257, 400)])
def test_a_bad_salt_is_refused_naming_the_field(srv, salt, status):
    a = client(srv, KEYS[0])
    calls = (lambda: a.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"cache_salt": salt}),
             lambda: a.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=1, extra_body={"cache_salt": salt}),
             lambda: a.responses.create(model="tiny", input="x", max_output_tokens=1,
                                        extra_body={"cache_salt": salt}))
    for call in calls:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == status and e.value.body["param"] == "cache_salt", e.value.body


def test_every_key_is_admitted_and_a_wrong_one_is_not(srv):
    for key in KEYS:
        assert client(srv, key).models.list().data
    for wrong in ("key-c", "key-a,key-b", "key"):
        with pytest.raises(openai.AuthenticationError):
            client(srv, wrong).models.list()


@pytest.mark.parametrize("module, argv, needle", [
    ("namazu.server", ["--cache-salt-per-key"], "--cache-salt-per-key needs --api-key"),
    ("namazu.server", ["--api-key", "key-a,,key-b"], "the API key is empty"),
    ("namazu.server", ["--api-key", "key-a,key-b", "--replicas", "2"], "--replicas takes one --api-key"),
    ("server.router", ["--replica", "http://r:1", "--cache-salt-per-key"], "--cache-salt-per-key needs --api-key"),
    ("server.router", ["--replica", "http://r:1", "--api-key", "a, ,b"], "the API key is empty"),
])
def test_flags_that_cannot_isolate_are_refused_at_start_up(monkeypatch, capsys, module, argv, needle):
    import importlib

    monkeypatch.delenv("NAMAZU_API_KEY", raising=False)
    main = importlib.import_module(module if module == "namazu.server" else "server.router.__main__").main
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
