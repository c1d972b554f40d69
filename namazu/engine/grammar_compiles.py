"""Grammar compiles for the async front, on a bounded pool of their own.

A compile is CPU work proportional to a request's schema (a 1,000-property schema takes seconds) that
xgrammar runs with the GIL released. On asyncio's default pool, shared with tokenization and body
parsing, eight concurrent schemas took a plain request from 0.06 s to 30 s. Here:
- compiles run on `threads` threads of their own (default 1: on a small machine a storm of schemas
  keeps one core busy, never all of them), so requests without a grammar never queue behind one;
- identical grammars (the same compile key) share one compile, however many requests ask at once;
- the compile threads run at a lower CPU priority (nice + NICE, Linux sets it per thread), so on a
  machine with few cores the engine thread and the event loop get a core first when they need one;
- at most `max_pending` distinct compiles are queued or running; one more is refused at once
  (EngineOverloadedError: 429 with Retry-After) instead of queueing for minutes;
- a compile whose every requester left (client disconnect, timeout) is dropped if it has not started
  (a running one cannot be interrupted; it finishes and its result is cached for the next request).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from namazu.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
NICE = 10


def _lower_priority() -> None:
    """Runs in each compile thread as it starts: on Linux a thread's niceness is its own."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + NICE)
    except (AttributeError, OSError):       # not Linux, or not permitted: compiles run at normal priority
        pass


def compile_key(params: SamplingParams) -> str:
    """What makes two requests' grammars the same compile (the fields the structured backend reads)."""
    return json.dumps([params.json_schema, params.json_schema_strict, params.json_object, params.regex,
                       params.grammar, params.tool_calls], sort_keys=True, default=str)


class GrammarCompiles:
    def __init__(self, compile_fn: Callable[[SamplingParams], None], threads: int = 1, max_pending: int = 8,
                 overloaded: Callable[[str], BaseException] = RuntimeError):
        if threads < 1 or max_pending < 1:
            raise ValueError("want threads >= 1 and max_pending >= 1")
        self._fn = compile_fn
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="namazu-grammar",
                                                           initializer=_lower_priority)
        self.max_pending = max_pending
        self._overloaded = overloaded
        # key -> [the compile's future, its asyncio view, requests waiting]; touched on the event loop only.
        self._pending: dict[str, list[Any]] = {}
        self.num_compiles = self.num_shared = self.num_dropped = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def compile(self, params: SamplingParams) -> None:
        """Compiles `params`' grammar (or waits for the identical compile in progress); ValueError says
        what is wrong with it. Cancelling the caller stops waiting (and drops the compile if it was the
        last one waiting and it has not started)."""
        key = compile_key(params)
        entry = self._pending.get(key)
        if entry is None:
            if len(self._pending) >= self.max_pending:
                raise self._overloaded(f"{len(self._pending)} grammar compiles are in progress, the most this "
                                       "server runs at once; retry later")
            future = self._pool.submit(self._fn, params)
            waited = asyncio.wrap_future(future)
            waited.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved even if all left
            entry = self._pending[key] = [future, waited, 0]
            self.num_compiles += 1
            loop = asyncio.get_running_loop()
            future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._forget, key, f))
        else:
            self.num_shared += 1
        future, waited = entry[0], entry[1]
        entry[2] += 1
        try:
            # Shielded: one requester leaving must not cancel the compile the others wait for.
            await asyncio.shield(waited)
        finally:
            entry[2] -= 1
            if entry[2] == 0 and future.cancel():
                self.num_dropped += 1
                self._forget(key, future)
            elif future.done():
                # The slot is free once a waiter has the result, not only when the pool thread's callback
                # reaches the loop: a compile arriving in between must not be refused.
                self._forget(key, future)

    def _forget(self, key: str, future: concurrent.futures.Future) -> None:
        entry = self._pending.get(key)
        if entry is not None and entry[0] is future:
            del self._pending[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
