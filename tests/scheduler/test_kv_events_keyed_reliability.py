"""Keyed KV-event hashes (issue 34, item 12, the part that needs no change to the prefix cache): with
--kv-events-key a replica publishes keyed hashes that a reader without the key cannot compute from a
guessed prompt, and the router keys its prompts' hashes the same way, so routing still matches."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from namazu.scheduler.kv_events import KVEventLog, prompt_block_hashes
from server.kv_event_keys import keyed, parse_key
from server.replica_routes import kv_events

KEY = parse_key("events-secret")


def _events_app(key: bytes | None, log: KVEventLog) -> Starlette:
    engine = SimpleNamespace(kv_events=lambda after, limit, rid: log.since(after, limit, rid))
    app = Starlette(routes=[Route("/kv/events", kv_events)])
    app.state.server = SimpleNamespace(engine=engine, kv_events_key=key)
    return app


def _get(app: Starlette, query: str) -> dict:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/kv/events" + query)).json()
    return asyncio.run(go())


def test_published_hashes_are_keyed_and_match_the_routers():
    prompt = list(range(64))
    hashes = prompt_block_hashes(prompt, 16)
    log = KVEventLog()
    log.stored(hashes)
    plain = _get(_events_app(None, log), "?after=0")
    secret = _get(_events_app(KEY, log), "?after=0")
    stored_plain = [h for e in plain["events"] for h in e["block_hashes"]]
    stored_keyed = [h for e in secret["events"] for h in e["block_hashes"]]
    assert stored_plain == hashes                       # unkeyed: anyone can recompute them
    assert stored_keyed == keyed(KEY, hashes)           # what a router with the key computes
    assert not set(stored_keyed) & set(hashes)
    assert keyed(parse_key("another"), hashes) != stored_keyed
    snapshot = _get(_events_app(KEY, log), "?after=0&replica_id=someone-else")["snapshot"]
    assert snapshot == sorted(keyed(KEY, hashes))


def test_the_router_keys_its_prompt_hashes(tmp_path):
    from namazu.assets import default_model_path
    from namazu.tokenizer import Tokenizer
    from server.router.policy import make_policy
    from server.router.pool import ReplicaPool
    from server.router.proxy import FrontDoor, Router

    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    pool = ReplicaPool(["http://r:1"], client)
    tok = Tokenizer.from_pretrained(default_model_path())
    routers = [Router(pool, make_policy("kv", 4.0, 1.0, 0, 2.0), tok, client, None, 16, FrontDoor(kv_events_key=k))
               for k in (None, KEY)]
    raw = b'{"prompt": "' + b"a long enough prompt to fill several blocks " * 4 + b'"}'
    (_, ids, plain, _, _), (_, _, secret, _, _) = (r.prepare("/v1/completions", raw) for r in routers)
    assert plain == prompt_block_hashes(ids, 16) and len(plain) >= 2
    assert secret == keyed(KEY, plain)
    for r in routers:
        r.close()
