"""AsyncEngine: LLMEngine on a background thread, the server's view of it, and its supervisor.

Requests cross from the event loop to the engine thread through an inbox; outputs come back through
one slot per request. The server validates a request (`validate_request`) before it sends any
response byte, so a bad request never reaches the step loop.

What keeps one request (or one fault) from taking the server down:
- admission: at most `max_num_seqs + max_waiting_seqs` sequences are admitted at a time; past that
  `generate` raises EngineOverloadedError (the server answers 429 with Retry-After);
- fairness: admitted requests wait here, not in the engine's FIFO, and enter the engine round-robin
  over their `group` (one HTTP request), so a request of 256 sequences cannot hold back a small one
  until all of its own have run;
- bounded output buffers: outputs are cumulative, so a slot keeps only the newest; a client that stops
  reading costs one output, not one per step;
- a step that raises fails only the requests that were in it (RequestFailedError); the engine serves on;
- supervision: a dead worker process is noticed within a second even while idle; a hung one (alive but
  silent) when its heartbeat is older than HANG_SECONDS (8 s: /health turns 503 at once, and the
  watchdog kills it), when it does not answer a ping within `step_timeout` while idle, or when a step
  runs past `step_timeout`; a hung worker is killed; either way every request in flight fails with
  EngineUnavailableError (503), the engine is rebuilt (up to `max_worker_restarts` times), and when it
  cannot be, `failed` is set so the server exits non-zero for its supervisor to restart it;
- deadlines: with `request_timeout`, a request still running past it is aborted (RequestTimeoutError).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from namazu.config import ModelConfig
from namazu.distributed.health import HANG_SECONDS, stale_seconds
from namazu.engine.grammar_compiles import GrammarCompiles
from namazu.engine.llm_engine import EngineStats, LLMEngine
from namazu.engine_config import EngineConfig
from namazu.outputs import RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.spec.capture import CaptureWriter, record_from_output
from namazu.spec.proposer import Proposer
from namazu.structured.factory import needs_compiler
from namazu.tokenizer import Tokenizer
from namazu.worker.executor import WorkerError

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5       # how often an idle engine thread checks its workers are alive
_IDLE_PING_S = 2.0       # how often it asks them to answer (a hung worker is alive but silent)


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve now (worker died, restarting, shutting down): retry later (503)."""


class EngineOverloadedError(RuntimeError):
    """Too many sequences admitted: retry after `retry_after` seconds (429)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(RuntimeError):
    """The step this request was in raised; the engine goes on serving the others (500)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout and was aborted."""


@dataclass
class _Slot:
    """One request's newest output (outputs are cumulative, so older ones are never needed)."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    num_seqs: int
    latest: RequestOutput | None = None
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, out: RequestOutput | BaseException) -> None:
        """From the engine thread."""
        with self.lock:
            if isinstance(out, BaseException):
                self.error = self.error or out
            else:
                self.latest = out
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:        # the loop is closed: nobody is waiting any more
            pass

    def take(self) -> RequestOutput | BaseException | None:
        with self.lock:
            if self.error is not None:
                return self.error
            out, self.latest = self.latest, None
            return out


@dataclass
class _Pending:
    request_id: str
    prompt: str | None
    params: SamplingParams
    ids: list[int]
    priority: int
    group: str


class AsyncEngine:
    """LLMEngine on a background thread, for asyncio servers.

    `generate()` is an async iterator of cumulative RequestOutputs (the last one has finished=True);
    breaking out of it or cancelling the task aborts the request and frees its blocks. Requests are
    checked in the caller (a bad request raises ValueError there and never reaches the engine).
    """

    def __init__(self, config: EngineConfig | None = None, drafter: Proposer | None = None,
                 grammar_threads: int = 1, max_grammar_compiles: int = 8):
        self.engine = LLMEngine(config, drafter)
        # Grammar compiles on a pool of their own, deduplicated and bounded (namazu/engine/grammar_compiles.py).
        self.grammars = GrammarCompiles(self.compile_grammar, grammar_threads, max_grammar_compiles,
                                        overloaded=EngineOverloadedError)
        self._drafter = drafter
        cfg = self.engine.config
        self.capture = CaptureWriter(cfg.capture_dir, cfg.capture_shard_bytes) if cfg.capture_dir else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._slots: dict[str, _Slot] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._draining = False
        self._error: BaseException | None = None
        self._unavailable: str | None = None         # why requests are refused right now (restart)
        self._restarts = 0
        self._step_started: float | None = None
        self.failed = threading.Event()              # set when the engine gave up: exit non-zero
        self._ids = itertools.count()
        self._admitted = 0                           # sequences of live generate() calls (event loop)
        # Engine-thread state: requests admitted but not yet in the engine, by group, in arrival order.
        self._pending: OrderedDict[str, deque[_Pending]] = OrderedDict()
        self._pending_seqs = 0                       # sequences in _pending (read by get_stats from any thread)
        self._in_engine: dict[str, int] = {}         # request id -> sequences, for requests in the engine
        self._thread = threading.Thread(target=self._run, name="namazu-engine", daemon=True)
        self._thread.start()
        self._stop_watch = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="namazu-watchdog", daemon=True)
        self._watchdog.start()

    # Views the server needs.
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_path.name

    def get_stats(self) -> EngineStats:
        """The engine's statistics; `num_waiting` also counts the sequences admitted here but not yet
        handed to the engine (the queue a router or autoscaler must see)."""
        stats = self.engine.get_stats()
        stats.num_waiting += max(0, self._pending_seqs)
        return stats

    @property
    def num_admitted_seqs(self) -> int:
        """Sequences of requests admitted and not yet finished (running or waiting)."""
        return self._admitted

    @property
    def capacity(self) -> int:
        """Most sequences admitted at once: one step's worth plus the waiting allowance."""
        return self.config.max_num_seqs + self.config.max_waiting_seqs

    @property
    def replica_id(self) -> str:
        """Random per engine start: a router that sees it change knows this replica restarted."""
        return self.engine.kv_events.replica_id

    def kv_events(self, after: int, limit: int = 1024, replica_id: str | None = None) -> dict[str, Any]:
        """The prefix cache's KV events after id `after` (see namazu.scheduler.kv_events.KVEventLog.since),
        with the block size the hashes were computed at. Thread-safe: the log has its own lock."""
        out = self.engine.kv_events.since(after, limit, replica_id)
        out["block_size"] = self.engine.config.block_size
        return out

    def validate_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                         prompt_token_ids: list[int] | None = None) -> list[int]:
        """The engine's admission checks, without queueing anything: returns the prompt token ids or
        raises ValueError saying what is wrong. `generate` runs the same checks."""
        if request_id in self._slots:
            raise ValueError(f"request id {request_id!r} is already running")
        if params.n > self.config.max_seqs_per_request:
            raise ValueError(f"SamplingParams.n={params.n}: this server allows at most "
                             f"{self.config.max_seqs_per_request} sequences per request (--max-seqs-per-request)")
        return self.engine.validate_request(request_id, prompt, params, prompt_token_ids)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Checks and compiles a request's grammar (cached by its text); ValueError says what is wrong.
        Blocking: call it off the event loop (`generate` runs it on a worker thread, so a slow schema
        makes only its own request wait and never the step loop)."""
        self.engine.compile_grammar(params)

    async def compile_grammar_async(self, params: SamplingParams) -> None:
        """`compile_grammar` on the grammar pool: identical grammars compiled once, at most
        `max_grammar_compiles` distinct ones at a time (past that EngineOverloadedError), and a compile
        nobody waits for any more dropped before it starts."""
        if needs_compiler(params):
            await self.grammars.compile(params)

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine (a worker rank died or hung, a step failed); None while it runs."""
        return self._error

    @property
    def is_running(self) -> bool:
        """True while requests are accepted: not stopped, draining, restarting, failed, or with a worker
        whose heartbeat stopped."""
        return (not self._stopped and not self._draining and self._error is None
                and self._unavailable is None and self.heartbeat_age() <= HANG_SECONDS)

    def heartbeat_age(self) -> float:
        """Seconds since the least recent worker heartbeat (0.0 for workers in this process). A stopped or
        wedged worker stops beating; reading the shared timestamps never waits for the engine thread,
        which may be blocked on that very worker (an idle ping waits up to --step-timeout)."""
        beats = getattr(getattr(self.engine, "executor", None), "beats", None) or ()
        return max((stale_seconds(b) for b in beats if b.value), default=0.0)

    @property
    def status(self) -> str:
        """'ok', or why requests are not accepted now."""
        if self._error is not None:
            return f"engine failed: {self._error}"
        if self._stopped:
            return "shut down"
        if self._draining:
            return "shutting down"
        if self._unavailable is not None:
            return self._unavailable
        age = self.heartbeat_age()
        if age > HANG_SECONDS:
            return f"the model-runner worker is hung: no heartbeat for {age:.0f} s; restarting it"
        return "ok"

    def check_admission(self, num_seqs: int) -> None:
        """Raises EngineUnavailableError / EngineOverloadedError if `num_seqs` more sequences cannot be
        admitted now, ValueError if they never could be."""
        if not self.is_running:
            raise EngineUnavailableError(f"the engine is not accepting requests ({self.status})")
        if num_seqs > self.config.max_seqs_per_request:
            raise ValueError(f"the request creates {num_seqs} sequences (prompts x n); this server allows "
                             f"at most {self.config.max_seqs_per_request} (--max-seqs-per-request)")
        if num_seqs > self.capacity:
            raise ValueError(f"the request creates {num_seqs} sequences (prompts x n), more than this server "
                             f"ever admits at once ({self.capacity}: --max-num-seqs + --max-waiting-seqs)")
        if self._admitted + num_seqs > self.capacity:
            raise EngineOverloadedError(
                f"the server is at capacity ({self._admitted} sequences admitted, at most {self.capacity}: "
                f"--max-num-seqs + --max-waiting-seqs); retry later", retry_after=self._retry_after())

    def _retry_after(self) -> int:
        # A rough wait: the queue ahead drains in steps of max_num_seqs sequences, each a few seconds.
        return max(1, min(60, self._admitted // max(1, self.config.max_num_seqs)))

    async def generate(self, prompt: str | None, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                       priority: int = 0, group: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request. `group` names the client request it belongs to (the engine admits
        groups round-robin); by default each request is its own group."""
        params = sampling_params or SamplingParams()
        self.check_admission(params.n)
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.validate_request(request_id, prompt, params, prompt_token_ids)
        await self.compile_grammar_async(params)
        timeout = self.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = _Slot(asyncio.get_running_loop(), asyncio.Event(), params.n)
        self._slots[request_id] = slot
        self._admitted += params.n
        self._inbox.put(("add", _Pending(request_id, prompt, params, ids, priority, group or request_id)))
        self._wake.set()
        finished = False
        arrival, first_token = time.time(), None
        try:
            while True:
                if deadline is None:
                    await slot.event.wait()
                else:
                    try:
                        await asyncio.wait_for(slot.event.wait(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise RequestTimeoutError(f"the request did not finish within --request-timeout="
                                                  f"{timeout:g} s and was aborted") from None
                slot.event.clear()
                item = slot.take()
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if first_token is None and any(c.token_ids for c in item.outputs):
                    first_token = time.time()
                if finished and self.capture is not None:
                    self.capture.write(record_from_output(item, params, arrival, first_token, self.model_name))
                yield item
                if finished:
                    return
        finally:
            self._admitted -= params.n
            if not finished:
                self.abort(request_id)
            self._slots.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def set_drafter(self, path: str) -> dict[str, Any]:
        """Replaces the serving DFlash drafter at the next step boundary (`spec/drafter_swap.py`); returns
        {"drafter_id", "previous_drafter_id", "path"}. The directory is checked here, off the event loop and
        the step loop (DrafterCheckpointError naming the field or tensor, DrafterSwapError); one the ranks
        cannot load raises DrafterCheckpointError. Either way the old drafter serves on."""
        new = await asyncio.to_thread(self.engine.check_drafter, path)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("drafter", (new, done)))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def _swap_here(self, new: Proposer, done: concurrent.futures.Future) -> None:
        """On the engine thread, between steps; a failed load leaves the old drafter (and the requests) as
        they were. A worker that dies meanwhile fails the step loop as a step would."""
        previous = self.engine.drafter_id
        try:
            outputs = self.engine.swap_drafter(new)
        except ValueError as err:
            done.set_exception(err)
            return
        except BaseException as err:
            done.set_exception(RuntimeError(f"the drafter swap failed: {err}"))
            raise
        self._drafter = None             # a restart loads the new one (the engine's config names it)
        self._deliver_all(outputs)
        done.set_result({"drafter_id": new.drafter_id, "previous_drafter_id": previous, "path": new.path})

    def begin_drain(self) -> None:
        """Stops accepting requests (SIGTERM); those in flight go on."""
        self._draining = True

    def fail_all(self, error: BaseException) -> None:
        """Ends every request in flight with `error` (e.g. at the end of a graceful shutdown)."""
        for rid in list(self._slots):
            self.abort(rid)
            self._deliver(error, rid)

    # -- the engine thread --------------------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        slot = self._slots.get(request_id)
        if slot is not None:
            slot.put(out)

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._serve()
            except BaseException as err:      # noqa: BLE001 -- decided in _on_failure
                if not self._on_failure(err):
                    return

    def _serve(self) -> None:
        engine = self.engine
        last_ping = time.monotonic()
        while not self._stopped:
            self._take_inbox()
            self._admit()
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=_IDLE_POLL_S)
                self._wake.clear()
                cause = engine.worker_failure()
                if cause is not None:
                    raise _WorkerDied(cause)
                if time.monotonic() - last_ping > _IDLE_PING_S and not self._inbox.qsize():
                    if not engine.workers_respond(self.config.step_timeout):
                        engine.kill_workers()
                        raise _WorkerDied(f"the idle worker did not answer within --step-timeout="
                                          f"{self.config.step_timeout:g} s (hung); killed it")
                    last_ping = time.monotonic()
                continue
            if self.config.debug_step_delay:
                time.sleep(self.config.debug_step_delay)
                self._take_inbox()              # aborts that arrived meanwhile apply before the step
            self._step_started = time.monotonic()
            try:
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    engine.check_health()       # a dead worker makes /health fail even when idle
                    continue
                outputs = engine.step()
            finally:
                self._step_started = None
            self._deliver_all(outputs)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._in_engine.pop(out.request_id, None)
            self._deliver(out, out.request_id)

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._pending.setdefault(payload.group, deque()).append(payload)
                self._pending_seqs += payload.params.n
            elif kind == "drafter":
                self._swap_here(*payload)
            else:
                self._abort_here(payload)

    def _abort_here(self, rid: str) -> None:
        for group, reqs in list(self._pending.items()):
            for p in reqs:
                if p.request_id == rid:
                    reqs.remove(p)
                    self._pending_seqs -= p.params.n
                    if not reqs:
                        del self._pending[group]
                    return
        if self._in_engine.pop(rid, None) is not None:
            for out in self.engine.abort_request(rid):
                self._deliver(out, out.request_id)

    def _admit(self) -> None:
        """Moves pending requests into the engine while it has room for a step's worth of sequences,
        one per group in turn (lowest priority value first)."""
        limit = self.config.max_num_seqs
        while self._pending and (not self._in_engine or sum(self._in_engine.values()) < limit):
            best = min(self._pending, key=lambda g: self._pending[g][0].priority)   # first among equals
            reqs = self._pending[best]
            p = reqs.popleft()
            self._pending_seqs -= p.params.n
            del self._pending[best]
            if reqs:
                self._pending[best] = reqs          # to the back of the round
            try:
                self.engine.add_request(p.request_id, p.prompt, p.params, p.ids, p.priority)
            except ValueError as err:               # validated already; a race on the id lands here
                self._deliver(err, p.request_id)
                continue
            except Exception as err:                # noqa: BLE001 -- this request only; the engine goes on
                logger.exception("adding request %s failed", p.request_id)
                self.engine.abort_request(p.request_id)
                self._deliver(RequestFailedError(f"the engine could not queue this request "
                                                 f"({type(err).__name__}: {err})"), p.request_id)
                continue
            self._in_engine[p.request_id] = p.params.n

    def _on_failure(self, err: BaseException) -> bool:
        """Handles a failed step; returns whether the engine thread goes on."""
        if self._stopped:
            return False
        cause = err.cause if isinstance(err, _WorkerDied) else self.engine.worker_failure()
        if cause is None and isinstance(err, WorkerError):
            time.sleep(0.2)         # a worker that just closed its pipe may not be reaped yet
            cause = self.engine.worker_failure()
        if cause is None and not isinstance(err, Exception):
            cause = f"{type(err).__name__}: {err}"
        if cause is None:
            logger.exception("engine step failed; failing the requests in it", exc_info=err)
            try:
                failed = self.engine.fail_running_requests()
            except Exception as e2:             # noqa: BLE001 -- the engine state is unknown: rebuild it
                logger.exception("could not isolate the failed step; restarting the engine", exc_info=e2)
                return self._restart(f"engine step failed and could not be isolated: {err}")
            for rid in failed:
                self._in_engine.pop(rid, None)
                self._deliver(RequestFailedError(f"the engine step serving this request failed "
                                                 f"({type(err).__name__}: {err}); other requests are "
                                                 "unaffected"), rid)
            return True
        return self._restart(cause)

    def _restart(self, cause: str) -> bool:
        """Fails everything in flight, then rebuilds the engine (new workers) or gives up."""
        logger.error("engine unavailable: %s", cause)
        self._unavailable = f"restarting after a failure: {cause}"
        error = EngineUnavailableError(f"the engine failed while serving this request ({cause}); retry")
        self._pending.clear()
        self._pending_seqs = 0
        self._in_engine.clear()
        while True:                              # requests queued meanwhile fail the same way
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "drafter":
                payload[1].set_exception(EngineUnavailableError(f"the engine is restarting ({cause}); the "
                                                                "drafter was not replaced"))
        for rid in list(self._slots):
            self._deliver(error, rid)
        old = self.engine
        try:
            old.close()
        except Exception:                        # noqa: BLE001 -- its workers are gone anyway
            logger.warning("closing the failed engine raised", exc_info=True)
        # A lost tensor-parallel rank leaves its process group broken (on other nodes too): the whole
        # server restarts under its supervisor rather than rebuilding in place.
        tp = self.config.tensor_parallel_size > 1
        if tp or self._restarts >= self.config.max_worker_restarts:
            logger.error("%s; the server exits", "tensor-parallel rank lost" if tp else
                         f"giving up after {self._restarts} restart(s) (--max-worker-restarts)")
            self._error = RuntimeError(cause)
            self.failed.set()
            return False
        self._restarts += 1
        logger.warning("restarting the engine (%d of at most %d)", self._restarts, self.config.max_worker_restarts)
        try:
            self.engine = LLMEngine(old.config, self._drafter)
        except BaseException as e:              # noqa: BLE001 -- cannot serve: let a supervisor restart us
            logger.exception("the engine could not be restarted; the server exits")
            self._error = e
            self.failed.set()
            return False
        self._unavailable = None
        logger.warning("engine restarted; serving again")
        return True

    def _watch(self) -> None:
        """Kills the workers of a step running past --step-timeout, or whose heartbeat stopped (a hung
        worker); the step or idle ping waiting on them then fails as if the worker had died, and the
        engine restarts."""
        timeout = self.config.step_timeout
        while not self._stopped and not self.failed.is_set():
            if self._stop_watch.wait(min(1.0, timeout / 4)):
                return
            age = self.heartbeat_age()
            if age > HANG_SECONDS and self._unavailable is None:
                logger.error("the worker has not beaten for %.0f s (hung); killing it", age)
                self._unavailable = f"the model-runner worker was hung (no heartbeat for {age:.0f} s)"
                self.engine.kill_workers()
                continue
            started = self._step_started
            if started is not None and time.monotonic() - started > timeout:
                logger.error("a step has run for more than %g s (--step-timeout); killing its worker", timeout)
                self._unavailable = f"a step ran past --step-timeout={timeout:g} s"
                self.engine.kill_workers()
                while self._step_started == started:
                    time.sleep(0.05)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._stop_watch.set()
        self.grammars.shutdown()
        for thread in (self._thread, self._watchdog):
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout=30)
        self.engine.close()
        if self.capture is not None:
            self.capture.close()

    close = shutdown


class _WorkerDied(Exception):
    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause
