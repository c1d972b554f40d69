"""Connection-level time limits, so a slow or silent client cannot hold a connection (and the request it
carries) forever.

- headers, body and the number of connections: `guarded_protocol` below;
- body: the app also reads each body under `body_timeout` (server.front_door.read_json, a 408);
- writes: a client that stops reading a stream blocks the server's writes once the socket buffer is
  full; after `write_timeout` seconds blocked, the response is abandoned, which closes the connection and
  aborts the request (its engine sequences and KV blocks are freed).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


_REFUSAL_BODY = (b'{"error": {"message": "the server has reached its connection limit (--max-connections); '
                 b'retry later", "type": "server_error", "param": null, "code": "too_many_connections"}}')
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n"
            + _REFUSAL_BODY)
ABORT_EXTENSION = "namazu.abort_connection"   # scope["extensions"] key: drops the connection at once


class _ConnectionGuards:
    """The limits of `guarded_protocol`, mixed in before uvicorn's protocol (methods call on to it)."""

    header_timeout: float = 30.0
    body_deadline: float | None = None
    body_timeout: float | None = None
    max_connections: int | None = None
    _timer: asyncio.TimerHandle | None = None
    _refused = False

    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._too_slow, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self, why: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            logger.info("closing a connection that %s", why)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True      # the app sees the client gone, not a broken pipe
            self.transport.close()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        if self.max_connections is not None and len(self.connections) >= self.max_connections:
            self._refused = True
            logger.warning("refusing a connection: %d open (--max-connections)", len(self.connections))
            transport.write(_REFUSAL)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.header_timeout, f"sent no complete request headers in {self.header_timeout:g} s")

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {ABORT_EXTENSION: self._abort}
        self._arm(self.header_timeout, f"sent no complete request headers in {self.header_timeout:g} s")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.body_deadline is not None:
            self._arm(self.body_deadline, f"did not send its request body within {self.body_timeout:g} s "
                                     "(--body-timeout)")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _abort(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(header_timeout: float, body_timeout: float | None = None,
                     max_connections: int | None = None) -> type:
    """uvicorn's httptools HTTP protocol with connection-level limits a slow or hostile client cannot
    stretch:

    - headers: each request's headers must be complete within `header_timeout` seconds of the
      connection opening (or of the request's first byte); uvicorn itself only times out idle
      keep-alive connections, so a client that sends one header byte a minute was held indefinitely;
    - body: each request's body must be complete within `body_timeout` seconds (plus a second, so the
      app's own 408 goes first when it is reading) of its headers, whether or not the app reads it: a
      client that got its 401 and then sent one body byte every few seconds kept its connection open
      for ever (each byte cancelled uvicorn's keep-alive timer, and the app had stopped reading);
    - connections: past `max_connections` open connections a new one gets a 503 JSON answer and is
      closed at once, before the server reads anything from it (the file descriptors the server needs
      for its own work, and /health, stay available).
    Each request's scope also gets an `extensions[ABORT_EXTENSION]` callable that drops its connection
    (the write timeout uses it to cut off a client that stopped reading)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return type("GuardedProtocol", (_ConnectionGuards, HttpToolsProtocol), {
        "header_timeout": header_timeout, "body_timeout": body_timeout, "max_connections": max_connections,
        # plus a second, so the app's own 408 goes first when it is reading
        "body_deadline": None if body_timeout is None else body_timeout + 1.0})


class _ClientStalled(Exception):
    pass


class WriteTimeoutMiddleware:
    """Abandons a response whose client has not accepted a write for `timeout` seconds."""

    def __init__(self, app: ASGIApp, timeout: float):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await self.app(scope, receive, timed_send)
        except _ClientStalled:
            # The connection is dropped (under uvicorn's plain protocol, returning without finishing the
            # response closes it); the response's body generator was closed on the way out, which aborted
            # its engine requests (ClosingStream).
            abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
            if abort is not None:
                abort()
            logger.warning("%s: the client read nothing for %g s; response abandoned and request aborted",
                           scope.get("path"), self.timeout)


class ClosingStream:
    """A streamed response whose body generator is closed however the response ends. Starlette leaves
    it suspended when a send fails (a client cut off by --write-timeout): its `finally`, which aborts the
    engine requests and lowers the in-flight gauge, would then wait for garbage collection."""

    def __init__(self, response: StreamingResponse):
        self.response = response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.response.body_iterator
        if hasattr(body, "aclose"):
            async with aclosing(body):
                await self.response(scope, receive, send)
        else:
            await self.response(scope, receive, send)
