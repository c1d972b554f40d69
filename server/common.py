"""What both OpenAI endpoints share: server state, context-length checks, merging the output streams of
several prompts, SSE framing, usage, logprob token texts, and aborting on client disconnect."""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from namazu.sampling_params import SamplingParams
from server.errors import APIError, invalid
from server.front_door import tenant_cache_salt, tenant_of
from server.metrics import RequestTracker, ServerMetrics
from server.prepare_pool import run_prepare

if TYPE_CHECKING:
    from namazu.async_engine import AsyncEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


def salt_by_tenant(request: Request, state: ServerState, kwargs: dict[str, Any]) -> None:
    """Under --cache-salt-per-key, the request's prefix-cache salt is its API key's tenant id (and its own
    `cache_salt`, hashed, within that tenant), so no request can reach another key's cached blocks:
    a salt naming another tenant is hashed under the sender's own."""
    tenant = tenant_of(request.scope) if state.cache_salt_per_key else None
    if tenant is not None:
        kwargs["cache_salt"] = tenant_cache_salt(tenant, kwargs.get("cache_salt"))


@dataclass
class ServerState:
    """Everything a handler needs, stored on app.state."""

    engine: AsyncEngine
    served_model_name: str
    max_logprobs: int
    metrics: ServerMetrics
    max_request_bytes: int
    body_timeout: float = 30.0
    strict_fields: bool = False     # --strict-fields: an unrecognized request field is a 400, not ignored
    kv_events_key: bytes | None = None      # --kv-events-key: /kv/events publishes keyed hashes
    cache_salt_per_key: bool = False        # --cache-salt-per-key: each API key's prefix cache apart
    admin_key: str | None = None            # --admin-key: the operator routes (server/admin_routes.py)
    drafter_root: str | None = None         # --drafter-root: where POST /admin/drafter may load from
    in_flight: int = 0              # engine requests started and not yet finished
    peak_in_flight: int = 0

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model", code="model_not_found")

    def check_num_seqs(self, num_seqs: int, param: str) -> None:
        """Admission of a request creating `num_seqs` sequences: 400 if it never could be, 429 when the
        engine's queue is full, 503 when the engine is not serving."""
        try:
            self.engine.check_admission(num_seqs)
        except ValueError as e:
            raise invalid(str(e), param, code="too_many_sequences") from None

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        """The engine's own admission checks, run before any response byte is sent. Blocking: the
        endpoints call it off the event loop. The grammar is compiled after (`compile_grammar`)."""
        try:
            self.engine.validate_request(request_id, None, params, prompt_ids)
        except ValueError as e:
            raise invalid(str(e), param) from None

    async def compile_grammar(self, request: Request, params: SamplingParams,
                              constraint_param: str | None = None) -> None:
        """The request's grammar compiled before any response byte is sent (a bad schema, regex or
        grammar is a 400 naming the parameter), on the engine's grammar pool: identical grammars share
        one compile, too many at once is a 429, and a client that leaves stops waiting (ClientGone),
        dropping a compile nobody else waits for before it starts."""
        try:
            await until_disconnect(request, self.engine.compile_grammar_async(params))
        except ValueError as e:
            raise invalid(str(e), constraint_param or _grammar_param(params)) from None

    def stats(self) -> dict[str, Any]:
        """Engine statistics (every EngineStats field) plus the server's in-flight counts."""
        s = dataclasses.asdict(self.engine.get_stats())
        s.update(alive=self.engine.is_running, requests_in_flight=self.in_flight,
                 peak_requests_in_flight=self.peak_in_flight)
        return s


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Runs CPU work proportional to a request's size (tokenizing, rendering a chat template) on the
    prepare pool (`server/prepare_pool.py`), so the event loop keeps answering other clients (and
    /health) meanwhile."""
    return await run_prepare(fn, *args)


def check_fits(tokenizer: Any, text: str, max_model_len: int, what: str) -> None:
    """A 400 for a text that cannot fit the context whatever it tokenizes to, before it is tokenized:
    six over-long prompts, each tokenized in full only to be refused, held a plain request 13 s."""
    at_least = tokenizer.min_tokens(text)
    if at_least > max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                      f"is {len(text)} characters, at least {at_least} tokens. Please reduce the length of "
                      f"the {what}.", what, code="context_length_exceeded")


def _grammar_param(params: SamplingParams) -> str:
    if params.json_schema is not None or params.json_object:
        return "response_format"
    if params.tool_calls is not None:
        return "tools"
    return "regex" if params.regex is not None else "grammar"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def resolve_max_tokens(num_prompt: int, max_tokens: int | None, max_model_len: int,
                       param: str = "max_tokens", what: str = "prompt") -> int:
    """The generation budget, or a 400 that states the model's context limit (OpenAI's wording)."""
    if max_tokens is None:
        if num_prompt >= max_model_len:
            raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"{what} resulted in {num_prompt} tokens, which leaves no room for a completion. "
                          f"Please reduce the length of the {what}.", what, code="context_length_exceeded")
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                      f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} for the "
                      f"completion). Please reduce the length of the {what} or '{param}'.",
                      what if num_prompt >= max_model_len else param, code="context_length_exceeded")
    return max_tokens


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index. On exit (done,
    error or cancellation) every iterator still running is cancelled and closed."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    # Bounded: a consumer that stops reading stops the pumps, and each engine stream then keeps only its
    # newest (cumulative) output instead of this queue keeping every step's.
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:      # noqa: BLE001 -- re-raised in the consumer
            await queue.put((i, done, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client goes away first, cancels it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            gone = watcher.done()
            logger.info("client disconnected from %s; request aborted", request.url.path)
        watcher.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if gone and not (current is not None and current.cancelling()):
            raise ClientGone from None      # an expected end, not an error to log with a traceback
        raise


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready; nobody gets a response."""


def ignored_header(ignored: list[str] | None) -> dict[str, str]:
    """Unrecognized fields the server ignored (not --strict-fields), named for the client too."""
    return {"X-Ignored-Fields": ",".join(ignored)} if ignored else {}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def top_n(entry: dict[int, float] | None, n: int) -> list[tuple[int, float]]:
    """The n most likely (token, logprob) pairs of one position's logprob dict."""
    if not entry or n <= 0:
        return []
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


class TokenText:
    """Per-token strings and bytes for logprobs, plus character offsets into the concatenated text."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.tok.token_bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._cache) < 65536:
                self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class OffsetCounter:
    """Character offset of each token in a text decoded from its bytes (partial characters of a token
    count for the token where the character completes)."""

    def __init__(self, start: int = 0):
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pos = start

    def add(self, raw: bytes) -> int:
        at = self.pos
        self.pos += len(self.dec.decode(raw))
        return at


class GenerationJob:
    """One HTTP request's engine requests (one per prompt, each with n sequences): starts them, feeds
    the metrics tracker from their outputs, and aborts whatever has not finished when it ends (done,
    error or client disconnect)."""

    def __init__(self, state: ServerState, prompt_ids: list[list[int]], params: SamplingParams, rid: str,
                 tracker: RequestTracker, priority: int = 0):
        self.state, self.prompt_ids, self.params, self.priority = state, prompt_ids, params, priority
        self.rid, self.tracker = rid, tracker
        self.public_id = rid        # the response's id (vLLM's `request_id` sets it; engine ids stay unique)
        self.created = now()
        self.engine_ids = [f"{rid}-{i}" for i in range(len(prompt_ids))]
        self.finished_ids: set[str] = set()
        self.cached = [0] * len(prompt_ids)
        self.counted: dict[tuple[int, int], int] = {}      # (prompt, seq index) -> tokens seen
        self.done_keys: set[tuple[int, int]] = set()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    # The "object" of this endpoint's streamed chunks; subclasses have `req` (the parsed request).
    chunk_object = ""

    def _chunk(self, choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.public_id, "object": self.chunk_object, "created": self.created,
                             "model": self.state.served_model_name, "choices": choices}
        if self.req.sampling.include_usage:
            d["usage"] = use
        return d

    def _running_usage(self, completion_tokens: int) -> dict[str, Any] | None:
        """A streamed chunk's usage: the counts so far with `stream_options.continuous_usage_stats`
        (vLLM's), else null (only the last chunk has usage)."""
        if not self.req.sampling.continuous_usage:
            return None
        return usage(self.num_prompt_tokens, completion_tokens, sum(self.cached))

    def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, RequestOutput) as the engine produces them, observed for the metrics."""
        for p in self.prompt_ids:
            self.tracker.on_prompt(len(p))
        streams = [self.state.engine.generate(None, self.params, request_id=eid, prompt_token_ids=p,
                                              priority=self.priority, group=self.rid)
                   for p, eid in zip(self.prompt_ids, self.engine_ids)]
        return self._observed(merge(streams))

    async def _observed(self, it: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
        st = self.state
        st.in_flight += len(self.engine_ids)
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
        try:
            async with aclosing(it):
                async for i, out in it:
                    self._observe(i, out)
                    yield i, out
            self.tracker.done()
        finally:
            st.in_flight -= len(self.engine_ids)
            for eid in self.engine_ids:
                if eid not in self.finished_ids:
                    st.engine.abort(eid)
            for _ in range(len(self.engine_ids) * self.params.n - len(self.done_keys)):
                self.tracker.on_finish("abort")

    def _observe(self, i: int, out: Any) -> None:
        if out.finished:
            self.finished_ids.add(self.engine_ids[i])
            self.cached[i] = out.num_cached_tokens or 0
            self.tracker.on_cached(self.cached[i])
        for c in out.outputs:
            key = (i, c.index)
            self.tracker.on_tokens(key, len(c.token_ids) - self.counted.get(key, 0))
            self.counted[key] = len(c.token_ids)
            if c.finish_reason is not None and key not in self.done_keys:
                self.done_keys.add(key)
                self.tracker.on_finish(c.finish_reason)
