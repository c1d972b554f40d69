"""AsyncEngine: LLMEngine on a background thread, the server's view of it.

Requests cross from the event loop to the engine thread through an inbox; outputs come back through
one asyncio queue per request. The server validates a request (`validate_request`) before it sends
any response byte, so a bad request never reaches the step loop.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from namazu.config import ModelConfig
from namazu.engine import EngineStats, LLMEngine
from namazu.engine_config import EngineConfig
from namazu.outputs import RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.spec.capture import CaptureWriter, record_from_output
from namazu.spec.proposer import Proposer
from namazu.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class AsyncEngine:
    """LLMEngine on a background thread, for asyncio servers.

    `generate()` is an async iterator of cumulative RequestOutputs (the last one has finished=True);
    breaking out of it or cancelling the task aborts the request and frees its blocks. Requests are
    checked in the caller (a bad request raises ValueError there and never reaches the engine).
    """

    def __init__(self, config: EngineConfig | None = None, drafter: Proposer | None = None):
        self.engine = LLMEngine(config, drafter)
        cfg = self.engine.config
        self.capture = CaptureWriter(cfg.capture_dir, cfg.capture_shard_bytes) if cfg.capture_dir else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="namazu-engine", daemon=True)
        self._thread.start()

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
        return self.engine.get_stats()

    def validate_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                         prompt_token_ids: list[int] | None = None) -> list[int]:
        """The engine's admission checks, without queueing anything: returns the prompt token ids or
        raises ValueError saying what is wrong. `generate` runs the same checks."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        return self.engine.validate_request(request_id, prompt, params, prompt_token_ids)

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._error is None

    async def generate(self, prompt: str | None, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise RuntimeError(f"the engine is not running ({self._error or 'shut down'})")
        params = sampling_params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.validate_request(request_id, prompt, params, prompt_token_ids)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", (request_id, prompt, params, ids, priority)))
        self._wake.set()
        finished = False
        arrival, first_token = time.time(), None
        try:
            while True:
                item = await stream.get()
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
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, out)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    rid, prompt, params, ids, priority = payload
                    try:
                        engine.add_request(rid, prompt, params, ids, priority)
                    except Exception as err:   # validated already; a race on the id lands here
                        self._deliver(err, rid)
                else:
                    for out in engine.abort_request(payload):
                        self._deliver(out, out.request_id)
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as err:
                logger.exception("engine step failed; failing every running request")
                self._error = err
                for rid in list(self._streams):
                    self._deliver(RuntimeError(f"engine failure: {err}"), rid)
                return
            for out in outputs:
                self._deliver(out, out.request_id)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self.engine.close()
        if self.capture is not None:
            self.capture.close()

    close = shutdown
