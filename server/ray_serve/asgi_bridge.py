"""One HTTP request through an in-process ASGI app, its response streamed back message by message.

The engine replica runs namazu's own OpenAI app (server/app.py) this way, so a request served through
Ray Serve gets exactly the validation, errors, streaming and usage a direct request gets. Closing the
iterator early (the caller went away) delivers `http.disconnect`, which makes the app abort the request.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


async def asgi_stream(app: Any, method: str, path: str, body: bytes = b"", query: str = "",
                      headers: list[tuple[str, str]] | None = None) -> AsyncIterator[Any]:
    """Yields {"status": int, "headers": [[name, value], ...]} first, then the body as bytes chunks."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers or []]}

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message["headers"]]}
            elif message["type"] == "http.response.body":
                # Body messages already waiting go out as one chunk: each chunk costs a Ray object and two
                # actor hops on its way to the client, so a stream that produced tokens faster than they
                # crossed should not pay that per token. Nothing waits for more to arrive.
                body, more = message.get("body", b""), message.get("more_body", False)
                while more and not messages.empty():
                    nxt = messages.get_nowait()
                    if nxt is None or nxt["type"] != "http.response.body":
                        messages.put_nowait(nxt)  # only the app's end (None) can follow its last body message
                        break
                    body, more = body + nxt.get("body", b""), nxt.get("more_body", False)
                if body:
                    yield body
                if not more:
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=10)
