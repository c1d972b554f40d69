"""Connection-level time limits, so a slow or silent client cannot hold a connection (and the request it
carries) forever.

- headers: a connection must deliver each request's headers within `header_timeout` seconds of opening
  (or of the request's first byte); uvicorn itself only times out idle keep-alive connections, so a
  client that connects and says nothing, or sends one header byte a minute, was held indefinitely;
- body: the app reads each body under `body_timeout` (server.app._read_json);
- writes: a client that stops reading a stream blocks the server's writes once the socket buffer is
  full; after `write_timeout` seconds blocked, the response is abandoned, which closes the connection and
  aborts the request (its engine sequences and KV blocks are freed).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


def header_timeout_protocol(header_timeout: float) -> type:
    """uvicorn's httptools HTTP protocol with a deadline on receiving request headers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.info("closing a connection that sent no complete request headers in %g s", header_timeout)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


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
            # Returning without finishing the response makes uvicorn close the connection.
            logger.warning("%s: the client read nothing for %g s; response abandoned and request aborted",
                           scope.get("path"), self.timeout)
