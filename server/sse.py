"""Server-sent events: how a streamed response's chunks (chat and completions: plain `data:` events; the
Responses API: named events), its end and an in-band error are written.

Once a stream's status line is sent, an error can only travel in the stream: as an OpenAI error object in
a `data:` event, followed by the `[DONE]` sentinel like any other end.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from server.errors import ENGINE_ERRORS, APIError, as_api_error

logger = logging.getLogger(__name__)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_event(kind: str, obj: Any) -> bytes:
    """A named event (`event:` line, then its data), as the Responses API streams them."""
    return f"event: {kind}\n".encode() + sse(obj)


def sse_error(err: APIError) -> bytes:
    """Errors after the stream started go in-band (the status line is already sent)."""
    return sse(err.body())


def stream_error(rid: str, e: BaseException) -> APIError:
    """The in-band error event for a stream that failed after its status line was sent."""
    err = as_api_error(e)
    if not isinstance(e, (APIError, *ENGINE_ERRORS)):
        logger.error("request %s failed mid-stream", rid, exc_info=e)
    return err
