"""The front door the server and the router share (issue 34, items 1-4 and 13): client authentication
on the router, body / JSON limits, JSON-only bodies and the Host check, connection deadlines a dribbling
client cannot stretch, the connection cap, and a stalled reader's response generator closed at once.

The router runs in process over a fake replica (httpx.MockTransport); connection-level limits run on a
real uvicorn server in a thread, since they live in its HTTP protocol."""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from server.front_door import AuthMiddleware, allowed_hosts
from server.router.policy import make_policy
from server.router.pool import ReplicaPool
from server.router.proxy import FrontDoor, Router

CLIENT_KEY, REPLICA_KEY = "client-key", "replica-key"
REPLICA = "http://replica:1"


class FakeReplica:
    """Answers like a namazu replica with --api-key REPLICA_KEY; records what it was sent."""

    def __init__(self):
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.headers.get("authorization") != f"Bearer {REPLICA_KEY}":
            return httpx.Response(401, json={"error": {"message": "no key"}})
        if request.url.path == "/load":
            return httpx.Response(200, json={"block_size": 16, "max_num_seqs": 4})
        if request.url.path == "/kv/events":
            return httpx.Response(200, json={"replica_id": "r", "last_id": 0, "events": [], "more": False})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        return httpx.Response(200, json={"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})


@pytest.fixture()
def router(tiny_tokenizer):
    fake = FakeReplica()
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    headers = {"Authorization": f"Bearer {REPLICA_KEY}"}
    pool = ReplicaPool([REPLICA], client, headers=headers)
    front = FrontDoor(api_key=CLIENT_KEY, max_request_bytes=8192, body_timeout=5.0,
                      allowed_hosts=allowed_hosts("127.0.0.1", None))
    r = Router(pool, make_policy("round_robin", 4.0, 1.0, 0, 2.0), tiny_tokenizer, client, headers, None, front)
    asyncio.run(pool.check(pool.replicas[REPLICA]))
    yield r, fake
    r.close()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from namazu.assets import default_model_path
    from namazu.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_path())


def _call(router: Router, method: str, path: str, headers: dict | None = None, content: bytes | None = None,
          host: str = "127.0.0.1:8080") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=router.app())
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as c:
            return await c.request(method, path, headers=headers, content=content)
    return asyncio.run(go())


def _json(body: dict | bytes) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


AUTH = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": f"Bearer {REPLICA_KEY}"}],
                         ids=["no key", "wrong key", "the replicas' key"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/router/state"), ("GET", "/metrics")])
def test_router_refuses_a_client_without_its_key(router, headers, method, path):
    r, fake = router
    forwarded = len([q for q in fake.seen if q.url.path.startswith("/v1")])
    resp = _call(r, method, path, {**headers, "Content-Type": "application/json"},
                 _json({"prompt": "x"}) if method == "POST" else None)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["code"] == "invalid_api_key" and "--api-key" in resp.json()["error"]["message"]
    assert len([q for q in fake.seen if q.url.path.startswith("/v1")]) == forwarded, "forwarded anyway"


def test_router_forwards_with_the_replica_key_not_the_clients(router):
    r, fake = router
    assert _call(r, "GET", "/health").status_code == 200            # open, as on the server
    resp = _call(r, "POST", "/v1/completions", AUTH, _json({"prompt": "hello", "max_tokens": 2}))
    assert resp.status_code == 200, resp.text
    sent = [q for q in fake.seen if q.url.path == "/v1/completions"][-1]
    assert sent.headers["authorization"] == f"Bearer {REPLICA_KEY}"
    assert _call(r, "GET", "/router/state", AUTH).status_code == 200


@pytest.mark.parametrize("name,body,status", [
    ("100k-deep nesting", b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 413),
    ("deep nesting under the size limit", b'{"prompt": "x", "stop": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400),
    ("9000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"9" * 9000 + b"}", 413),
    ("5000-digit integer under the size limit", b'{"prompt": "x", "max_tokens": ' + b"9" * 4400 + b"}", 400),
    ("duplicate keys", b'{"prompt": "x", "prompt": "y"}', 400),
    ("not JSON", b"{nope", 400),
    ("over the size limit", _json({"prompt": "x" * 9000}), 413),
])
def test_router_applies_the_servers_body_limits(router, name, body, status):
    r, fake = router
    resp = _call(r, "POST", "/v1/completions", AUTH, body)
    assert resp.status_code == status, (name, resp.text[:300])
    assert resp.json()["error"]["message"]
    assert not [q for q in fake.seen if q.url.path == "/v1/completions"], "forwarded a refused body"


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_bodies_that_a_web_page_can_send_without_preflight_are_refused(router, ctype):
    r, _ = router
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", **({"Content-Type": ctype} if ctype else {})}
    resp = _call(r, "POST", "/v1/completions", headers, _json({"prompt": "x"}))
    assert resp.status_code == 415, resp.text


def test_host_header_must_name_the_bound_address(router):
    r, _ = router
    for host in ("evil.example:8080", "127.0.0.1.evil.example"):
        resp = _call(r, "GET", "/v1/models", AUTH, host=host)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "invalid_host", resp.text
    assert _call(r, "GET", "/health", host="evil.example").status_code == 200
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080"):
        assert _call(r, "GET", "/v1/models", AUTH, host=host).status_code == 200, host


def test_allowed_hosts_defaults():
    assert allowed_hosts("0.0.0.0", None) is None
    assert allowed_hosts("127.0.0.1", "*") is None
    assert allowed_hosts("10.1.2.3", None) == {"10.1.2.3"}
    assert allowed_hosts("127.0.0.1", "api.example, other") == {"api.example", "other"}
    with pytest.raises(ValueError):
        allowed_hosts("127.0.0.1", " , ")


def test_router_survives_a_huge_max_tokens(router):
    # 3000 digits parse (Python's limit is 4300) but overflowed the router's float arithmetic: a 500.
    r, _ = router
    resp = _call(r, "POST", "/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": ' + b"9" * 3000 + b"}")
    assert resp.status_code == 200, resp.text      # forwarded: the replica explains its own 400


def test_router_tokenizes_off_its_event_loop(router):
    r, _ = router
    threads = []
    original = r.prompt_ids

    def recording(path, body):
        threads.append(threading.current_thread().name)
        return original(path, body)

    r.prompt_ids = recording
    assert _call(r, "POST", "/v1/completions", AUTH, _json({"prompt": "a b c"})).status_code == 200
    assert threads and threads[0].startswith("router-prepare"), threads


# -- connection-level limits (a real uvicorn server) ------------------------------------------------------
class _Served:
    def __init__(self, app, **limits):
        import uvicorn

        from server.timeouts import guarded_protocol

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", http=guarded_protocol(**limits), timeout_keep_alive=5,
                                loop="asyncio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def _keyed_app():
    async def ok(request: Request):
        await request.body()
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", ok, methods=["POST"]), Route("/health", ok)])
    app.add_middleware(AuthMiddleware, api_key="k")
    return app


def _closed(s: socket.socket) -> bool:
    try:
        s.send(b"0")
        s.settimeout(0.05)
        return s.recv(65536) == b""
    except (BrokenPipeError, ConnectionResetError):
        return True
    except (TimeoutError, BlockingIOError):
        return False


def test_a_dribbling_body_cannot_hold_its_connection():
    # The 401 goes out before the body is read; one body byte every 0.2 s then kept the connection open
    # for ever. The body deadline (--body-timeout, 1 s here, plus its second of grace) closes it.
    with _Served(_keyed_app(), header_timeout=5.0, body_timeout=1.0) as srv, srv.connect() as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n{")
        assert s.recv(65536).startswith(b"HTTP/1.1 401")
        t0 = time.monotonic()
        while not _closed(s):
            assert time.monotonic() - t0 < 6.0, "the dribbling connection is still open"
            time.sleep(0.2)
        assert time.monotonic() - t0 >= 1.5


def test_connections_past_the_cap_get_503_and_are_closed():
    with _Served(_keyed_app(), header_timeout=5.0, body_timeout=5.0, max_connections=3) as srv:
        held = [srv.connect() for _ in range(3)]
        time.sleep(0.2)
        with srv.connect() as extra:
            reply = extra.recv(65536)
            assert reply.startswith(b"HTTP/1.1 503"), reply[:100]
            assert b"--max-connections" in reply and b"connection: close" in reply.lower()
            assert extra.recv(65536) == b""                          # and closed
        for s in held:
            s.close()
        time.sleep(0.3)
        with srv.connect() as again:                                 # room again once they left
            again.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert again.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_stalled_stream_closes_its_generator_at_once():
    # A client that stops reading: the write timeout gives up on the response. The body generator's
    # `finally` (which aborts the engine requests) must run then, not when the garbage collector finds it.
    from server.timeouts import ClosingStream, WriteTimeoutMiddleware

    closed = []

    async def body():
        try:
            for i in range(1000):
                yield b"data: %d\n\n" % i
        finally:
            closed.append(True)

    async def never(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()

    async def receive():
        await asyncio.Event().wait()

    async def app(scope, receive, send):
        await ClosingStream(StreamingResponse(body(), media_type="text/event-stream"))(scope, receive, send)

    async def go() -> list:
        await WriteTimeoutMiddleware(app, timeout=0.2)({"type": "http", "path": "/x"}, receive, never)
        await asyncio.sleep(0.05)
        return list(closed)       # before asyncio.run's own clean-up closes what is left

    gc.disable()
    try:
        assert asyncio.run(go()) == [True]
    finally:
        gc.enable()


def test_the_connection_cap_fits_the_descriptor_limit():
    # Past the descriptor limit /health failed too: the cap must run out first.
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    code = ("import resource; from server.front_door import fit_connection_cap;"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)); print(fit_connection_cap(512));"
            "print(fit_connection_cap(50))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    assert out.stdout.split() == ["72", "50"], out


def test_router_cuts_a_stalled_reader_and_closes_its_upstream_stream(tiny_tokenizer):
    # Before, the router had no write timeout: a client that stopped reading held its connection, and the
    # relay generator (which closes the upstream stream, aborting the request on the replica) stayed open.
    async def sse():
        for _ in range(10_000):
            yield b'data: {"choices": [{"text": "x"}]}\n\n'

    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse())
        return FakeReplica()(request)

    async def go():
        client = httpx.AsyncClient(transport=httpx.MockTransport(replica))
        headers = {"Authorization": f"Bearer {REPLICA_KEY}"}
        pool = ReplicaPool([REPLICA], client, headers=headers)
        await pool.check(pool.replicas[REPLICA])
        r = Router(pool, make_policy("round_robin", 4.0, 1.0, 0, 2.0), tiny_tokenizer, client, headers, None,
                   FrontDoor(write_timeout=0.3))
        body = _json({"prompt": "x", "stream": True})
        sent = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if sent:
                return sent.pop()
            await asyncio.Event().wait()

        async def stalled_send(message):
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()        # the client reads nothing

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8080),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                             (b"host", b"127.0.0.1:8080")], "http_version": "1.1"}
        await asyncio.wait_for(r.app()(scope, receive, stalled_send), 10)
        await asyncio.sleep(0.05)
        in_flight = pool.replicas[REPLICA].in_flight
        r.close()
        return in_flight

    gc.disable()
    try:
        in_flight = asyncio.run(go())
    finally:
        gc.enable()
    assert in_flight == 0, "the relay was left open (its finally closes the upstream stream)"
