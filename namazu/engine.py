"""LLMEngine (add_request / step / abort) and AsyncEngine, the server's view of it.

A step: the drafter proposes (if speculation is on), the scheduler plans, the batch goes to the
workers, and the results are folded back into the sequences: tokens appended, stop conditions checked
token by token (a verify step may bring several), KV blocks committed to the prefix cache or rolled back.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from namazu.assets import resolve_model_path
from namazu.config import ModelConfig
from namazu.detokenizer import IncrementalDetokenizer
from namazu.engine_config import EngineConfig
from namazu.outputs import CompletionOutput, RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.scheduler import ScheduledSeq, Scheduler
from namazu.scheduler.sequence import Sequence, SequenceStatus
from namazu.spec.drafters import Drafter, NgramDrafter
from namazu.step_io import StepResult, build_step_batch
from namazu.tokenizer import Tokenizer
from namazu.worker import make_executor

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    stream: bool = True              # an output every step, or only the final one
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class _Launched:
    """A step submitted to the workers, waiting for its results."""

    scheduled: list[ScheduledSeq]
    samplers: list[ScheduledSeq]
    prompt_lp_items: list[tuple[ScheduledSeq, int]]
    num_prompt_logprobs: int


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float          # fraction of KV blocks referenced by live sequences
    prefix_cache_hit_rate: float   # prompt tokens served from the prefix cache / prompt tokens admitted
    num_kv_blocks: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, drafter: Drafter | None = None):
        self.config = config = config or EngineConfig()
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_path)
        if drafter is None and config.speculative_method == "ngram":
            drafter = NgramDrafter(config.ngram_max, config.ngram_min)
        self.drafter = drafter
        self.num_speculative_tokens = config.num_speculative_tokens if drafter is not None else 0
        if drafter is not None and self.num_speculative_tokens == 0:
            raise ValueError("a drafter was given but --num-speculative-tokens is 0")
        self.executor = make_executor(config, self.model_path)
        try:
            self._plan_capacity()
        except BaseException:
            self.close()
            raise
        self.block_manager = BlockManager(self.worker_info.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill, config.scheduling_policy)
        self.vocab_size = self.model_config.vocab_size
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids))
        self.requests: dict[str, RequestState] = {}
        # Async scheduling needs every step's outcome known in advance; a verify step's is not.
        self.async_scheduling = config.async_scheduling and self.drafter is None
        if config.async_scheduling and self.drafter is not None:
            logger.warning("--async-scheduling is off: speculative decoding needs each step's acceptance first")
        self._in_flight: _Launched | None = None
        self._seq_ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._num_steps = self._prompt_tokens = self._generated = self._drafted = self._accepted = 0
        info = self.worker_info
        logger.info("engine ready: %s, %d KV blocks x %d, max_model_len %d, device %s, dtype %s",
                    self.model_path, info.num_kv_blocks, config.block_size, self.max_model_len, info.device,
                    info.dtype)

    def _plan_capacity(self) -> None:
        """max_model_len from the flag or the model, checked against what the KV cache holds: a lone
        sequence at max_model_len (plus a verify step's drafts) must fit the pool, or preemption could
        loop forever."""
        config, info = self.config, self.executor.info()
        self.worker_info = info
        bs, spec = config.block_size, self.num_speculative_tokens
        capacity = info.num_kv_blocks * bs
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(max_pos, capacity - spec)
        if self.max_model_len > max_pos:
            raise ValueError(f"--max-model-len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{max_pos}")
        if self.max_model_len < 2 or self.max_model_len + spec > capacity:
            raise ValueError(
                f"the KV cache holds {info.num_kv_blocks} blocks x {bs} = {capacity} tokens, fewer than one "
                f"sequence of --max-model-len={self.max_model_len}" + (f" + {spec} draft tokens" if spec else "")
                + "; raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len")

    # -- requests -------------------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                         prompt_token_ids: list[int] | None) -> list[int]:
        """Checks a request without changing any state; returns its prompt token ids."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model serves at most "
                             f"{self.max_model_len} tokens (prompt + output), so at most "
                             f"{self.max_model_len - 1} prompt tokens")
        params.check_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ValueError(f"{name}={v} exceeds --max-logprobs={self.config.max_logprobs}")
        return prompt_token_ids

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0, stream: bool = True) -> None:
        """Queues a request. With stream=False, `step()` returns its output only once it finished
        (offline generation skips building a snapshot per step)."""
        params = params or SamplingParams()
        ids = self.validate_request(request_id, prompt, params, prompt_token_ids)
        seqs = []
        for i in range(params.n):
            seed = int(self._rng.integers(0, 2**62)) if params.seed is None else params.seed + 1_000_003 * i
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), params, seed, priority=priority)
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            seqs.append(seq)
        self.requests[request_id] = RequestState(request_id, prompt, ids, params, seqs, stream)
        for seq in seqs:
            self.scheduler.add(seq)
        self._prompt_tokens += len(ids)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Stops requests wherever they are (waiting, mid-prefill, decoding); frees all their blocks.
        Returns their final outputs (finish_reason "abort"); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        outs = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    seq.detok.finish()
            outs.append(self._output(req))
            logger.info("request %s aborted", rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of every request that got new tokens or finished.

        With async scheduling the step launched here is collected by the next call: this call plans
        and launches step N+1, then collects step N, so planning overlaps the forward."""
        launched = self._launch()
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, launched
            return self._collect(previous) if previous is not None else []
        return self._collect(launched) if launched is not None else []

    def _launch(self) -> _Launched | None:
        if not self.scheduler.has_unfinished:
            return None
        drafts = None
        if self.drafter is not None:
            ready = [s for s in self.scheduler.running if s.num_computed_tokens == s.num_tokens - 1]
            drafts = self.drafter.propose(ready, self.num_speculative_tokens) if ready else None
        plan = self.scheduler.schedule(drafts)
        if plan.is_empty:
            return None
        prev_rows = {}
        if self._in_flight is not None:
            prev_rows = {item.seq.seq_id: s for s, item in enumerate(self._in_flight.samplers)}
        batch, samplers, prompt_lp_items = build_step_batch(plan.scheduled, self.config.block_size,
                                                            self.vocab_size, self.stop_ids, prev_rows)
        self.executor.submit(batch)
        for item in plan.scheduled:
            self.scheduler.submitted(item)
        self._num_steps += 1
        return _Launched(plan.scheduled, samplers, prompt_lp_items, batch.num_prompt_logprobs)

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        result = self.executor.collect()
        touched: dict[str, RequestState] = {}
        self._take_prompt_logprobs(result, launched.num_prompt_logprobs, launched.prompt_lp_items)
        row_of = {id(item): s for s, item in enumerate(launched.samplers)}
        now = time.monotonic()
        for item in launched.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue        # aborted, or stopped by a token the host learned after this step launched
            running = seq.status is SequenceStatus.RUNNING   # not preempted meanwhile
            if not item.samples:
                if running:
                    self.scheduler.commit(seq, seq.num_computed_tokens)
                continue
            s = row_of[id(item)]
            accepted = result.accepted[s]
            self._drafted += len(item.draft_token_ids)
            self._accepted += accepted
            if not item.draft_token_ids:
                seq.num_pending -= 1
            reason = self._append(seq, s, accepted + 1, result)
            if running:
                # KV is valid for every token but the newest (after a verify: up to the last accepted
                # draft). Register it before a finished sequence releases its blocks, so the next
                # request with this prefix hits the cache.
                computed = seq.num_tokens - 1 if item.draft_token_ids else seq.num_computed_tokens
                self.scheduler.commit(seq, computed)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                seq.detok.finish()
            req = self.requests[seq.request_id]
            req.first_token_time = req.first_token_time or now
            touched[seq.request_id] = req
        outputs = []
        for rid, req in touched.items():
            if req.stream or req.finished:
                outputs.append(self._output(req))
            if req.finished:
                del self.requests[rid]
        return outputs

    def _append(self, seq: Sequence, s: int, count: int, result: StepResult) -> str | None:
        """Appends up to `count` new tokens, stopping at the first that ends the sequence; returns the
        finish reason, if any."""
        params = seq.params
        for j in range(count):
            token = result.tokens[s][j]
            seq.append_tokens([token])
            self._generated += 1
            if params.logprobs is not None:
                lp = {token: result.logprobs[s][j]}
                if params.logprobs > 0:
                    top = zip(result.top_ids[s][j][:params.logprobs], result.top_logprobs[s][j][:params.logprobs])
                    lp.update(dict(top))
                    lp[token] = result.logprobs[s][j]
                seq.logprobs.append(lp)
                seq.cumulative_logprob += result.logprobs[s][j]
            reason = self._stop_reason(seq, token)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        # The token just appended is output number n_out; stops count only past min_tokens.
        can_stop = n_out > params.min_tokens
        if can_stop and not params.ignore_eos and token in self.stop_ids:
            return "stop"
        if can_stop and params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        hit = seq.detok.append(token, check_stop=can_stop)
        if hit is not None:
            seq.stop_reason = hit
            return "stop"
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if n_out >= max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _take_prompt_logprobs(self, result: StepResult, num: int, items: list) -> None:
        if not items:
            return
        for i, (item, pos) in enumerate(items):
            seq = item.seq
            target = seq.token_ids[pos]
            lp = {target: result.prompt_logprobs[i]}
            if num > 0:
                n = seq.params.prompt_logprobs
                lp = dict(zip(result.prompt_top_ids[i][:n], result.prompt_top_logprobs[i][:n]))
                lp[target] = result.prompt_logprobs[i]
            if seq.is_finished or len(seq.prompt_logprobs) != pos:
                continue    # aborted, or a recompute after preemption scored this position again
            seq.prompt_logprobs.append(lp)

    def _output(self, req: RequestState) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            want_lp = req.params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.index, text=seq.detok.stream_text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=list(seq.logprobs) if want_lp else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        first = req.seqs[0]
        plp = list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["time_to_first_token"] = req.first_token_time - req.arrival_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             prompt_logprobs=plp, num_cached_tokens=first.num_cached_prompt_tokens, metrics=metrics)

    # -- state ----------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage, prefix_cache_hit_rate=bm.prefix_hit_rate, num_kv_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._num_steps,
            num_prompt_tokens=self._prompt_tokens, num_generated_tokens=self._generated,
            num_draft_tokens=self._drafted, num_accepted_draft_tokens=self._accepted)

    def reset_prefix_cache(self) -> int:
        return self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.close()


class AsyncEngine:
    """LLMEngine on a background thread, for asyncio servers.

    `generate()` is an async iterator of cumulative RequestOutputs (the last one has finished=True);
    breaking out of it or cancelling the task aborts the request and frees its blocks. Requests are
    checked in the caller (a bad request raises ValueError there and never reaches the engine).
    """

    def __init__(self, config: EngineConfig | None = None, drafter: Drafter | None = None):
        self.engine = LLMEngine(config, drafter)
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
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = self.engine.validate_request(request_id, prompt, params, prompt_token_ids)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", (request_id, prompt, params, ids, priority)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
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

    close = shutdown
