"""The router and `cache_salt` (issue 34, item 12): with `--cache-salt-per-key` it salts each request by its
client's key before forwarding (the replicas all see the router's one key, so they cannot), hashes the
prompt from that salt's root, and leaves a salt the replica will refuse as it came; without the flag the
body goes through unchanged. Runs in process over a fake replica that records what it was sent."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from namazu.scheduler.kv_events import prompt_block_hashes
from server.front_door import allowed_hosts, tenant_cache_salt, tenant_id
from server.router.policy import make_policy
from server.router.pool import ReplicaPool
from server.router.proxy import FrontDoor, Router

KEYS = ("tenant-key-a", "tenant-key-b")
REPLICA = "http://replica:1"
PROMPT = "a shared system prompt, long enough to fill several blocks of sixteen tokens each " * 2


class FakeReplica:
    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            return httpx.Response(200, json={"block_size": 16, "max_num_seqs": 4})
        if request.url.path == "/kv/events":
            return httpx.Response(200, json={"replica_id": "r", "last_id": 0, "events": [], "more": False})
        if request.url.path.startswith("/v1/"):
            self.bodies.append(json.loads(request.content))
            return httpx.Response(200, json={"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})
        return httpx.Response(200, json={"status": "ok"})


@pytest.fixture(scope="module")
def tokenizer():
    from namazu.assets import default_model_path
    from namazu.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_path())


def make_router(tokenizer, per_key: bool) -> tuple[Router, FakeReplica]:
    fake = FakeReplica()
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    pool = ReplicaPool([REPLICA], client)
    front = FrontDoor(api_key=",".join(KEYS), allowed_hosts=allowed_hosts("127.0.0.1", None),
                      cache_salt_per_key=per_key)
    router = Router(pool, make_policy("kv", 4.0, 1.0, 0, 2.0), tokenizer, client, None, 16, front)
    asyncio.run(pool.check(pool.replicas[REPLICA]))
    return router, fake


def post(router: Router, key: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.app()),
                                     base_url="http://127.0.0.1:8080") as c:
            return await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return asyncio.run(go())


@pytest.mark.parametrize("own", [None, "session-1"])
def test_each_clients_key_salts_what_reaches_the_replica(tokenizer, own):
    router, fake = make_router(tokenizer, per_key=True)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1} | ({"cache_salt": own} if own else {})
        for key in KEYS:
            assert post(router, key, body).status_code == 200
        salts = [b["cache_salt"] for b in fake.bodies]
        want = [tenant_cache_salt(tenant_id(k.encode()), own) for k in KEYS]
        assert salts == want and salts[0] != salts[1]
        assert all(b["prompt"] == PROMPT for b in fake.bodies)
        # The router's hashes of the prompt are the replica's for the rewritten salt.
        _, ids, hashes, _, raw = router.prepare("/v1/completions", json.dumps(body).encode(),
                                                tenant_id(KEYS[0].encode()))
        assert json.loads(raw)["cache_salt"] == want[0]
        assert len(hashes) >= 2 and hashes == prompt_block_hashes(ids, 16, want[0])
        assert hashes != prompt_block_hashes(ids, 16, own)
    finally:
        router.close()


def test_without_the_flag_the_body_and_its_salt_pass_unchanged(tokenizer):
    router, fake = make_router(tokenizer, per_key=False)
    try:
        raw = json.dumps({"prompt": PROMPT, "cache_salt": "s"}).encode()
        _, ids, hashes, _, forwarded = router.prepare("/v1/completions", raw)
        assert forwarded is raw and hashes == prompt_block_hashes(ids, 16, "s")
        assert post(router, KEYS[1], {"prompt": PROMPT, "cache_salt": "s"}).status_code == 200
        assert fake.bodies[-1]["cache_salt"] == "s"
    finally:
        router.close()


@pytest.mark.parametrize("bad", [7, "", "x" * 257])
def test_a_salt_the_replica_refuses_is_forwarded_as_it_came(tokenizer, bad):
    router, _ = make_router(tokenizer, per_key=True)
    try:
        raw = json.dumps({"prompt": PROMPT, "cache_salt": bad}).encode()
        _, _, _, _, forwarded = router.prepare("/v1/completions", raw, tenant_id(KEYS[0].encode()))
        assert forwarded is raw
    finally:
        router.close()
