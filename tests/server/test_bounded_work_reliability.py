"""Expensive per-request work is bounded (issue 34, item 5): grammar compiles on a pool of their own,
identical ones shared, at most N distinct at once, dropped when every requester left before they
started; request preparation on its own pool; a prompt too long for the context refused before it is
tokenized. The live part: a storm of schemas beside a plain request."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_harness import LiveServer, make_tiny_model

from namazu.assets import default_model_path
from namazu.engine.grammar_compiles import GrammarCompiles
from namazu.sampling_params import SamplingParams
from namazu.tokenizer import PromptTooLong, Tokenizer


class _Overloaded(Exception):
    pass


def _params(i: int) -> SamplingParams:
    return SamplingParams(regex=f"a{i}")


def test_identical_compiles_share_one():
    calls = []

    def slow(p):
        calls.append(p.regex)
        time.sleep(0.2)

    async def go():
        g = GrammarCompiles(slow, threads=1, max_pending=2)
        await asyncio.gather(*(g.compile(_params(0)) for _ in range(6)))
        g.shutdown()
        return g
    g = asyncio.run(go())
    assert calls == ["a0"] and g.num_shared == 5


def test_distinct_compiles_past_the_bound_are_refused_and_errors_reach_every_waiter():
    release = threading.Event()

    def blocked(p):
        release.wait(5)
        if p.regex == "a1":
            raise ValueError("bad regex")

    async def go():
        g = GrammarCompiles(blocked, threads=1, max_pending=2, overloaded=_Overloaded)
        first = asyncio.ensure_future(g.compile(_params(0)))
        second = [asyncio.ensure_future(g.compile(_params(1))) for _ in range(2)]
        for _ in range(500):                  # both distinct compiles registered (a loaded machine is slow)
            if g.num_pending == 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(_Overloaded):
            await g.compile(_params(2))
        release.set()
        await first
        for s in second:
            with pytest.raises(ValueError, match="bad regex"):
                await s
        assert g.num_pending == 0
        await g.compile(_params(2))           # room again
        g.shutdown()
    asyncio.run(go())


def test_a_compile_nobody_waits_for_is_dropped_before_it_starts():
    release, ran = threading.Event(), []

    def fn(p):
        ran.append(p.regex)
        release.wait(5)

    async def go():
        g = GrammarCompiles(fn, threads=1, max_pending=4)
        running = asyncio.ensure_future(g.compile(_params(0)))
        queued = asyncio.ensure_future(g.compile(_params(1)))      # behind the first on the one thread
        await asyncio.sleep(0.05)
        queued.cancel()                                             # its client left
        await asyncio.sleep(0.05)
        release.set()
        await running
        await asyncio.sleep(0.05)
        g.shutdown()
        return g
    g = asyncio.run(go())
    assert ran == ["a0"] and g.num_dropped == 1 and g.num_pending == 0


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(default_model_path())


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(tok, monkeypatch):
    from server.api_error import APIError
    from server.common import check_fits

    text = "x" * (8 << 20)
    assert tok.min_tokens(text) > 4096
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or [])
    with pytest.raises(APIError) as e:
        check_fits(tok, text, 4096, "prompt")
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(PromptTooLong):
        tok.encode_chat([{"role": "user", "content": text}], max_tokens=4096)
    # Refused with the tokenizer never called (no wall-clock bound: rendering 8 MB through the chat template
    # takes what the machine gives it, and CI's machine once needed more than 2 s).
    assert not calls
    # The bound is a lower bound: a text that fits is never refused by it.
    for s in ("hello world " * 50, "日本語" * 100, "<|im_end|>" * 30):
        monkeypatch.undo()
        assert tok.min_tokens(s) <= len(tok.encode(s, add_special_tokens=False))


def test_preparation_and_compiles_run_on_their_own_pools():
    from server.common import off_loop

    async def go():
        prepare = await off_loop(lambda: threading.current_thread().name)
        g = GrammarCompiles(lambda p: names.append(threading.current_thread().name))
        await g.compile(_params(0))
        g.shutdown()
        return prepare
    names: list[str] = []
    assert asyncio.run(go()).startswith("namazu-prepare") and names[0].startswith("namazu-grammar")


# -- live: a storm of schemas beside plain requests -------------------------------------------------------
def _schema(i: int, n: int = 600) -> dict:
    return {"type": "object", "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 5} for j in range(n)},
            "required": [f"k{i}_{j}" for j in range(n)]}


def _structured(url: str, i: int) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "json"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(i)}}}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_a_storm_of_schemas_does_not_hold_up_a_plain_request(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "8",
                    "--max-grammar-compiles", "3") as srv:
        plain = {"prompt": "plain", "max_tokens": 2}
        httpx.post(srv.url + "/v1/completions", json=plain, timeout=60)
        t0 = time.perf_counter()
        httpx.post(srv.url + "/v1/completions", json=plain, timeout=60)
        alone = time.perf_counter() - t0
        results: dict[int, int] = {}

        def storm(i: int, k: int) -> None:
            results[k] = _structured(srv.url, i).status_code

        # Three distinct schemas, the first sent three times (one compile), then one past the bound.
        threads = [threading.Thread(target=storm, args=(i, k)) for k, i in enumerate((0, 0, 0, 1, 2))]
        for t in threads:
            t.start()
        time.sleep(0.3)
        over = _structured(srv.url, 3)
        lat = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert httpx.post(srv.url + "/v1/completions", json=plain, timeout=60).status_code == 200
            lat.append(time.perf_counter() - t0)
        for t in threads:
            t.join(120)
        assert over.status_code == 429 and "grammar compiles" in over.json()["error"]["message"]
        assert sorted(results.values()) == [200] * 5, results
        # The plain requests ran beside the compiles, not behind them (a compile here takes seconds).
        assert max(lat) < alone + 1.5, (alone, lat)
        assert "namazu_engine" in httpx.get(srv.url + "/metrics", timeout=10).text
        json.dumps(results)


def test_large_requests_are_prepared_apart_from_small_ones():
    from server.prepare_pool import LARGE_BYTES, body_size, run_prepare

    async def go():
        name = lambda: threading.current_thread().name  # noqa: E731
        small = await run_prepare(name)
        body_size.set(LARGE_BYTES + 1)
        large = await run_prepare(name)
        return small, large
    small, large = asyncio.run(go())
    assert small.startswith("namazu-prepare_") and large.startswith("namazu-prepare-large")


def test_compile_threads_run_at_a_lower_priority():
    import os

    from namazu.engine.grammar_compiles import NICE

    seen = []

    async def go():
        g = GrammarCompiles(lambda p: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        await g.compile(_params(0))
        g.shutdown()
    asyncio.run(go())
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == [min(19, base + NICE)]
