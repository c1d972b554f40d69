"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
sequences go first, in policy order (FCFS, or priority then arrival): a decode costs 1 token, a verify
1 + k, an unfinished prompt its next chunk. Waiting sequences are then admitted while budget, cap and
free blocks allow, each mapping its cached prefix first. When a running sequence needs a block and the
pool is empty, the last sequence in policy order is preempted by recompute: its blocks are freed, its
tokens kept, and it waits at its original place in line to be prefilled again. Nothing is ever dropped:
a sequence that fits the pool alone (checked at start-up against max_model_len) always gets to run.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: KV for token_ids[num_computed : num_computed + num_new_tokens],
    then `num_drafts` of the drafts the worker holds for it (verify). A row samples when the step
    reaches the end of its known tokens."""

    seq: Sequence
    num_new_tokens: int
    num_drafts: int = 0
    start: int = field(init=False)   # num_computed_tokens when planned (the first new position)
    samples: bool = field(init=False)
    assumed_drafts: int = field(init=False)   # drafts of the step in flight this plan assumes accepted

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens
        self.assumed_drafts = self.seq.inflight_drafts

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + self.num_drafts


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # The step's one speculation decision: verify drafts in it and draft after it. False when the engine
    # has no drafter, or more sequences run than the batch-size threshold.
    speculate: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 spec_disable_batch_size: int = 0):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy {policy!r}: expected fcfs or priority")
        if spec_disable_batch_size < 0:
            raise ValueError(f"spec_disable_batch_size={spec_disable_batch_size}: must be >= 0 (0: never)")
        self.spec_disable_batch_size = spec_disable_batch_size
        self.num_spec_disabled_steps = 0
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.by_priority = policy == "priority"
        self.waiting: list[Sequence] = []     # sorted by policy key
        self.running: list[Sequence] = []     # sorted by policy key
        self.num_preemptions = 0
        # The most drafts a verify of k drafts can accept: k for a chain; for a draft tree of k nodes its depth
        # (`spec/tree_step.max_accepted`, set by the engine). What async scheduling assumes accepted, and what
        # bounds the tokens a verify may emit near max_tokens.
        self.max_accepted: Callable[[int], int] = _whole_chain

    def _key(self, seq: Sequence) -> tuple[int, int]:
        return seq.sort_key(self.by_priority)

    def add(self, seq: Sequence) -> None:
        if not self.chunked and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"prompt of {seq.num_tokens} tokens exceeds --max-num-batched-tokens="
                             f"{self.max_num_batched_tokens} and chunked prefill is off")
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Removes a sequence (done or aborted) and frees its blocks, whatever state it is in."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        if reason is not None and seq.finish_reason is None:
            seq.finish_reason = reason

    def _preempt(self, seq: Sequence, why: str = "KV pool exhausted") -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.reset_for_recompute()
        bisect.insort(self.waiting, seq, key=self._key)
        self.num_preemptions += 1
        logger.info("preempted %s (seq %d) by recompute: %s", seq.request_id, seq.seq_id, why)

    def preempt_all(self, why: str) -> int:
        """Every running sequence back to waiting, to be recomputed from its tokens (in its place in line);
        only between steps, with nothing in flight. Returns how many."""
        if any(seq.num_pending for seq in self.running):
            raise RuntimeError("preempt_all with a step in flight: collect it first")
        running = list(self.running)
        for seq in reversed(running):
            self._preempt(seq, why)
        return len(running)

    def speculation_fits(self) -> bool:
        limit = self.spec_disable_batch_size
        return limit == 0 or len(self.running) <= limit

    def schedule(self, num_drafts: Callable[[Sequence], int] | None = None) -> SchedulerOutput:
        """Plans one step. `num_drafts(seq)` is how many of the worker's drafts a sequence in decode may
        verify; they are trimmed to the budget, max_tokens and max_model_len. None: no speculation.

        Speculation is decided here, once per step: the step verifies drafts and the worker drafts after
        it only if at most `spec_disable_batch_size` sequences are running once the step is planned
        (admissions and preemptions included)."""
        budget = self.max_num_batched_tokens
        # A first guess, so a batch already too large spends no budget on drafts; the decision below is
        # the one that counts.
        drafting = num_drafts is not None and self.speculation_fits()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # Decodes (and verifies) first, then prompt chunks, each in policy order: a long prefill (a
        # recompute after preemption, a high-priority prompt) never stalls the running decodes.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        planned: dict[int, ScheduledSeq] = {}
        for seq in decoding + [s for s in self.running if s.num_tokens - s.num_computed_tokens != 1]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._exhausted(seq) or seq.waits_for_values:
                continue    # preempted below, its last token is pending (finished when it arrives), or its
                            # grammar needs the values of the tokens in flight
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self._may_chunk(remaining):
                continue
            k = self._trim_drafts(seq, num_drafts(seq) if drafting else 0, budget - n, n == remaining)
            while not self.bm.grow(seq, seq.num_computed_tokens + n + k):
                victim = self.running[-1]          # the last in policy order
                if victim.seq_id in planned:       # already planned this step: give its budget back
                    budget += planned.pop(victim.seq_id).num_query_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            planned[seq.seq_id] = ScheduledSeq(seq, n, k)
            budget -= n + k
        scheduled.extend(planned.values())

        # Admitting new work right after a preemption would only thrash the pool.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if seq.num_pending:
                break       # preempted while a step was in flight: readmit once its token is known
            num_cached = self.bm.admit(seq, budget)
            if num_cached is None:
                break
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if n < remaining and not self._may_chunk(remaining):
                self.bm.free_seq(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        speculate = num_drafts is not None and self.speculation_fits()
        if num_drafts is not None and not speculate:
            # Admissions pushed the batch past the threshold: verify nothing. The blocks grown for the
            # drafts are released by `commit`, as those of rejected drafts are.
            self.num_spec_disabled_steps += 1
            for item in scheduled:
                item.num_drafts = 0
        return SchedulerOutput(scheduled, preempted, speculate)

    def _exhausted(self, seq: Sequence) -> bool:
        max_tokens = seq.params.max_tokens
        return seq.num_tokens >= self.max_model_len or (max_tokens is not None and seq.num_output_tokens >= max_tokens)

    def _may_chunk(self, remaining: int) -> bool:
        # Without chunked prefill a prompt waits for a step with room for all of it. A sequence that
        # outgrew the whole budget (prompt + outputs, recomputed after preemption) is chunked anyway,
        # or it would never run again.
        return self.chunked or remaining > self.max_num_batched_tokens

    def _trim_drafts(self, seq: Sequence, k: int, budget: int, at_end: bool) -> int:
        if k <= 0 or not at_end:
            return 0
        k = max(0, min(k, budget, self.max_model_len - seq.num_tokens))
        if seq.params.max_tokens is not None:
            # The bonus token always comes too, so a verify that may accept a drafts may produce a + 1 tokens
            # (a tree of k nodes accepts at most its depth: near max_tokens it keeps every node that shallow).
            room = seq.params.max_tokens - seq.num_output_tokens - 1
            while k > 0 and self.max_accepted(k) > room:
                k -= 1
        return k

    def submitted(self, item: ScheduledSeq, speculate: bool) -> None:
        """The step is on its way to the workers. Its outcome is assumed in advance so the next step
        can be planned before the results arrive: the new tokens' KV will exist, a sampling row adds
        one pending token, and a verify is assumed to accept all it can (`max_accepted`: every draft of a
        chain, a tree's depth; `commit` corrects that).
        `speculate`: the step's plan asked the worker to draft after it (`SchedulerOutput.speculate`)."""
        seq = item.seq
        accepted = self.max_accepted(item.num_drafts)
        seq.num_computed_tokens += item.num_new_tokens + accepted
        if item.samples:
            seq.num_pending += accepted + 1
            seq.inflight_drafts = accepted
            seq.drafts_requested = speculate

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """After a step: the KV of the first `num_computed_tokens` tokens is valid. Rolls back blocks
        that only held rejected drafts and registers newly full blocks in the prefix cache."""
        seq.num_computed_tokens = num_computed_tokens
        self.bm.truncate(seq, max(num_computed_tokens, seq.num_tokens))
        self.bm.commit(seq)


def _whole_chain(num_drafts: int) -> int:
    return num_drafts
