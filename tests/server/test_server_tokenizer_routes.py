"""/tokenize, /detokenize, /tokenizer_info and /version in vLLM's shapes, live: ids equal the checkpoint's own
tokenizer's, a chat body counts what /v1/chat/completions sees, and the probe lm-eval-harness's remote
tokenizer makes (tokenizer_info with eos_token, then tokenize) succeeds."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import LiveServer, make_tiny_model

import namazu
from namazu.tokenizer import Tokenizer

KEY = "tok-key"
MSGS = [{"role": "system", "content": "手短に"}, {"role": "user", "content": "こんにちは"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def srv(model):
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
                    api_key=KEY) as s:
        yield s


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, headers=srv.headers(), timeout=30, **kw)


def test_tokenize_and_detokenize_match_the_tokenizer(srv, model):
    tok = Tokenizer.from_pretrained(model)
    text = "Hello, 世界! <|im_end|>"
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    bare = post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    back = post(srv, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)}
    assert text in back["prompt"]


def test_chat_tokenize_counts_what_chat_completions_sees(srv):
    ids = post(srv, "/tokenize", {"messages": MSGS}).json()["tokens"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert r.usage.prompt_tokens == len(ids)
    no_gen = post(srv, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()["tokens"]
    assert ids[:len(no_gen)] == no_gen and len(no_gen) < len(ids)


def test_tokenizer_info_and_version(srv, model):
    tok = Tokenizer.from_pretrained(model)
    info = httpx.get(srv.url + "/tokenizer_info", headers=srv.headers(), timeout=10).json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 256
    assert info["vocab_size"] == tok.vocab_size and info["tokenizer_class"]
    assert httpx.get(srv.url + "/version", headers=srv.headers(), timeout=10).json() == {"version": namazu.__version__}


def test_lm_eval_remote_tokenizer_probe(srv):
    """What lm-eval's local-completions does with only base_url (lm_eval.utils.check_remote_tokenizer_support,
    RemoteTokenizer): the server root from base_url, GET /tokenizer_info with an eos_token, POST /tokenize
    with a bare prompt, and the eos token's id from tokenizing its text."""
    base = (srv.url + "/v1/completions").replace("/v1/completions", "")
    info = httpx.get(base + "/tokenizer_info", headers=srv.headers(), timeout=10).json()
    assert isinstance(info, dict) and "eos_token" in info
    r = httpx.post(base + "/tokenize", json={"prompt": "test", "add_special_tokens": False}, headers=srv.headers())
    assert isinstance(r.json()["tokens"], list)
    eos_id = httpx.post(base + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                        headers=srv.headers()).json()["tokens"]
    assert len(eos_id) == 1
    try:
        from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    except ImportError:
        return
    assert check_remote_tokenizer_support(srv.url + "/v1/completions", auth_token=KEY)
    rt = RemoteTokenizer(srv.url + "/v1/completions", auth_token=KEY)
    assert rt.decode(rt.encode("こんにちは")) == "こんにちは" and rt.eos_token_id == eos_id[0]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 422, "prompt"),
    ("/tokenize", {"prompt": 3}, 422, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MSGS}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 422, "tokens"),
    ("/detokenize", {}, 422, "tokens"),
])
def test_bad_bodies_are_named(srv, path, body, status, param):
    r = post(srv, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_routes_need_the_key(srv):
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                         ("GET", "/version"), ("POST", "/v1/responses")):
        assert httpx.request(method, srv.url + path, json={}, timeout=10).status_code == 401
