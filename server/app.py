"""The OpenAI-compatible ASGI app (starlette): routes, API-key check, body limit, errors, metrics.

Handlers only parse, tokenize and await the engine's output streams; the engine steps in its own
thread and worker process, so nothing here can hold up a step.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from namazu.async_engine import AsyncEngine

from server.admin_routes import ADMIN_PATHS, check_admin_args, get_drafter, set_drafter
from server.common import ClientGone, ServerState, now
from server.errors import ENGINE_ERRORS, APIError, as_api_error, http_error
from server.front_door import AuthMiddleware, BrowserGuardMiddleware, parse_api_keys, read_json
from server.metrics import ServerMetrics
from server.openapi import build_openapi
from server.replica_routes import kv_events, load
from server.serving_chat import create_chat_completion
from server.serving_completions import create_completion
from server.serving_responses import create_response, get_response
from server.timeouts import ClosingStream, WriteTimeoutMiddleware
from server.tokenizer_routes import detokenize, tokenize, tokenizer_info, version

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
CLIENT_CLOSED = 499         # nginx's status for a request whose client went away (counted in /metrics)


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = 30.0,
              write_timeout: float = 30.0, strict_fields: bool = False, allowed_hosts: Iterable[str] | None = None,
              kv_events_key: bytes | None = None, cache_salt_per_key: bool = False, admin_key: str | None = None,
              drafter_root: str | None = None) -> Starlette:
    """The app around a started engine. `api_key` None: no authentication (an empty key is refused:
    it would look like authentication while letting anyone in); several keys, comma-separated, are
    several tenants, and `cache_salt_per_key` keeps their prefix caches apart. `allowed_hosts`: the names
    a request's Host header may carry (None: any; see server.front_door.allowed_hosts). `admin_key`: adds
    the operator routes (server/admin_routes.py), which take drafters from under `drafter_root` only."""
    keys = parse_api_keys(api_key)
    if cache_salt_per_key and keys is None:
        raise ValueError("--cache-salt-per-key needs --api-key: without keys every client is one tenant")
    check_admin_args(admin_key, drafter_root, keys)
    state = ServerState(engine=engine, served_model_name=served_model_name or engine.model_name,
                        max_logprobs=engine.config.max_logprobs, metrics=None,  # type: ignore[arg-type]
                        max_request_bytes=max_request_bytes, body_timeout=body_timeout,
                        strict_fields=strict_fields, kv_events_key=kv_events_key,
                        cache_salt_per_key=cache_salt_per_key, admin_key=admin_key, drafter_root=drafter_root)
    metrics = state.metrics = ServerMetrics(state.stats, model_name=state.served_model_name)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/openapi.json", openapi_document, methods=["GET"]),
        Route("/kv/events", kv_events, methods=["GET"]),   # the KV-aware router's feed (server/router/)
        Route("/load", load, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", _generation(create_completion), methods=["POST"]),
        Route("/v1/chat/completions", _generation(create_chat_completion), methods=["POST"]),
        Route("/v1/responses", _generation(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/tokenize", _generation(tokenize), methods=["POST"]),
        Route("/detokenize", _generation(detokenize), methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    if admin_key is not None:
        routes += [Route("/admin/drafter", set_drafter, methods=["POST"]),
                   Route("/admin/drafter", get_drafter, methods=["GET"])]
    handlers: dict[Any, Any] = {APIError: _api_error, HTTPException: _http_exception, Exception: _internal_error}
    handlers.update({cls: _engine_error for cls in ENGINE_ERRORS})
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.server = state
    app.state.openapi = build_openapi(state.vocab_size, state.max_logprobs, auth=api_key is not None,
                                      strict=strict_fields, admin=admin_key is not None)
    app.add_middleware(AuthMiddleware, api_key=api_key, exempt=ADMIN_PATHS if admin_key is not None else ())
    app.add_middleware(BrowserGuardMiddleware, hosts=allowed_hosts)
    app.add_middleware(_StatusCounter, metrics=metrics, paths={r.path for r in routes})
    app.add_middleware(WriteTimeoutMiddleware, timeout=write_timeout)
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.server


# -- handlers ---------------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    engine = _state(request).engine
    if not engine.is_running:
        return JSONResponse({"status": engine.status}, status_code=503)
    return JSONResponse({"status": "ok"})


async def openapi_document(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def prometheus(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.served_model_name, "object": "model", "created": now(), "owned_by": "namazu",
            "max_model_len": state.engine.max_model_len}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))


def _generation(handler: Any) -> Any:
    async def endpoint(request: Request) -> Response | ClosingStream:
        state = _state(request)
        body = await read_json(request, state.max_request_bytes, state.body_timeout)
        try:
            response = await handler(request, state, body, state.metrics.tracker())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)     # not sent: the connection is gone
        return ClosingStream(response) if isinstance(response, StreamingResponse) else response
    return endpoint


# -- errors -----------------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        logger.error("%s %s: %s", request.method, request.url.path, exc.message)
    return exc.response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path}; see /v1/models, "
                             "/v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /health, /metrics, "
                             "/openapi.json",
                        code="not_found").response()
    return http_error(exc.status_code, exc.detail).response()


async def _engine_error(request: Request, exc: Exception) -> Response:
    err = as_api_error(exc)
    logger.warning("%s %s: %d %s", request.method, request.url.path, err.status, err.message)
    return err.response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return as_api_error(exc).response()


# -- middleware -------------------------------------------------------------------------------------------
class _StatusCounter:
    """Counts responses by route and status code (unknown paths are one label, 'other')."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.paths else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                 else "/v1/responses/{response_id}"
                                                 if path.startswith("/v1/responses/") else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
