"""LLMEngine: add_request / step / abort_request, the step loop.

A step: the scheduler plans (how many tokens each sequence computes, how many of the worker's drafts
it verifies), `batch_builder` lays the plan out, `structured/bitmask.py` fills the grammar rows, the
batch goes to the workers, and the results are folded back (`output_processor.py`): tokens appended,
stops checked token by token (a verify step may bring several), grammars advanced by exactly the
committed tokens, KV blocks committed to the prefix cache or rolled back. Drafting happens inside the
worker's step (`spec/proposer.py`); the engine only learns how many drafts each sequence has.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from namazu.assets import resolve_model_path
from namazu.config import ModelConfig
from namazu.engine.batch_builder import build_step_batch
from namazu.engine.detokenizer import IncrementalDetokenizer
from namazu.engine.draft_policy import DraftPolicy
from namazu.engine.output_processor import OutputProcessor, RequestState
from namazu.engine.request_validation import RequestValidator
from namazu.engine.step_rate_fit import StepRates
from namazu.engine_config import EngineConfig, graph_mode, sampled_drafting_off
from namazu.outputs import RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.kv_events import KVEventLog
from namazu.scheduler.scheduler import ScheduledSeq, Scheduler
from namazu.scheduler.sequence import Sequence, SequenceStatus, sequence_seed
from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.drafter_swap import (
    AcceptanceByDrafter,
    check_replacement,
    commit_on_rank,
    discard_on_rank,
    drafter_id,
    stage_on_rank,
)
from namazu.spec.proposer import Proposer
from namazu.spec.selection import choose_speculation
from namazu.spec.shadow import ShadowStats, check_shadow
from namazu.spec.tree_step import max_accepted, step_topology
from namazu.step.batch import StepResult
from namazu.structured.bitmask import fill_step_bitmask
from namazu.structured.factory import StructuredOutputs, grammar_for, needs_compiler
from namazu.structured.tree_masks import usable_tree_nodes
from namazu.tokenizer import Tokenizer
from namazu.worker.executor import make_executor

logger = logging.getLogger(__name__)

# A gap between two step() calls longer than this is the caller pausing (no request, or between generate
# calls), not the loop's own work: a step in flight across it is not timed.
PAUSE_S = 0.05


@dataclass
class _Launched:
    """A step submitted to the workers, waiting for its results."""

    scheduled: list[ScheduledSeq]
    samplers: list[ScheduledSeq]
    prompt_lp_items: list[tuple[ScheduledSeq, int]]
    num_prompt_logprobs: int
    drafts_next: bool = False          # the worker was asked to draft after this step
    launched_at: float = 0.0           # perf_counter seconds at submission
    # Where its cost starts when the engine went straight from the last results to it (0): the results'
    # arrival. Otherwise (the engine sat idle, or its caller paused) the entry of the call that prepared it.
    busy_since: float = 0.0
    prompt_tokens: int = 0             # prefill tokens it computes (chunks of prompts, recomputes)
    plan: dict[int, int] = field(default_factory=dict)   # the draft policy's k per sequence for this step


def mean_acceptance_length(histogram: list[int]) -> float:
    """Tokens per verify step (drafts accepted + 1) from verify steps per acceptance length; 0 if none."""
    steps = sum(histogram)
    return sum((i + 1) * n for i, n in enumerate(histogram)) / steps if steps else 0.0


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
    num_draft_tokens: int                # drafts verified
    num_accepted_draft_tokens: int
    grammar_cache_hits: int = 0          # compiled-grammar cache (JSON schema, regex, EBNF, tools)
    grammar_cache_misses: int = 0
    grammar_mask_rows: int = 0           # bitmask rows filled by grammars
    grammar_mask_seconds: float = 0.0    # host time spent filling them
    # Speculation: verify steps per acceptance length (index i: i + 1 tokens emitted, drafts accepted + the
    # bonus), and the worker's wall time in the drafter.
    acceptance_length_histogram: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    # Steps planned without drafting because more sequences ran than --speculative-disable-batch-size.
    num_spec_disabled_steps: int = 0
    # Draft rows the steps scored: the drafts verified, plus rows planned (async) for drafts the worker
    # did not have.
    num_draft_rows: int = 0
    # Draft blocks the drafter made (one per sequence per drafting step) and their drafts in all: a block
    # ends early where the drafter is unsure (--speculative-min-confidence).
    num_draft_blocks: int = 0
    num_drafts_proposed: int = 0
    # This replica's measured cost of a step of decodes and of one more prompt block in a step
    # (`namazu.engine.step_rate_fit`; 0.0 until measured), for the KV-aware router's wait estimate.
    ms_per_decode_step: float = 0.0
    ms_per_prefill_block: float = 0.0
    # Prompt tokens looked up in the prefix cache and found there, since start (rate() them for a hit rate).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # The serving drafter's id (`spec/drafter_swap.drafter_id`), the swaps since start, and the acceptance
    # tallies above split by the drafter that made the drafts: {id: {acceptance_length_histogram,
    # num_draft_tokens, num_accepted_draft_tokens}}.
    drafter_id: str = ""
    num_drafter_swaps: int = 0
    acceptance_by_drafter: dict = field(default_factory=dict)
    # A shadow drafter (`--shadow-drafter`, spec/shadow.py): its id, its wall time in the worker since start
    # (context writes, drafting, scoring), and {id: its scores on the shadowed requests (exact-rule
    # acceptance length histogram, expected acceptance length sum at T > 0, blocks truncated or dropped),
    # role "shadow", and the serving drafter's acceptance length histogram on the same sequences}.
    shadow_drafter_id: str = ""
    shadow_seconds: float = 0.0
    shadow_acceptance: dict = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.acceptance_length_histogram)

    @property
    def mean_draft_block_length(self) -> float:
        """Drafts proposed per drafted sequence (k when no block ends early)."""
        return self.num_drafts_proposed / self.num_draft_blocks if self.num_draft_blocks else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, drafter: Proposer | None = None):
        self.config = config = config or EngineConfig()
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_path)
        choice = choose_speculation(config, self.model_path, self.model_config, drafter)
        logger.info("%s", choice.describe())
        # The workers read the concrete draft count; the batch-size decision is the scheduler's alone.
        self.config = config = choice.resolve(config)
        self.drafter = choice.drafter
        self.num_speculative_tokens = choice.num_speculative_tokens
        # Verify rows per sequence beyond the root: a draft tree's nodes (`--speculative-tree-budget`) are
        # planned, reserved and rolled back as drafts are (spec/tree_step.py).
        self.verify_rows = max(self.num_speculative_tokens, config.speculative_tree_budget) \
            if self.num_speculative_tokens else 0
        if config.speculative_tree_budget and self.drafter is not None \
                and not callable(getattr(self.drafter, "propose_tree", None)):
            raise ValueError(f"--speculative-tree-budget needs a DFlash2 drafter; {type(self.drafter).__name__} "
                             "proposes one chain")
        # Graph mode verifies 1 + K rows per sequence whatever the plan (static entries): rows cost nothing there.
        self.draft_policy = DraftPolicy(self.num_speculative_tokens + 1, padded_rows=graph_mode(config),
                                        draft_sampled=not sampled_drafting_off(config)) if choice.adaptive else None
        if self.draft_policy is not None and not self.draft_policy.draft_sampled:
            logger.info("graph mode on CPU: requests with temperature > 0 do not draft by default (a sampled "
                        "drafted step costs about 2 plain ones there, for about 2 tokens)")
        self._draft_plan: dict[int, int] = {}
        # A shadow drafter (`spec/shadow.py`) is checked here, before any worker starts.
        self.shadow: ShadowStats | None = None
        if config.shadow_drafter is not None:
            shadow = check_shadow(config.shadow_drafter, self.drafter, self.model_config, config)
            self.shadow = ShadowStats(shadow.drafter_id, shadow.path, config.shadow_fraction)
            logger.info("shadow drafter %s (%s) drafts for %.0f%% of requests", shadow.drafter_id, shadow.path,
                        100 * config.shadow_fraction)
        self.executor = make_executor(config, self.model_path, self.drafter)
        try:
            self._plan_capacity()
        except BaseException:
            self.close()
            raise
        self.kv_events = KVEventLog()   # the prefix cache's stored/removed blocks, for the KV-aware router
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, events=self.kv_events)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill, config.scheduling_policy,
                                   spec_disable_batch_size=choice.disable_batch_size)
        self._tree_parents: tuple[int, ...] | None = None
        self._use_tree_shape()
        self.vocab_size = self.model_config.vocab_size
        self.stop_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids))
        self._stop_set = frozenset(self.stop_ids)
        self.requests: dict[str, RequestState] = {}
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len, config.max_logprobs)
        self.outputs = OutputProcessor(self.stop_ids, self.max_model_len)
        self._structured: StructuredOutputs | None = None
        self.async_scheduling = config.async_scheduling
        self._in_flight: _Launched | None = None
        self._stashed: list[RequestOutput] = []    # a step's outputs collected between two steps (`_settle`)
        self._finished_seq_ids: list[int] = []     # the workers forget these with the next batch
        self._seq_ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._num_steps = self._prompt_tokens = self._drafted = self._accepted = self._mask_rows = 0
        self._draft_rows = self._draft_blocks = self._drafts_proposed = 0
        self._mask_seconds = 0.0
        self._accept_hist = [0] * (self.num_speculative_tokens + 1)
        self.drafter_id = drafter_id(self.drafter)
        self._planned_drafter = self.drafter     # the KV blocks were planned with its context cache
        self._by_drafter = AcceptanceByDrafter(self.drafter_id, len(self._accept_hist))
        self._drafter_swaps = 0
        self._drafter_seconds = 0.0
        self.step_rates = StepRates(config.block_size)     # reported to the KV-aware router
        self._collected_at = 0.0
        # When the last step() call returned and this one began: a step launched before a pause of the caller
        # (LLM.generate returned with the next step in flight; a server with no requests) and collected after
        # it would be timed across the pause.
        self._returned_at = self._entered_at = 0.0
        info = self.worker_info
        logger.info("engine ready: %s, %d KV blocks x %d, max_model_len %d, device %s, dtype %s%s",
                    self.model_path, self.num_kv_blocks, config.block_size, self.max_model_len, info.device,
                    info.dtype, f", {self.num_speculative_tokens} draft tokens" if self.drafter else "")

    def _use_tree_shape(self) -> None:
        """With a tree budget every drafted block is a tree of one static shape (`tree_step.step_topology`, the
        worker's too): grammar rows are filled per node along its path, and async scheduling assumes a verify
        accepts the tree's depth, not its node count."""
        if not self.config.speculative_tree_budget or self.drafter is None or not self.num_speculative_tokens:
            return
        topo = step_topology(self.config.speculative_tree_budget, self.num_speculative_tokens, self.drafter.cfg,
                             self.config.speculative_tree_candidates)
        self._tree_parents = topo.parents
        self.scheduler.max_accepted = functools.partial(max_accepted, topo.depths)

    def _plan_capacity(self) -> None:
        """max_model_len from the flag or the model, checked against what the KV cache holds: a lone
        sequence at max_model_len (plus a verify step's drafts) must fit the pool, or preemption could
        loop forever. Every rank planned its KV blocks; all allocate the smallest count."""
        config, infos = self.config, self.executor.infos()
        self.worker_info = infos[0]
        self.num_kv_blocks = min(i.num_kv_blocks for i in infos)
        bs, spec = config.block_size, self.verify_rows
        capacity = self.num_kv_blocks * bs
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(max_pos, capacity - spec)
        if self.max_model_len > max_pos:
            raise ValueError(f"--max-model-len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{max_pos}")
        if self.max_model_len < 2 or self.max_model_len + spec > capacity:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks x {bs} = {capacity} tokens, fewer than one "
                f"sequence of --max-model-len={self.max_model_len}" + (f" + {spec} draft tokens" if spec else "")
                + "; raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len")
        self.executor.allocate_kv_cache(self.num_kv_blocks)

    # -- requests -------------------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                         prompt_token_ids: list[int] | None) -> list[int]:
        """Checks a request without changing any state; returns its prompt token ids."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        return self.validator(prompt, params, prompt_token_ids)

    @property
    def structured(self) -> StructuredOutputs:
        """xgrammar-backed structured output, created on the first request that needs it."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.stop_ids,
                                                 max_rollback=self.num_speculative_tokens + 4)
        return self._structured

    def compile_grammar(self, params: SamplingParams) -> None:
        """Checks and compiles a request's grammar (cached by its text); ValueError says what is wrong.
        Thread-safe: the async front runs it on a worker thread so the step loop never waits for it."""
        if needs_compiler(params):
            self.structured.compile(params)

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, priority: int = 0, stream: bool = True) -> None:
        """Queues a request. With stream=False, `step()` returns its output only once it finished
        (offline generation skips building a snapshot per step)."""
        params = params or SamplingParams()
        ids = self.validate_request(request_id, prompt, params, prompt_token_ids)
        self.compile_grammar(params)      # a cache hit when the async front compiled it already
        seqs = []
        for i in range(params.n):
            seed = sequence_seed(params.seed, i, self._rng)
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), params, seed, priority=priority)
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output)
            seq.grammar = grammar_for(params, self.stop_ids, self.vocab_size,
                                      self.structured if needs_compiler(params) else None)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            seqs.append(seq)
        self.requests[request_id] = RequestState(request_id, prompt, ids, params, seqs, stream)
        if self.shadow is not None:
            self.shadow.add_request(request_id, [seq.seq_id for seq in seqs])
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
                    self._finish(seq, "abort")
            outs.append(self.outputs.make_output(req))
            logger.info("request %s aborted", rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None or bool(self._stashed)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of every request that got new tokens or finished.

        With async scheduling the step launched here is collected by the next call: this call plans
        and launches step N+1, then collects step N, so planning overlaps the forward."""
        self._entered_at = time.perf_counter()
        stashed, self._stashed = self._stashed, []
        try:
            launched = self._launch()
            if self.async_scheduling:
                previous, self._in_flight = self._in_flight, launched
                if previous is not None and all(item.seq.is_finished for item in previous.scheduled):
                    # Launched before the host saw its sequences stop (or were aborted): nothing of it is
                    # kept. An in-process worker drops it unrun; worker processes are waited for.
                    self.executor.discard()
                    self._collected_at = time.perf_counter()
                    return stashed
                return stashed + (self._collect(previous) if previous is not None else [])
            return stashed + (self._collect(launched) if launched is not None else [])
        finally:
            self._returned_at = time.perf_counter()

    def _settle(self) -> list[RequestOutput]:
        """Collects the step in flight (async scheduling leaves one launched when `LLM.generate` returns)
        so that the workers answer the next message, not that step; returns its outputs."""
        if self._in_flight is None:
            return []
        launched, self._in_flight = self._in_flight, None
        return self._collect(launched)

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(worker, *args)` on every rank between two steps (fn picklable: a module-level function); the
        answers in rank order. A step in flight is collected first and its outputs come with the next
        `step()`: sent behind it, the call would have read that step's results as its answers."""
        self._stashed.extend(self._settle())
        return self.executor.collective_rpc(fn, *args)

    def start_profile(self) -> None:
        """Rank 0 records every step's timestamps until `stop_profile` (model_runner.StepTiming)."""
        self._stashed.extend(self._settle())
        self.executor.start_profile()

    def stop_profile(self) -> list:
        self._stashed.extend(self._settle())
        return self.executor.stop_profile()

    def _num_drafts(self, seq: Sequence) -> int:
        """How many of the worker's drafts a sequence in decode may verify next."""
        cap = self.verify_rows
        if seq.params.num_speculative_tokens is not None:
            cap = min(cap, seq.params.num_speculative_tokens)
        if cap <= 0:
            return 0
        if self.draft_policy is not None:
            planned = self._draft_plan.get(seq.seq_id, 0)
            # The policy sizes chains; a tree is verified whole or not at all (its first k nodes in node order
            # are a shallow tree, not a shorter chain).
            cap = min(cap, planned) if not self.config.speculative_tree_budget else cap * (planned > 0)
            if cap <= 0:
                return 0
        if seq.num_pending:
            # Planned before its drafts are known (async): the worker verifies what it has, which is
            # nothing when the step in flight was told not to draft.
            return cap if seq.drafts_requested else 0
        return min(cap, seq.num_next_drafts)

    def _launch(self) -> _Launched | None:
        if not self.scheduler.has_unfinished:
            return None
        if self.draft_policy is not None:
            # Above the drafting limit the scheduler drafts for no one: no plan to make.
            running = self.scheduler.running if self.scheduler.speculation_fits() else []
            self._draft_plan = self.draft_policy.plan([(seq.seq_id, seq.params.temperature) for seq in running])
        plan = self.scheduler.schedule(self._num_drafts if self.num_speculative_tokens else None)
        if plan.is_empty:
            return None
        if self.draft_policy is not None and plan.speculate:
            admitted = [(it.seq.seq_id, it.seq.params.temperature) for it in plan.scheduled
                        if it.samples and it.seq.seq_id not in self._draft_plan]
            if admitted:
                others = [it for it in plan.scheduled if it.samples and it.seq.seq_id in self._draft_plan]
                others_draft = not others or any(self._draft_plan[it.seq.seq_id] > 0 for it in others)
                self._draft_plan = {**self._draft_plan, **self.draft_policy.plan_admitted(admitted, others_draft)}
        batch, samplers, prompt_lp_items = build_step_batch(plan.scheduled, self.vocab_size, self._finished_seq_ids)
        self._finished_seq_ids = []
        if self.shadow is not None:
            batch.shadow_seq_ids = self.shadow.take_new()
        t0 = time.perf_counter()
        batch.sampling.bitmask = fill_step_bitmask(samplers, self.vocab_size, self._tree_parents)
        if batch.sampling.bitmask is not None:
            self._mask_rows += len(batch.sampling.bitmask)
            self._mask_seconds += time.perf_counter() - t0
        if self.draft_policy is not None:
            batch.spec.write_context = any(self.draft_policy.wants_context(it.seq.seq_id, it.seq.params.temperature)
                                           for it in plan.scheduled)
        speculate = plan.speculate and self._drafting_pays(plan.scheduled)
        if self.drafter is not None and self.drafter.on_device and speculate:
            batch.spec.max_drafts_next = self.verify_rows     # a tree's nodes come back whole (grammar rows)
        self.executor.submit(batch)
        for item in plan.scheduled:
            self.scheduler.submitted(item, speculate)
        self._num_steps += 1
        self._draft_rows += sum(item.num_drafts for item in plan.scheduled)
        # A sequence computing more than one new token is prefilling (a prompt chunk, or a recompute after
        # preemption); a decode computes one, and its drafts are verify rows, priced into the decode step.
        prefill = sum(item.num_new_tokens for item in plan.scheduled if item.num_new_tokens > 1)
        busy_since = self._entered_at if self._entered_at - self._returned_at > PAUSE_S else 0.0
        return _Launched(plan.scheduled, samplers, prompt_lp_items, batch.prompt_lp.num,
                         self.drafter is not None and speculate, time.perf_counter(), busy_since, prefill,
                         self._draft_plan)

    def _drafting_pays(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the worker drafts after this step: some sampling sequence wants drafts, and this is not
        the draft policy's plain step (without a policy: always)."""
        policy = self.draft_policy
        if policy is None:
            return True
        sampling = [it for it in scheduled if it.samples]
        wanted = any(self._draft_plan.get(it.seq.seq_id, 0) > 0 for it in sampling)
        return wanted and not policy.plain_probe_due(len(sampling))

    def _observe_step(self, launched: _Launched, result: StepResult, ms: float) -> None:
        """A pure decode step's time for the draft policy, with the drafts it verified: one that verified
        and drafted, or neither."""
        rows = int(sum(result.num_drafts)) if launched.samplers else 0
        if launched.prompt_tokens or not launched.samplers or bool(rows) != launched.drafts_next:
            return
        self.draft_policy.observe_step(len(launched.samplers), rows, ms)

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        result = self.executor.collect()
        done = time.perf_counter()
        # A busy engine's step costs the span from the previous step's results to its own: the engine's work
        # between them (the last results' tokens through detokenizer and grammar, this step's plan and
        # grammar rows) is the step's as much as the forward is. A grammar sequence is not planned until the
        # step before returns, so that work runs between the forwards, not beside one: timed from its launch,
        # a drafted step of a JSON-schema request, whose grammar walks every draft, looked cheaper than it was.
        ms = 1000.0 * (done - max(launched.busy_since, self._collected_at))
        # Not timed across a pause of the caller: a drafted step timed over the gap between two generate calls
        # read 50-120 plain steps, and the draft policy's cost fit, pulled up by a few of those, stopped
        # drafting where it paid 1.8x (eager bf16, engines side by side in one process).
        paused = launched.launched_at < self._returned_at and self._entered_at - self._returned_at > PAUSE_S
        if not paused:
            self.step_rates.observe(launched.prompt_tokens, ms)
            if self.draft_policy is not None:
                self._observe_step(launched, result, ms)
        self._collected_at = done
        self._drafter_seconds += result.drafter_seconds
        if self.shadow is not None:
            self.shadow.add_step(result.shadow)
        touched: dict[str, RequestState] = {}
        if launched.prompt_lp_items:
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
            reason = self._fold(seq, item, s, result, running, launched.drafts_next, launched.plan.get(seq.seq_id, 0))
            if running:
                # KV is valid for every token but the newest. Register it before a finished sequence
                # releases its blocks, so the next request with this prefix hits the cache.
                self.scheduler.commit(seq, seq.num_computed_tokens)
            if reason is not None:
                self._finish(seq, reason)
            req = self.requests[seq.request_id]
            req.first_token_time = req.first_token_time or now
            touched[seq.request_id] = req
        outputs = []
        for rid, req in touched.items():
            if req.stream or req.finished:
                outputs.append(self.outputs.make_output(req))
            if req.finished:
                del self.requests[rid]
        return outputs

    def _fold(self, seq: Sequence, item: ScheduledSeq, s: int, result: StepResult, running: bool,
              drafted: bool = False, planned: int = 0) -> str | None:
        """One sampling sequence's results: the assumed outcome of `submitted` is corrected by the
        drafts that were rejected, the emitted tokens are appended (up to the first stop) and its
        grammar accepts exactly those; returns the finish reason, if any. `planned`: the drafts the draft
        policy wanted it to verify in this step."""
        accepted, k = int(result.accepted[s]), item.num_drafts
        assumed = self.scheduler.max_accepted(k)        # what `submitted` assumed accepted
        self._drafted += int(result.num_drafts[s])
        self._accepted += accepted
        if result.num_drafts[s]:
            self._accept_hist[accepted] += 1
            if self.shadow is not None:      # the serving drafter on the shadowed sequences, for comparison
                self.shadow.observe_serving(seq.seq_id, int(result.num_drafts[s]), accepted)
        if self.draft_policy is not None and item.samples:
            verified = int(result.num_drafts[s])
            if seq.grammar_cut == verified and accepted == verified and planned > verified:
                # The policy wanted the draft the grammar cut: the target could never have sampled it (its
                # row is masked), so it counts as reached and rejected. Left out, a JSON-schema sequence
                # whose blocks the grammar cuts kept the later drafts' optimistic rates and drafted on.
                verified += 1
            if verified:
                self.draft_policy.observe_verify(seq.seq_id, seq.params.temperature, verified, accepted)
            else:
                self.draft_policy.observe_plain(seq.seq_id)
        seq.num_pending -= assumed + 1
        if running:
            seq.num_computed_tokens -= assumed - accepted
        if seq.num_pending == 0:
            seq.inflight_drafts = 0
        n = accepted + 1
        lp = result.logprobs[s, :n].tolist() if result.logprobs is not None else None
        top = ((result.top_ids[s, :n].tolist(), result.top_logprobs[s, :n].tolist())
               if result.top_ids is not None else (None, None))
        before = len(seq.token_ids)
        reason = self.outputs.append(seq, result.tokens[s, :n].tolist(), lp, *top)
        if seq.grammar is not None:
            if not seq.grammar.accept_tokens(seq.token_ids[before:]):
                logger.error("request %s: the grammar rejected committed tokens %s; ending the sequence",
                             seq.request_id, seq.token_ids[before:])
                return "abort"
            if reason is None and seq.grammar.is_terminated():
                reason = "stop"
        if result.next_num_drafts is not None:
            seq.num_next_drafts, seq.grammar_cut = int(result.next_num_drafts[s]), -1
            if drafted:     # a step told not to draft reports zeros, not a block
                self._draft_blocks += 1
                self._drafts_proposed += seq.num_next_drafts
            if seq.grammar is not None and result.next_draft_ids is not None:
                ids = list(result.next_draft_ids[s][:seq.num_next_drafts])
                # A stop token ends the grammar: no row after it has a mask, so drafts end before it (the
                # row at its position may still sample it).
                stop = next((j for j, t in enumerate(ids) if t in self._stop_set), len(ids))
                if self._tree_parents is not None:     # the nodes before the first that ends the grammar
                    seq.num_next_drafts = usable_tree_nodes(seq.grammar, ids, self._tree_parents,
                                                            self._stop_set) if reason is None else 0
                else:
                    seq.num_next_drafts = seq.grammar.validate_tokens(ids[:stop]) if reason is None else 0
                    if reason is None and seq.num_next_drafts < stop:
                        seq.grammar_cut = seq.num_next_drafts
                seq.next_draft_ids = ids[:seq.num_next_drafts]
        return reason

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.draft_policy is not None:
            self.draft_policy.forget(seq.seq_id)
        seq.detok.finish()
        self._finished_seq_ids.append(seq.seq_id)
        if self.shadow is not None:
            self.shadow.finished(seq.seq_id)

    def _take_prompt_logprobs(self, result: StepResult, num: int, items: list) -> None:
        for i, (item, pos) in enumerate(items):
            top = ((result.prompt_top_ids[i].tolist(), result.prompt_top_logprobs[i].tolist()) if num > 0
                   else (None, None))
            self.outputs.add_prompt_logprob(item.seq, pos, float(result.prompt_logprobs[i]), *top)

    # -- state ----------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        cache = self._structured.backend if self._structured is not None else None
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage, prefix_cache_hit_rate=bm.prefix_hit_rate, num_kv_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._num_steps,
            num_prompt_tokens=self._prompt_tokens, num_generated_tokens=self.outputs.num_generated_tokens,
            num_draft_tokens=self._drafted, num_accepted_draft_tokens=self._accepted,
            grammar_cache_hits=cache.hits if cache else 0, grammar_cache_misses=cache.misses if cache else 0,
            grammar_mask_rows=self._mask_rows, grammar_mask_seconds=self._mask_seconds,
            acceptance_length_histogram=list(self._accept_hist), drafter_seconds=self._drafter_seconds,
            num_spec_disabled_steps=self.scheduler.num_spec_disabled_steps, num_draft_rows=self._draft_rows,
            num_draft_blocks=self._draft_blocks, num_drafts_proposed=self._drafts_proposed,
            ms_per_decode_step=self.step_rates.ms_per_decode_step,
            ms_per_prefill_block=self.step_rates.ms_per_prefill_block,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            drafter_id=self.drafter_id, num_drafter_swaps=self._drafter_swaps,
            acceptance_by_drafter=self._by_drafter.report(self._acceptance_totals()),
            **self._shadow_stats())

    def _shadow_stats(self) -> dict:
        sh = self.shadow
        if sh is None:
            return {}
        return {"shadow_drafter_id": sh.shadow_id, "shadow_seconds": sh.tally["seconds"],
                "shadow_acceptance": sh.report()}

    def _acceptance_totals(self) -> dict:
        return AcceptanceByDrafter.totals(self._accept_hist, self._drafted, self._accepted)

    # -- replacing the drafter (spec/drafter_swap.py) ---------------------------------------------------
    def check_drafter(self, path: str) -> Proposer:
        """The replacement for the serving DFlash drafter, checked as at start-up (DrafterCheckpointError
        naming the field or tensor, DrafterSwapError); nothing changes. Safe from any thread."""
        return check_replacement(path, self.drafter, self.model_config, self.config.block_size,
                                 self._planned_drafter)

    def swap_drafter(self, new: Proposer) -> list[RequestOutput]:
        """Serves `new` (from `check_drafter`) from the next step on; call between steps, on the thread that
        steps. Returns the outputs of the step that was in flight (collected first). Every running sequence
        is recomputed, so both caches are rebuilt from its tokens; a rank that cannot load the drafter leaves
        the old one serving (DrafterCheckpointError)."""
        outputs = self._settle()
        t0 = time.perf_counter()
        errors = [e for e in self.executor.collective_rpc(stage_on_rank, new.path) if e]
        if errors:
            self.executor.collective_rpc(discard_on_rank)
            raise DrafterCheckpointError(f"drafter {new.path} could not be loaded ({errors[0]}); still serving "
                                         f"{self.drafter_id}")
        old = self.drafter_id
        n = self.scheduler.preempt_all(f"the drafter changes to {new.drafter_id}")
        dropped = self.reset_prefix_cache()
        self.executor.collective_rpc(commit_on_rank)
        self.drafter, self.drafter_id = new, new.drafter_id
        self._use_tree_shape()      # its tree may have another depth (nothing is in flight, all recompute)
        self.config = dataclasses.replace(self.config, speculative_model=new.path)   # a restart keeps it
        self._by_drafter.switch(new.drafter_id, self._acceptance_totals())
        self._drafter_swaps += 1
        logger.info("drafter swapped after step %d: %s -> %s (%s), loaded and switched in %.2f s; %d sequence(s) "
                    "preempted to rebuild their caches from their tokens, %d cached prefix block(s) dropped",
                    self._num_steps, old, new.drafter_id, new.path, time.perf_counter() - t0, n, dropped)
        return outputs

    def set_drafter(self, path: str) -> list[RequestOutput]:
        """`check_drafter` then `swap_drafter`."""
        return self.swap_drafter(self.check_drafter(path))

    def reset_prefix_cache(self) -> int:
        return self.block_manager.reset_prefix_cache()

    def check_health(self) -> None:
        """Raises WorkerError when a worker rank is dead or hung."""
        self.executor.check_health()

    def close(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is None:
            return
        # With async scheduling a step may still be in flight (launched for sequences that its predecessor
        # finished): its ranks would answer into closed pipes.
        if getattr(self, "_in_flight", None) is not None and executor.failure() is None:
            self._in_flight = None
            try:
                executor.discard()
            except Exception:       # noqa: BLE001 -- closing either way
                logger.warning("discarding the in-flight step at close", exc_info=True)
        executor.close()

    # -- failure handling (used by the async front's supervision) -------------------------------------
    def fail_running_requests(self) -> list[str]:
        """After `step()` raised: aborts the requests that had sequences in the failed step (running,
        or in a launched step) and frees their blocks; waiting requests stay queued. With async
        scheduling, a step launched but not collected is collected first (and discarded) so the next
        step's results line up. Returns the aborted request ids."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            try:
                self.executor.collect()
            except Exception:       # noqa: BLE001 -- the step is discarded either way
                logger.warning("discarding the in-flight step after a failure", exc_info=True)
        ids = {seq.request_id for seq in self.scheduler.running}
        if launched is not None:
            ids |= {item.seq.request_id for item in launched.scheduled}
        ids &= set(self.requests)
        self.abort_request(sorted(ids))
        return sorted(ids)

    def worker_failure(self) -> str | None:
        """Why the model-runner workers cannot serve (a dead process, with its exit code), or None."""
        return self.executor.failure()

    def kill_workers(self) -> None:
        """Ends the worker processes at once (a hung step); the step waiting on them then fails."""
        self.executor.kill()

    def workers_respond(self, timeout: float) -> bool:
        """Whether the workers answer a no-op within `timeout` seconds (between steps only): a worker
        that is alive but hung does not."""
        return self.executor.ping(timeout)
