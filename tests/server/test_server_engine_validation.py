"""The server refuses what the engine would refuse through the engine's own checks
(`AsyncEngine.validate_request`), before any response byte: one check, one message."""
import httpx
import pytest
from server_harness import LiveServer, make_tiny_model


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, "--max-model-len", "64", "--kv-cache-memory", "16MiB") as s:
        yield s


@pytest.mark.parametrize("prompt, param, words", [
    ([1, 2, 99999], "prompt", "outside the vocabulary"),
    (["ok", [5, -1]], "prompt[1]", "outside the vocabulary"),
    ([7] * 80, "prompt", "maximum context length is 64"),
])
def test_token_id_prompts_are_checked_by_the_engine(srv, prompt, param, words):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
