"""Per-sequence state the scheduler and block manager share.

A request with n > 1 has n sequences; each is scheduled, cached and preempted on its own. `token_ids` is
prompt + output; `num_computed_tokens` is how many of them already have KV in the cache, so prefill,
chunked prefill, decode and recompute after preemption are all "compute tokens[num_computed:]".
Draft tokens of a verify step are not in `token_ids` until accepted.

With async scheduling the engine plans a step before the previous step's samples reach the host: a
sampled token whose value is still on the device is *pending*. It counts in `num_tokens` (the
scheduler's view: positions, budget, blocks) but not in `token_ids` (known values); the worker feeds
it to the next step from its device-side copy.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_hash import root_hash


def sequence_seed(request_seed: int | None, index: int, rng: Any) -> int:
    """The sampler's seed for sequence `index` of a request. A request's own seed gives each of its n
    sequences a seed in [0, 2^63); a request without one gets an engine-drawn seed, stored negative: the
    sign is how the worker tells the two apart (`layers/sampler.seeded_rows`), because a seeded row must
    be verified against its own seeded samples (`spec/verify.py`) to emit exactly the tokens of plain
    decoding, while an unseeded one may take the lossless rule with the drafter's q."""
    if request_seed is None:
        return -1 - int(rng.integers(0, 2**62))
    return (request_seed + 1_000_003 * index) % 2**63


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ARRIVAL = itertools.count()


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int                       # which of the request's n continuations
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                        # the sampler's stream: >= 0 from the request's seed, < 0 engine-drawn
    priority: int = 0                # lower runs first under --scheduling-policy priority
    arrival: int = field(default_factory=lambda: next(_ARRIVAL))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hash of each full block of token_ids
    cache_root: int = field(init=False)   # the chain's first parent, from the request's cache salt
    num_committed_blocks: int = 0    # leading blocks registered in the prefix cache
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    num_pending: int = 0             # sampled tokens still on the device (async scheduling)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Results gathered by the engine.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    detok: Any = None                # namazu.engine.detokenizer.IncrementalDetokenizer, set by the engine
    grammar: Any = None              # namazu.structured.grammar.Grammar, or None (unconstrained)
    # Speculation: the worker holds drafts for this sequence; the engine plans how many to verify.
    num_next_drafts: int = 0         # drafts the worker proposed after this sequence's last step
    next_draft_ids: list[int] = field(default_factory=list)   # their ids (grammar sequences only)
    grammar_cut: int = -1            # its grammar rejects that draft of them, and the block ends before it
    inflight_drafts: int = 0         # drafts the verify step in flight (async) is assumed to accept
    drafts_requested: bool = False   # the last step that sampled for it asked the worker to draft

    def __post_init__(self) -> None:
        self.cache_root = root_hash(self.params.cache_salt)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens including pending ones: what positions, budgets and blocks are planned for."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens whose values the host knows."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens including pending ones (the index of the next token to sample)."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to collect (a preempted sequence does not collect them twice)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_tokens(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the KV is gone, the tokens stay."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_committed_blocks = 0
        self.num_preemptions += 1

    @property
    def waits_for_values(self) -> bool:
        """Its grammar must see the pending tokens' values (or their number is uncertain) before its
        next rows can be masked: async scheduling does not plan it until the step in flight returns."""
        g = self.grammar
        return g is not None and self.num_pending > 0 and (g.depends_on_values or self.inflight_drafts > 0)

    def sort_key(self, by_priority: bool) -> tuple[int, int]:
        return (self.priority if by_priority else 0, self.arrival)
