"""The router's ASGI app: an OpenAI-compatible front that forwards each request to one replica.

Per request: tokenize the prompt as a namazu server would (chat template for chat), hash its blocks
(from the root its `cache_salt` gives, as the replica does), score every healthy replica (`policy.py`),
forward the body unchanged (but for its `cache_salt` under `--cache-salt-per-key`, which the client's key
decides). The router commits to a replica only once its first response bytes arrived:
a replica that refuses the connection, drops it, answers 503 or fails its health checks before that is
taken out of rotation and the request goes to the next best one. After the first streamed byte a failure
ends the stream with an in-band error (the client already has tokens). A client that disconnects closes
the upstream connection, which aborts the request on the replica.

The front door is the server's (`server/front_door.py`, `server/timeouts.py`): the clients' API key
(distinct from the replicas' key the router forwards with) on every route but /health, JSON bodies only,
a Host check, the body size limit and the JSON depth, digit and duplicate-key limits; parsing a large
body and tokenizing a prompt run on a small thread pool of their own, so /health and cheap requests are
answered while a large prompt is tokenized.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from namazu.sampling_params import MAX_CACHE_SALT_CHARS
from namazu.scheduler.kv_events import PromptHasher, request_cache_salt
from server.api_error import APIError
from server.front_door import AuthMiddleware, BrowserGuardMiddleware, read_body, tenant_cache_salt, tenant_of
from server.json_body import parse_json
from server.kv_event_keys import keyed
from server.router.load_model import DEFAULT_STEPS, decode_steps
from server.router.policy import Policy
from server.router.pool import Replica, ReplicaPool
from server.router.router_metrics import RouterMetrics
from server.timeouts import ClosingStream, WriteTimeoutMiddleware

logger = logging.getLogger(__name__)

_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_TAIL = 1024        # bytes of a stream kept to read its usage chunk from
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "param": None, "code": code}},
                        status_code=status)


class _Retry(Exception):
    """The replica failed before anything was sent to the client."""


@dataclasses.dataclass
class FrontDoor:
    """The client-facing limits (the server's flags of the same names)."""

    api_key: str | None = None                  # clients' key (--api-key); None: no authentication
    max_request_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0
    allowed_hosts: Iterable[str] | None = None  # None: any Host header
    prepare_threads: int = 2                    # parsing + tokenizing pool
    write_timeout: float = 30.0                 # a client that reads nothing this long is cut off
    kv_events_key: bytes | None = None          # the replicas' --kv-events-key: their events are keyed
    cache_salt_per_key: bool = False            # --cache-salt-per-key: salt each request by its client's key


class Router:
    def __init__(self, pool: ReplicaPool, policy: Policy, tokenizer: Any, client: httpx.AsyncClient,
                 replica_headers: dict[str, str] | None = None, block_size: int | None = None,
                 front: FrontDoor | None = None):
        self.pool, self.policy, self.tokenizer, self.client = pool, policy, tokenizer, client
        self.replica_headers = replica_headers or {}
        self.fixed_block_size = block_size
        self.front = front or FrontDoor()
        self.metrics = RouterMetrics(pool, policy.name)
        self._hashers: dict[int, PromptHasher] = {}
        # Its own small pool: asyncio's default one is shared with everything else on the loop.
        self._prepare_pool = ThreadPoolExecutor(max(1, self.front.prepare_threads), "router-prepare")

    # -- prompts ----------------------------------------------------------------------------------------
    def hasher(self) -> PromptHasher | None:
        bs = self.fixed_block_size or self.pool.block_size
        if bs is None:
            return None
        if bs not in self._hashers:
            self._hashers[bs] = PromptHasher(self.tokenizer, bs)
        return self._hashers[bs]

    def prompt_ids(self, path: str, body: Any) -> list[int]:
        """The prompt's token ids, or [] if the body is not something a replica would accept (the replica
        then answers with its own 400; the router never second-guesses validation)."""
        hasher = self.hasher()
        if hasher is None or not isinstance(body, dict):
            return []
        try:
            if path.endswith("/chat/completions"):
                return hasher.chat_ids(body["messages"], body.get("tools"))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]              # several prompts: route by the first
            if isinstance(prompt, str):
                return hasher.text_ids(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except Exception as e:                  # a malformed body: let the replica explain it
            logger.debug("cannot tokenize the request for routing: %s", e)
        return []

    def prepare(self, path: str, raw: bytes, tenant: str | None = None
                ) -> tuple[Any, list[int], list[int], int, bytes]:
        """Body, prompt ids, block hashes, block size and the bytes to forward of a request: blocking, on
        the prepare pool. `tenant` (under --cache-salt-per-key): the body's `cache_salt` becomes the
        tenant's salt (the server's rule, `tenant_cache_salt`), so a replica keeps tenants apart although
        every request reaches it with the router's one key."""
        body = parse_json(raw)          # an APIError (400) for what a replica would refuse as JSON too
        if tenant is not None and isinstance(body, dict):
            own = body.get("cache_salt")
            if own is None or (isinstance(own, str) and 0 < len(own) <= MAX_CACHE_SALT_CHARS):
                body["cache_salt"] = tenant_cache_salt(tenant, own)
                raw = json.dumps(body, ensure_ascii=False).encode()
            # else: a salt the replica refuses, forwarded as it came so that the 4xx names it
        ids = self.prompt_ids(path, body)
        hasher = self.hasher()
        hashes = hasher.hashes(ids, request_cache_salt(body)) if hasher else []
        if self.front.kv_events_key is not None:    # compared with the replicas' keyed events
            hashes = keyed(self.front.kv_events_key, hashes)
        return body, ids, hashes, hasher.block_size if hasher else 16, raw

    # -- forwarding -------------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response | ClosingStream:
        t0 = time.perf_counter()
        raw = await read_body(request, self.front.max_request_bytes, self.front.body_timeout)
        loop = asyncio.get_running_loop()
        tenant = tenant_of(request.scope) if self.front.cache_salt_per_key else None
        body, ids, hashes, bs, raw = await loop.run_in_executor(self._prepare_pool, self.prepare, path, raw, tenant)
        prompt_blocks = -(-len(ids) // bs)
        steps, stream = decode_steps(body), isinstance(body, dict) and body.get("stream") is True
        n = body.get("n") if isinstance(body, dict) else None
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        tried: set[str] = set()
        while True:
            views = self.pool.views(hashes, tried)
            if not views:
                self.metrics.failed.inc()
                what = "every replica failed this request" if tried else "no replica is healthy"
                return _error(503, f"{what}; replicas: {sorted(self.pool.replicas)}", "no_replica")
            decision = self.policy.choose(views, prompt_blocks, steps or DEFAULT_STEPS)
            for name, cost in decision.costs.items():
                self.metrics.cost.labels(name).set(cost)
            replica = self.pool.replicas[decision.replica]
            chosen = next(v for v in views if v.name == decision.replica)
            self.metrics.decisions.labels(replica.url, self.policy.name).inc()
            self.metrics.prompt_blocks.inc(prompt_blocks)
            self.metrics.matched_blocks.inc(chosen.cached_blocks)
            # What the request adds to the replica's KV: its blocks the replica does not hold yet (a cached
            # prefix is shared, not copied).
            ticket = replica.opened(hashes, max(1, prompt_blocks - chosen.cached_blocks), prompt_blocks, steps,
                                    stream, choices=choices)
            try:
                return await self._send(request, replica, path, raw, ticket, t0)
            except _Retry as e:
                replica.closed(ticket)
                self.pool.mark_failed(replica, str(e))
                self.metrics.retries.labels(replica.url).inc()
                tried.add(replica.url)
                logger.warning("request re-routed: %s", e)

    async def _send(self, request: Request, replica: Replica, path: str, raw: bytes, ticket: int,
                    t0: float) -> Response | ClosingStream:
        t_sent = time.perf_counter()
        headers = {"content-type": "application/json", **self.replica_headers}
        upstream_req = self.client.build_request("POST", replica.url + path, content=raw, headers=headers,
                                                 timeout=httpx.Timeout(None, connect=5.0))
        try:
            upstream = await _unless_gone(request, replica, self.client.send(upstream_req, stream=True))
        except httpx.TransportError as e:
            raise _Retry(f"{replica.url}: {type(e).__name__}: {e}") from None
        if upstream is None:                     # the client left before the replica answered
            replica.closed(ticket)
            return Response(status_code=499)
        if upstream.status_code == 503:
            await upstream.aclose()
            raise _Retry(f"{replica.url} answered 503")
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        out_headers["x-namazu-replica"] = replica.url

        def timing() -> None:   # where the time to the first byte went, for bench/router_hops.py
            now = time.perf_counter()
            out_headers["server-timing"] = (f"route;dur={1000 * (t_sent - t0):.2f}, "
                                            f"upstream;dur={1000 * (now - t_sent):.2f}")
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await _unless_gone(request, replica, upstream.aread())
            except httpx.TransportError as e:
                await upstream.aclose()
                raise _Retry(f"{replica.url} dropped the request: {type(e).__name__}: {e}") from None
            await upstream.aclose()
            replica.closed(ticket, _completion_tokens(content or b""))
            if content is None:
                return Response(status_code=499)
            timing()
            return Response(content, status_code=upstream.status_code, headers=out_headers)
        chunks = upstream.aiter_raw()
        try:
            first = await _unless_gone(request, replica, chunks.__anext__())
        except (httpx.TransportError, StopAsyncIteration) as e:
            await upstream.aclose()
            raise _Retry(f"{replica.url} dropped the stream before its first byte: {type(e).__name__}") from None
        if first is None:
            await upstream.aclose()
            replica.closed(ticket)
            return Response(status_code=499)
        replica.first_token(ticket)
        timing()
        # Closed however the response ends (a client cut off by the write timeout included): closing the
        # relay closes the upstream stream, which aborts the request on the replica.
        return ClosingStream(StreamingResponse(self._relay(replica, ticket, upstream, first, chunks),
                                               status_code=upstream.status_code, headers=out_headers))

    async def _relay(self, replica: Replica, ticket: int, upstream: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        tail = first[-_TAIL:]
        try:
            yield first
            async for chunk in chunks:
                tail = (tail + chunk)[-_TAIL:]
                yield chunk
        except httpx.TransportError as e:
            self.pool.mark_failed(replica, f"stream broke: {type(e).__name__}: {e}")
            err = {"error": {"message": f"replica {replica.url} failed mid-stream ({type(e).__name__}); the "
                                        "tokens above are all there is", "type": "router_error",
                             "param": None, "code": "replica_failed"}}
            yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            # Also reached when the client disconnects (the response task is cancelled): closing the
            # upstream connection makes the replica abort the request and free its blocks.
            replica.closed(ticket, _completion_tokens(tail), streamed=True)
            await upstream.aclose()

    # -- app --------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "block_size": self.pool.block_size, "replicas": [
            {"url": r.url, "healthy": r.healthy, "routed": r.num_routed, "in_flight": r.in_flight,
             "indexed_blocks": len(r.index.hashes), "history_blocks": len(r.history),
             "replica_id": r.index.replica_id, "event_cursor": r.index.cursor, "resets": r.index.num_resets,
             "load": r.load, "last_error": r.last_error,
             "rates": dataclasses.asdict(r.rates.rates), "rate_samples": {
                 "first_tokens": r.rates.first_tokens, "decodes": r.rates.decodes}}
            for r in self.pool.replicas.values()]}

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response | ClosingStream:
            return await self.forward(request, "/v1/completions")

        async def chat(request: Request) -> Response | ClosingStream:
            return await self.forward(request, "/v1/chat/completions")

        async def models(request: Request) -> Response:
            for r in self.pool.healthy():
                with contextlib.suppress(httpx.HTTPError):
                    up = await self.client.get(r.url + "/v1/models", headers=self.replica_headers, timeout=5.0)
                    return Response(up.content, status_code=up.status_code,
                                    media_type=up.headers.get("content-type"))
            return _error(503, "no replica is healthy", "no_replica")

        async def health(request: Request) -> Response:
            n = len(self.pool.healthy())
            return JSONResponse({"status": "ok" if n else "no healthy replica", "healthy_replicas": n},
                                status_code=200 if n else 503)

        async def metrics(request: Request) -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        async def state(request: Request) -> Response:
            return JSONResponse(self.state())

        async def api_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, APIError)
            return exc.response()

        app = Starlette(routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/router/state", state, methods=["GET"]),
        ], exception_handlers={APIError: api_error})
        app.add_middleware(AuthMiddleware, api_key=self.front.api_key)
        app.add_middleware(BrowserGuardMiddleware, hosts=self.front.allowed_hosts)
        app.add_middleware(WriteTimeoutMiddleware, timeout=self.front.write_timeout)
        return app

    def close(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)


def _completion_tokens(tail: bytes) -> int | None:
    """completion_tokens of the last usage object in a response's tail (a streamed one has it only with
    stream_options.include_usage), or None."""
    found = _USAGE.findall(tail)
    return int(found[-1]) if found else None


async def _unless_gone(request: Request, replica: Replica, aw: Any) -> Any:
    """Awaits `aw`; returns None if the client disconnects first, raises _Retry if the replica is taken
    out first (it failed its health checks while this request waited for its first byte)."""
    task = asyncio.ensure_future(aw)
    client_gone = asyncio.ensure_future(_disconnected(request))
    replica_out = asyncio.ensure_future(replica.out.wait())
    try:
        done, _ = await asyncio.wait({task, client_gone, replica_out}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if client_gone in done:
            return None
        raise _Retry(f"{replica.url} was taken out ({replica.last_error}) before its first byte")
    finally:
        client_gone.cancel()
        replica_out.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
