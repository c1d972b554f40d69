"""The front door wired into the real processes (issue 34): `python -m namazu.server` and
`python -m server.router` in front of it, with distinct client and replica keys."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
from router_harness import LiveRouter
from server_harness import LiveServer, make_tiny_model

REPLICA_KEY, CLIENT_KEY = "replica-secret", "client-secret"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4",
                    "--max-connections", "6", "--body-timeout", "2", api_key=REPLICA_KEY) as srv, \
         LiveRouter([srv.url], model, "--replica-api-key", REPLICA_KEY, "--api-key", CLIENT_KEY,
                    "--max-request-bytes", "64KiB") as router:
        yield srv, router


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_router_needs_the_clients_key_and_forwards_with_the_replicas(fleet):
    srv, router = fleet
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, _auth("wrong"), _auth(REPLICA_KEY)):
        for method, path in (("POST", "/v1/completions"), ("GET", "/router/state"), ("GET", "/metrics")):
            r = httpx.request(method, router.url + path, json=body if method == "POST" else None,
                              headers=headers, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
    r = httpx.post(router.url + "/v1/completions", json=body, headers=_auth(CLIENT_KEY), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


def test_router_refuses_what_the_server_refuses(fleet):
    _, router = fleet
    h = {**_auth(CLIENT_KEY), "Content-Type": "application/json"}
    deep = b'{"prompt": "x", "stop": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    for raw, status in ((deep, 400), (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
                        (b'{"prompt": "' + b"x" * 70_000 + b'"}', 413)):
        r = httpx.post(router.url + "/v1/completions", content=raw, headers=h, timeout=30)
        assert r.status_code == status, r.text[:200]
    r = httpx.post(router.url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={**_auth(CLIENT_KEY), "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415


def test_server_front_door(fleet):
    srv, _ = fleet
    h = _auth(REPLICA_KEY)
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                   headers={**h, "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415
    r = httpx.get(srv.url + "/v1/models", headers={**h, "Host": "rebound.example"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_host"
    # A dribbler that got its 401 is closed by the body deadline (2 s + 1 s here).
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n{")
        assert s.recv(65536).startswith(b"HTTP/1.1 401")
        t0 = time.monotonic()
        s.settimeout(0.5)
        while True:
            assert time.monotonic() - t0 < 8, "still open"
            try:
                s.sendall(b" ")
                if s.recv(65536) == b"":
                    break
            except (TimeoutError, BlockingIOError):
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
    # The connection cap: the router holds some keep-alive connections; fill the rest, then one more.
    held = []
    try:
        for _ in range(8):
            held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
        time.sleep(0.3)
        replies = []
        for s in held:
            s.settimeout(0.3)
            try:
                replies.append(s.recv(65536))
            except TimeoutError:
                replies.append(b"")
        refused = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
        assert refused and b"too_many_connections" in refused[0]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
