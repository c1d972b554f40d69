"""The thread pool for a request's preparation: parsing a large body, rendering its chat template,
tokenizing its prompts.

Its own pool, not asyncio's default one (shared with anything calling `asyncio.to_thread`), and kept
apart from grammar compiles (`namazu/grammar_compiles.py`), which take seconds where preparing a
request takes milliseconds: a storm of schemas cannot hold up the tokenizing of a plain request. The
work per request is bounded before it starts: the body by --max-request-bytes, a prompt by the length
check that refuses a text too long for the context before tokenizing it (`Tokenizer.min_tokens`).
"""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = 4         # tokenizing releases the GIL: a few threads keep a long prompt from blocking the rest
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="namazu-prepare")
        return _pool


async def run_prepare(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool(), functools.partial(fn, *args))
