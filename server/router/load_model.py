"""How long a new request would wait for its first token at a replica, in milliseconds.

The spill rule (`policy.py`) weighs waiting at a prompt's home against recomputing the prompt elsewhere.
Counting both in KV blocks missed the wait that dominates near saturation: a request that finds every
slot (--max-num-seqs) taken waits for a running sequence to finish its decode, which the block count
priced at a fraction of its real cost (bench/RESULTS.md: the home's tail waited seconds). Here the wait
is time, from two per-replica rates:

    wait = ms_per_block x (prompt blocks the requests ahead of it still have to prefill)
         + ms_per_step  x (decode steps until a slot frees for it)

The slot wait is a small FCFS simulation: the running sequences free their slots as their remaining
decode steps run out, each waiting request takes the first free slot and holds it for its own decode, and
the new request takes the slot that frees after all of them. A request's own first token then comes
`overhead_ms + ms_per_block x its uncached blocks` after its wait.

`RateEstimator` learns the rates from what the router observes of its own requests (no engine change
needed): first-token times of requests sent when a slot was free fit `overhead + ms_per_block x blocks
prefilled ahead and with it` (exponentially weighted least squares, regularized toward the prior), and
the spacing of streamed tokens gives the decode step. The prior holds until data arrives and keeps the
fit defined when every prompt has the same length.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from namazu.engine.step_rate_fit import DecayedLinearFit


@dataclass(frozen=True)
class Rates:
    ms_per_block: float     # prefilling one uncached prompt block
    ms_per_step: float      # one decode iteration of the running batch
    overhead_ms: float      # the fixed part of a first token: one iteration, the HTTP hops

    def __post_init__(self) -> None:
        if not (self.ms_per_block > 0 and self.ms_per_step > 0 and self.overhead_ms >= 0):
            raise ValueError(f"rates must be positive: {self}")


# Before a replica has answered anything: the order of namazu-tiny on one CPU thread (16-token blocks),
# as the router measured it on the shared 2-core machine (9 ms per block fitted over prompts of 20 to 400
# random words, 14 ms per step). Only the ratio of the two rates steers the spill rule, and a few dozen requests
# replace the prior.
PRIOR = Rates(ms_per_block=8.0, ms_per_step=15.0, overhead_ms=10.0)
DEFAULT_STEPS = 64          # decode steps of a request that does not say (no max_tokens), before data
OUTLIER = 1.5               # a first-token time counts for at most this multiple of the current fit


@dataclass(frozen=True)
class Pending:
    """A request at the replica without its first token yet: queued, or in its prefill."""

    uncached: int           # prompt blocks it prefills there
    blocks: int             # prompt blocks it holds once running
    steps: float            # decode steps it will run


def split_open(requests: Sequence[tuple[int, int, float, float | None]], now: float, ms_per_step: float
               ) -> tuple[tuple[Pending, ...], list[float]]:
    """A router's open requests at a replica, (uncached blocks, prompt blocks, decode steps, time of the
    first token or None) each: those still before their first token at `now` (the prefill ahead of a new
    request), and the decode steps left of the others (the slots they hold), at `ms_per_step`."""
    pending, running = [], []
    for uncached, blocks, steps, first_at in requests:
        if first_at is None or first_at > now:
            pending.append(Pending(uncached, blocks, steps))
        else:
            running.append(max(1.0, steps - 1000.0 * (now - first_at) / ms_per_step))
    return tuple(pending), running


def decode_steps(body: object) -> int | None:
    """A request body's max_tokens (max_completion_tokens first): its decode length at most, the exact one
    for most clients; None when it sets neither, or a value no replica accepts (past 2^31: the replica
    answers its own 400, and a 3000-digit integer must not reach float arithmetic here)."""
    if not isinstance(body, dict):
        return None
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 31 else None


def slot_wait_steps(running: Sequence[float], waiting: Sequence[float], capacity: int) -> float:
    """Decode steps until a new request gets a slot: `running` holds the steps left of the sequences in the
    slots, `waiting` the decode lengths of the requests queued ahead (FCFS), `capacity` the slots
    (--max-num-seqs; 0 when unknown: no slot wait is assumed)."""
    if capacity <= 0 or len(running) + len(waiting) < capacity:
        return 0.0
    # A replica can report more running than its capacity only transiently (a stale report): the extra
    # sequences are treated as the first to leave.
    frees = sorted(max(0.0, s) for s in running)
    heap = frees[len(frees) - capacity:] if len(frees) > capacity else frees
    heap += [0.0] * (capacity - len(heap))
    heapq.heapify(heap)
    for steps in waiting:
        t = heapq.heappop(heap)
        heapq.heappush(heap, t + max(0.0, steps))
    return heap[0]


def expected_wait_ms(rates: Rates, pending: Sequence[Pending], running: Sequence[float], capacity: int,
                     others_queued: float = 0.0, new_blocks: int = 0, new_steps: float = DEFAULT_STEPS) -> float:
    """The wait before a new request's own prefill starts there (see the module docstring). `pending` are
    this router's requests without a first token, oldest first: the first free slots go to them, the rest
    wait. `others_queued` requests of other clients wait too, each priced like the new one (`new_blocks`
    uncached, `new_steps` decode steps), ahead of it since their place in the queue is unknown."""
    free = max(0, capacity - len(running)) if capacity > 0 else len(pending)
    extra = max(0, int(round(others_queued)))
    waiting = [p.steps for p in pending[free:]] + [new_steps] * extra
    admitted = [p.steps for p in pending[:free]]
    prefill = sum(p.uncached for p in pending) + extra * new_blocks
    return rates.ms_per_block * prefill + rates.ms_per_step * slot_wait_steps(
        list(running) + admitted, waiting, capacity)


def first_token_ms(rates: Rates, wait_ms: float, uncached: int) -> float:
    """The first token's expected time there: the wait, then the request's own prefill."""
    return wait_ms + rates.overhead_ms + rates.ms_per_block * uncached


# A reported rate above this is not a rate but a broken measurement (a replica once reported 1.6e83 ms per
# prefill block): it is ignored like a missing one, and the replica is priced at its twins' or the prior.
MAX_REPORTED_MS = 60_000.0


def _measured(report: Mapping[str, object], key: str) -> float:
    value = report.get(key)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and 0 < value <= MAX_REPORTED_MS)
    return float(value) if ok else 0.0     # type: ignore[arg-type]


def reported_rates(report: Mapping[str, object], prior: Rates = PRIOR) -> Rates:
    """A replica's own measurement of its rates (`namazu.engine.step_rate_fit`, in `GET /load` and Ray Serve's routing
    stats), each rate the prior's until the replica has measured it. The fixed part of a first token is a
    step's own (the prefill step's cost without its blocks)."""
    step, block = _measured(report, "ms_per_decode_step"), _measured(report, "ms_per_prefill_block")
    return Rates(ms_per_block=block or prior.ms_per_block, ms_per_step=step or prior.ms_per_step,
                 overhead_ms=step or prior.overhead_ms)


def fleet_rates(reports: Sequence[Mapping[str, object]], prior: Rates = PRIOR) -> list[Rates]:
    """Every replica's reported rates, where one has not measured a rate yet the median of those that have
    (the replicas serve one model, on like hardware as a rule), and `prior` only where none has. The spill
    rule compares one replica's wait with another's recompute: a replica that has just started must not
    look ten times slower or faster than its twins because its rate is a prior measured elsewhere (a
    fresh replica priced at 8 ms per block beside twins measured at 0.5 got no spill from them)."""
    def median(key: str, default: float) -> float:
        seen = sorted(v for v in (_measured(r, key) for r in reports) if v > 0)
        return seen[len(seen) // 2] if seen else default

    step = median("ms_per_decode_step", 0.0)
    fleet = Rates(ms_per_block=median("ms_per_prefill_block", prior.ms_per_block),
                  ms_per_step=step or prior.ms_per_step, overhead_ms=step or prior.overhead_ms)
    return [reported_rates(r, fleet) for r in reports]


class RateEstimator:
    """One replica's rates, learned from the router's own requests (exponentially weighted, `alpha` per
    observation), pulled toward `prior` with the weight of `prior_weight` observations."""

    def __init__(self, prior: Rates = PRIOR, alpha: float = 0.1, prior_weight: float = 1.0,
                 prior_blocks: float = 24.0):
        if not 0 < alpha <= 1 or prior_weight <= 0 or prior_blocks <= 0:
            raise ValueError("want 0 < alpha <= 1, prior_weight > 0 and prior_blocks > 0")
        self.alpha, self.prior_weight, self.prior_blocks = alpha, prior_weight, prior_blocks
        self._fit = DecayedLinearFit(alpha)
        self.step_ms = prior.ms_per_step
        self.steps = float(DEFAULT_STEPS)
        self.first_tokens = self.decodes = 0
        self.set_prior(prior)

    def set_prior(self, prior: Rates) -> None:
        """Pulls the fit toward `prior` from now on (the replica's own measurement, once it reports one:
        right from the first request on any hardware, and a replica that gets few requests is not left
        with a few old samples); the decode step is the prior's until a decode was observed."""
        self.prior = prior
        # The prior as two pseudo-observations that never decay: no blocks, and `prior_blocks` blocks.
        half, x = self.prior_weight / 2, self.prior_blocks
        self._fit.set_prior([(0.0, prior.overhead_ms, half), (x, prior.overhead_ms + prior.ms_per_block * x, half)])
        if not self.decodes:
            self.step_ms = prior.ms_per_step

    def first_token(self, blocks: float, ms: float) -> None:
        """A request sent while a slot was free had its first token after `ms`; `blocks` were prefilled
        before or with it (its own uncached blocks and those of the requests it found in their prefill)."""
        if not (blocks >= 0 and ms >= 0):
            return
        # Winsorized against the current fit: a first token that came late for reasons the router cannot
        # see (a long prefill that entered the same step, another process on the core) would otherwise pull
        # the replica's rate up several-fold, and the router then starves that replica (bench/RESULTS.md,
        # router round 6: one replica read 26.9 ms per block against 7.3 for its twins, and got 44 of 240
        # requests). A lasting change of rate still gets through, at most OUTLIER times the fit per observation.
        r = self.rates
        ms = min(ms, OUTLIER * (r.overhead_ms + r.ms_per_block * blocks) + r.ms_per_step)
        self._fit.add(blocks, ms)
        self.first_tokens += 1

    def decode(self, steps: int, ms: float) -> None:
        """A streamed request ran `steps` decode steps (its tokens after the first) in `ms`."""
        if steps < 1 or not ms >= 0:
            return
        self.step_ms += self.alpha * (ms / steps - self.step_ms)
        self.decodes += 1

    def output(self, tokens: int) -> None:
        """A request generated `tokens`: the typical length, for requests that do not set max_tokens and
        for other clients' sequences."""
        if tokens >= 1:
            self.steps += self.alpha * (tokens - self.steps)

    @property
    def rates(self) -> Rates:
        slope = self._fit.solve()[1]
        if slope is None:
            slope = self.prior.ms_per_block
        # A fit that says prefill is free or negative (a noisy few samples) is not a rate to route on.
        slope = max(slope, 0.05 * self.prior.ms_per_block)
        intercept = max(0.0, self._fit.intercept_at(slope))
        return Rates(ms_per_block=slope, ms_per_step=max(self.step_ms, 1e-3), overhead_ms=intercept)
