"""The thread pool for a request's preparation: parsing a large body, rendering its chat template,
tokenizing its prompts.

Its own pool, not asyncio's default one (shared with anything calling `asyncio.to_thread`), and kept
apart from grammar compiles (`namazu/engine/grammar_compiles.py`), which take seconds where preparing a
request takes milliseconds: a storm of schemas cannot hold up the tokenizing of a plain request. The
work per request is bounded before it starts: the body by --max-request-bytes, a prompt by the length
check that refuses a text too long for the context before tokenizing it (`Tokenizer.min_tokens`).
Requests whose body is large (over LARGE_BYTES) are prepared on a second pool of their own, so a few
multi-megabyte prompts (seconds of tokenizing each) never queue a small request behind them.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = 4         # tokenizing releases the GIL: a few threads keep a long prompt from blocking the rest
LARGE_THREADS = 2
LARGE_BYTES = 256 * 1024
# The size of the body of the request being served (set where the body is read; the pool follows it).
body_size: contextvars.ContextVar[int] = contextvars.ContextVar("namazu_body_size", default=0)
_pools: dict[bool, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(large: bool = False) -> ThreadPoolExecutor:
    with _lock:
        if large not in _pools:
            _pools[large] = ThreadPoolExecutor(LARGE_THREADS if large else THREADS,
                                               thread_name_prefix="namazu-prepare-large" if large else
                                               "namazu-prepare")
        return _pools[large]


async def run_prepare(fn: Callable[..., T], *args: Any, size: int | None = None) -> T:
    """`fn(*args)` on the pool for a request of `size` body bytes (default: the current request's)."""
    large = (body_size.get() if size is None else size) > LARGE_BYTES
    return await asyncio.get_running_loop().run_in_executor(pool(large), functools.partial(fn, *args))
