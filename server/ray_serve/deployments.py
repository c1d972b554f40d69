"""The two deployments of namazu's Ray Serve application.

`NamazuEngine`: one namazu engine per replica, serving namazu's own OpenAI app in-process (so a request
through Ray gets the same validation, errors and streaming as a direct one). Its constructor loads the
weights and runs one warm-up request before returning: Ray Serve routes to a replica only after its
constructor returned, so a new replica gets traffic only once it is warm. It reports routing stats (a
snapshot of its KV events log, queue depth, active KV blocks) for `NamazuRequestRouter` and autoscaling
stats (queue depth, running sequences, KV usage) for `QueueAndKVPolicy`; on scale-down Ray Serve drains
its in-flight requests (graceful shutdown) before `__del__` stops the engine.

`NamazuIngress`: the HTTP entry. It tokenizes and hashes the prompt, forwards through the engine handle
(the custom request router picks the replica), and re-sends a request whose replica failed before the
first response byte.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import server.ray_serve.routing_state as decisions
from namazu.scheduler.kv_events import PromptHasher, request_cache_salt
from server.ray_serve.asgi_bridge import asgi_stream
from server.router.load_model import decode_steps

logger = logging.getLogger("namazu.ray_serve")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_ATTEMPTS = 3


class NamazuEngine:
    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str | None = None,
                 api_key: str | None = None):
        from namazu.async_engine import AsyncEngine
        from namazu.engine_config import EngineConfig
        from server.app import build_app

        self.engine = AsyncEngine(EngineConfig(**engine_kwargs))
        self.app = build_app(self.engine, served_model_name=served_model_name, api_key=api_key)
        self.api_key = api_key
        self._warm_up()
        self.warm_at = time.time()      # wall clock: the ingress compares it with its first routing here
        logger.info("namazu replica %s warm", self.engine.replica_id)

    def _warm_up(self) -> None:
        """One short request end to end, on a private event loop (the constructor is synchronous)."""
        from namazu.sampling_params import SamplingParams

        async def once() -> None:
            async for _ in self.engine.generate("warm up", SamplingParams(max_tokens=2, temperature=0),
                                                request_id=f"warmup-{self.engine.replica_id}"):
                pass

        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: _run_catching(once, errors), name="namazu-warmup")
        t.start()
        t.join()
        if errors:
            raise RuntimeError(f"namazu replica failed its warm-up request: {errors[0]}") from errors[0]

    async def handle(self, method: str, path: str, body: bytes, query: str = "",
                     route_info: dict[str, Any] | None = None) -> Any:
        """Streams namazu's response: a {"status", "headers"} dict, then body chunks. `route_info` is read
        by the request router in the caller's process, not here."""
        t0 = time.perf_counter()
        headers = [("content-type", "application/json")]
        if self.api_key:
            headers.append(("authorization", f"Bearer {self.api_key}"))
        async for item in asgi_stream(self.app, method, path, body, query, headers):
            if isinstance(item, dict):
                # Time in the replica up to its response head (a whole non-streamed answer), for the
                # per-hop accounting of bench/router_hops.py.
                item["headers"] += [["x-namazu-replica", self.engine.replica_id],
                                    ["server-timing", f"engine;dur={1000 * (time.perf_counter() - t0):.2f}"]]
            yield item

    def record_routing_stats(self) -> dict[str, Any]:
        log = self.engine.engine.kv_events
        stats = self.engine.get_stats()
        return {"replica_id": log.replica_id, "last_id": log.last_id, "hashes": sorted(log.stored_hashes()),
                "pid": os.getpid(), "warm_at": self.warm_at, "max_num_seqs": self.engine.config.max_num_seqs,
                "num_waiting": stats.num_waiting, "num_running": stats.num_running,
                "active_kv_blocks": round(stats.kv_cache_usage * stats.num_kv_blocks),
                "ms_per_decode_step": stats.ms_per_decode_step, "ms_per_prefill_block": stats.ms_per_prefill_block}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        from server.ray_serve.autoscaling import KV, QUEUE, RUNNING

        stats = self.engine.get_stats()
        return {QUEUE: float(stats.num_waiting), RUNNING: float(stats.num_running), KV: stats.kv_cache_usage}

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the namazu engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _run_catching(fn: Any, errors: list[BaseException]) -> None:
    try:
        asyncio.run(fn())
    except BaseException as e:
        errors.append(e)


class NamazuIngress:
    def __init__(self, engine: Any, tokenizer: str | None, block_size: int):
        self.engine = engine
        self.hasher = PromptHasher.from_pretrained(tokenizer, block_size)

    def _route_info(self, path: str, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
            if path.endswith("/chat/completions"):
                ids = self.hasher.chat_ids(body["messages"], body.get("tools"))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                ids = self.hasher.text_ids(prompt) if isinstance(prompt, str) else list(prompt or [])
        except Exception:          # malformed: the replica answers with its own 400
            ids, body = [], None
        return {"hashes": self.hasher.hashes(ids, request_cache_salt(body)),
                "prompt_blocks": -(-len(ids) // self.hasher.block_size),
                "max_tokens": decode_steps(body)}

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return Response(decisions.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
        if path == "/router/state" and request.method == "GET":
            return JSONResponse(decisions.snapshot())
        t0 = time.perf_counter()
        raw = await request.body()
        info = self._route_info(path, raw) if request.method == "POST" and path in GENERATION_PATHS else {}
        t_routed = time.perf_counter()
        last_error: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            t_sent = time.perf_counter()
            stream = self.engine.options(stream=True).handle.remote(
                request.method, path, raw, request.url.query, info)
            # Nothing reaches the client before the first body bytes (a stream's head comes before its
            # first token), so until then a failed replica is retried on another.
            head: dict[str, Any] | None = None
            try:
                head = await stream.__anext__()
                first = await stream.__anext__()
            except StopAsyncIteration:
                if head is None:
                    return JSONResponse({"error": {"message": "the replica sent no response"}}, status_code=502)
                first = b""              # a response without a body
            except Exception as e:                 # replica died or was stopped: try another
                last_error = e
                stream.cancel()
                logger.warning("request to a namazu replica failed before its first byte; retrying: %s", e)
                continue
            headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "server-timing")}
            now = time.perf_counter()
            headers["server-timing"] = ", ".join(
                [v for k, v in head["headers"] if k.lower() == "server-timing"]
                + [f"hash;dur={1000 * (t_routed - t0):.2f}", f"handle;dur={1000 * (now - t_sent):.2f}",
                   f"ingress;dur={1000 * (now - t0):.2f}"])
            sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])
            return StreamingResponse(_relay(stream, first, sse), status_code=head["status"], headers=headers)
        return JSONResponse({"error": {"message": f"no replica could serve the request: {last_error}",
                                       "type": "router_error", "code": "no_replica"}}, status_code=503)


async def _relay(stream: Any, first: bytes, sse: bool) -> Any:
    try:
        yield first
        async for chunk in stream:
            yield chunk
    except Exception as e:   # the replica died mid-stream: the client has tokens, so end it in band
        if not sse:
            raise
        logger.warning("a namazu replica failed mid-stream: %s", e)
        err = {"error": {"message": f"the replica failed mid-stream ({type(e).__name__}); the tokens above are "
                                    "all there is", "type": "router_error", "param": None, "code": "replica_failed"}}
        yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        stream.cancel()      # a client that left cancels the replica's generator, which aborts the request
