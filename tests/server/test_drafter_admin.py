"""POST /admin/drafter on a live server: a drafter swap during a burst of concurrent streams loses no request,
leaks no KV block and changes no greedy output; a bad drafter directory is refused (422 naming the field)
with the old drafter still serving; the route wants the admin key (not the API key) and a path under
--drafter-root; /metrics labels acceptance by drafter id."""
from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from dflash_fixtures import drafter_config, random_drafter
from engine_helpers import assert_same_outputs, prompts
from server_harness import LiveServer, make_tiny_model

from namazu import LLM, SamplingParams
from namazu.spec.dflash import DFlashDrafter
from server.admin_routes import check_admin_args

API, ADMIN = "api-key", "admin-key"
STREAMS, MAX_TOKENS = 24, 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("admin")
    model = make_tiny_model(base / "model")
    root = base / "drafters"
    root.mkdir()
    for name, seed in (("a", 0), ("b", 1)):
        shutil.copytree(random_drafter(str(model), seed=seed), root / name)
    DFlashDrafter(drafter_config(str(model), vocab_size=300)).save(root / "wrong-vocab")
    (base / "outside").mkdir()
    shutil.copytree(random_drafter(str(model), seed=2), base / "outside" / "c")
    with LiveServer(model, "--max-model-len", "256", "--max-num-seqs", "32", "--kv-cache-memory", "16MiB",
                    "--speculative-model", str(root / "a"), "--num-speculative-tokens", "3",
                    "--admin-key", ADMIN, "--drafter-root", str(root), "--debug-step-delay", "0.02",
                    "--log-level", "info", api_key=API) as srv:
        yield SimpleNamespace(srv=srv, model=model, root=root, outside=base / "outside")


def admin(srv, method: str, key: str | None = ADMIN, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, srv.url + "/admin/drafter", headers=headers, timeout=60, **kw)


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {API}"}, timeout=10).text


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], started: asyncio.Event) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    tokens: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {API}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for t in chunk["choices"][0]["logprobs"]["tokens"]:
                tokens.append(int(t.split(":", 1)[1]))
            if tokens:
                started.set()
    return tokens


def test_swap_during_a_burst_loses_nothing_and_keeps_greedy_outputs(setup):
    srv = setup.srv
    ps = prompts(STREAMS, lo=4, hi=30, seed=21)
    before = admin(srv, "GET").json()

    async def burst() -> tuple[list, httpx.Response]:
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(_stream(client, srv.url, p, started)) for p in ps]
            await started.wait()
            swap = await asyncio.to_thread(admin, srv, "POST", json={"path": "b"})
            outs = await asyncio.gather(*tasks)
        return outs, swap

    got, swap = asyncio.run(burst())
    assert swap.status_code == 200, swap.text
    answer = swap.json()
    assert answer["previous_drafter_id"] == before["drafter_id"] and answer["drafter_id"].startswith("b-")
    assert Path(answer["path"]) == (setup.root / "b").resolve()
    assert all(len(t) == MAX_TOKENS for t in got)
    with LLM(str(setup.model), executor="inline", num_speculative_tokens=0) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                ignore_eos=True), use_tqdm=False)]
    assert_same_outputs(str(setup.model), ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), got, want)
    deadline = time.monotonic() + 10
    while "namazu_kv_cache_usage_ratio" not in metrics(srv) or _value(metrics(srv), "namazu_kv_cache_usage_ratio"):
        assert time.monotonic() < deadline, "KV blocks still held after every request finished"
        time.sleep(0.1)
    text = metrics(srv)
    assert f'drafter="{answer["drafter_id"]}"' in text and f'drafter="{before["drafter_id"]}"' in text
    assert _value(text, "namazu_spec_drafter_serving", answer["drafter_id"]) == 1.0
    for d in (before["drafter_id"], answer["drafter_id"]):
        assert _value(text, "namazu_spec_drafter_draft_tokens_total", d) > 0
    assert _value(text, "namazu_engine_num_drafter_swaps_total") >= 1
    # Every sequence running at the swap was preempted to be recomputed: most of the burst was in flight.
    assert _value(text, "namazu_engine_num_preemptions_total") >= STREAMS // 2
    assert "drafter swapped" in srv.output()
    assert admin(srv, "GET").json()["drafter_id"] == answer["drafter_id"]


def _value(text: str, name: str, drafter: str | None = None) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and (drafter is None or f'drafter="{drafter}"' in line):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no {name} {drafter or ''} in /metrics")


def test_admin_route_wants_its_own_key_and_a_path_under_the_root(setup):
    srv = setup.srv
    serving = admin(srv, "GET").json()["drafter_id"]
    r = admin(srv, "POST", key=None, json={"path": "a"})
    assert r.status_code == 401 and "--admin-key" in r.json()["error"]["message"]
    assert admin(srv, "POST", key=API, json={"path": "a"}).status_code == 401      # the API key is not it
    assert admin(srv, "GET", key=API).status_code == 401
    assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401
    for path in ("../outside/c", str(setup.outside / "c")):
        r = admin(srv, "POST", json={"path": path})
        assert r.status_code == 403 and r.json()["error"]["param"] == "path", r.text
    assert admin(srv, "POST", json={"path": "nope"}).status_code == 400
    assert admin(srv, "POST", json={"path": "a", "force": True}).json()["error"]["param"] == "force"
    assert admin(srv, "POST", json=["a"]).status_code == 400
    assert admin(srv, "GET").json()["drafter_id"] == serving


def test_the_openapi_document_lists_the_admin_route_under_the_admin_key(setup):
    srv = setup.srv
    doc = httpx.get(srv.url + "/openapi.json", headers={"Authorization": f"Bearer {API}"}, timeout=10).json()
    route = doc["paths"]["/admin/drafter"]
    assert set(route) == {"get", "post"}
    assert all(op["security"] == [{"admin": []}] for op in route.values())
    assert doc["components"]["securitySchemes"]["admin"]["scheme"] == "bearer"
    body = route["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["path"] and body["additionalProperties"] is False
    assert {"401", "403", "422"} <= set(route["post"]["responses"])
    answer = admin(srv, "GET").json()
    schema = route["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) <= set(answer) and set(answer) <= set(schema["properties"])


def test_a_bad_drafter_is_refused_naming_the_field_and_the_old_one_serves_on(setup):
    srv = setup.srv
    serving = admin(srv, "GET").json()["drafter_id"]
    drafted = _value(metrics(srv), "namazu_spec_drafter_draft_tokens_total", serving)
    r = admin(srv, "POST", json={"path": "wrong-vocab"})
    assert r.status_code == 422 and "'vocab_size'" in r.json()["error"]["message"], r.text
    assert admin(srv, "GET").json()["drafter_id"] == serving
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {API}"}, timeout=60,
                   json={"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    assert _value(metrics(srv), "namazu_spec_drafter_draft_tokens_total", serving) > drafted


def test_admin_flags_and_no_route_without_the_key(tmp_path):
    for args, needle in (((ADMIN, None, None), "--drafter-root"), ((API, str(tmp_path), ["other", API]),
                                                                               "equals --api-key"),
                         ((" ", str(tmp_path), None), "empty"), ((None, str(tmp_path), None), "--admin-key too"),
                         ((ADMIN, str(tmp_path / "none"), None), "not a directory")):
        with pytest.raises(ValueError, match=needle):
            check_admin_args(*args)
    check_admin_args(ADMIN, str(tmp_path), [API])
    from server.app import build_app

    stub = SimpleNamespace(model_name="m", config=SimpleNamespace(max_logprobs=5),
                           model_config=SimpleNamespace(vocab_size=10))

    async def post(app) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            r = await c.post("/admin/drafter", json={"path": "a"}, headers={"Authorization": f"Bearer {ADMIN}"})
            return r.status_code

    assert asyncio.run(post(build_app(stub, allowed_hosts=None))) == 404
