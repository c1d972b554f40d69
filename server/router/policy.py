"""Routing policies. The KV-aware one is Dynamo's cost (see docs/router.md) plus the wait queued ahead:

    cost = w * (prompt blocks not cached there) + (active KV blocks there, the new request's included)
           + q * (w * wait there / ms per prefill block + the blocks the requests ahead will hold)
           + q * w * (prompt blocks not cached there - the fewest not cached on any replica) * (queued there)

lowest cost wins, ties broken at random, among the replicas a spill rule allows: the prompt's home (the
replicas caching most of it) always, another replica only when the wait at the home exceeds the other's
by more than `spill` x the milliseconds the move costs (the blocks it recomputes there x that replica's
ms per prefill block). The wait is time, not blocks (`load_model.py`): the prefill queued ahead plus the
decode steps until a slot (--max-num-seqs) frees, from rates the router measures per replica. Pricing
the wait in blocks valued a request stuck behind full slots at a fifth of its real wait, and the tail of
the KV-aware router was requests that waited seconds at their home (bench/RESULTS.md). A queued request
of another client's counts as one like the new one with nothing cached. Load is always blended in: pure
cache affinity piles every request that shares a hot prefix onto one replica (the "death spiral"); that
policy is kept here only as a baseline for the benchmark.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from server.router.load_model import DEFAULT_STEPS, PRIOR, Pending, Rates, expected_wait_ms

# w: a prompt block the replica must compute, against a block of KV its running sequences hold. Above 1
# because on compute-bound replicas (CPU, small models) recomputing a block of prompt costs far more
# than decoding next to one more held block; bench/router.py measured w=1 spreading shared prefixes
# until the KV-aware router computed 0.9x round-robin's prompt tokens at 4 req/s, w=4 0.48x.
DEFAULT_PREFIX_WEIGHT = 4.0
# q: scales the queue term (1: a queued request costs exactly its own work, in the prefix term's units).
DEFAULT_QUEUE_WEIGHT = 1.0
# spill: a prompt leaves its home only when the wait there exceeds the other replica's by more than spill x
# the milliseconds the move recomputes there. 1 prices only this request's own prefill; but that prefill
# also stalls the sequences running beside it there, and every recompute is capacity the fleet no longer
# has. Without the rule (the plain cost) running sequences alone moved conversations: the real fleet
# recomputed 0.72x round-robin's prompt tokens past saturation. On the simulated fleet
# (bench/router_capacity.py, 94 req/s, round-robin's highest sustained rate; TTFT p99 round-robin / kv):
# spill 0.5 computed 0.82x round-robin's prompt blocks, p99 1.97x lower; 1: 0.79x, 1.82x; 1.5: 0.72x,
# 2.00x; 2: 0.63x, 1.91x; 3: 0.62x, 1.48x; 4: 0.61x, 1.13x (the homes queue longer).
DEFAULT_SPILL_FACTOR = 2.0


@dataclass
class ReplicaView:
    """What a policy knows about one replica when a request arrives."""

    name: str
    cached_blocks: int      # leading blocks of this prompt the replica is believed to hold
    active_blocks: float    # KV blocks held by its live sequences (reported, or the router's estimate)
    queued: float           # requests waiting there for a slot (reported, or the router's estimate)
    in_flight: int          # requests this router has open there
    # this router's requests there without a first token yet (queued or in their prefill), oldest first;
    # other clients' queued requests are the part of `queued` these do not explain
    pending: tuple[Pending, ...] = ()
    running: tuple[float, ...] = ()     # decode steps left of the sequences holding its slots
    capacity: int = 0                   # sequences it runs at once (--max-num-seqs; 0: unknown)
    rates: Rates = PRIOR                # its measured ms per prefill block and per decode step


@dataclass
class Decision:
    replica: str
    costs: dict[str, float]     # per-replica score the decision was made on (empty for load-blind policies)


class Policy(Protocol):
    name: str

    def choose(self, views: list[ReplicaView], prompt_blocks: int, steps: float = DEFAULT_STEPS) -> Decision: ...


def queued_estimate(in_flight: int, capacity: int, reported_waiting: float) -> int:
    """Requests waiting on a replica: this router's open requests beyond the sequences the replica runs at
    once (`capacity`, its --max-num-seqs; 0 when unknown), known without a poll's lag so that a burst
    between two polls does not herd onto the replica that looked idle; or the replica's own report if
    other clients queued more."""
    return int(max(in_flight - capacity if capacity > 0 else 0, reported_waiting, 0))


def others_queued(view: ReplicaView) -> float:
    """Requests queued there that are not this router's (their size unknown)."""
    free = max(0, view.capacity - len(view.running)) if view.capacity > 0 else len(view.pending)
    return max(0.0, view.queued - max(0, len(view.pending) - free))


def wait_ms(view: ReplicaView, prompt_blocks: int, steps: float = DEFAULT_STEPS) -> float:
    """The new request's expected wait there before its own prefill (`load_model.expected_wait_ms`)."""
    return expected_wait_ms(view.rates, view.pending, view.running, view.capacity, others_queued(view),
                            prompt_blocks, steps)


def _pick_min(scores: dict[str, float], rng: random.Random) -> str:
    best = min(scores.values())
    return rng.choice([name for name, s in scores.items() if s <= best + 1e-9])


class KVAwarePolicy:
    name = "kv"

    def __init__(self, prefix_weight: float = DEFAULT_PREFIX_WEIGHT, queue_weight: float = DEFAULT_QUEUE_WEIGHT,
                 seed: int | None = None, spill_factor: float = DEFAULT_SPILL_FACTOR):
        if prefix_weight < 0 or queue_weight < 0 or spill_factor < 0:
            raise ValueError("the router's prefix, queue and spill weights must be >= 0")
        self.w, self.q, self.spill = prefix_weight, queue_weight, spill_factor
        self.rng = random.Random(seed)

    def cost(self, view: ReplicaView, prompt_blocks: int, steps: float = DEFAULT_STEPS) -> float:
        uncached = max(0, prompt_blocks - view.cached_blocks)
        return (self.w * uncached + view.active_blocks + prompt_blocks
                + self.q * self.queued_work(view, prompt_blocks, steps))

    def queued_work(self, view: ReplicaView, prompt_blocks: int, steps: float = DEFAULT_STEPS) -> float:
        """The wait ahead of a new request there in the prefix term's units (w per block of prefill it
        could have run in that time), plus the blocks the requests ahead will hold."""
        held = sum(p.blocks for p in view.pending) + others_queued(view) * prompt_blocks
        return self.w * wait_ms(view, prompt_blocks, steps) / view.rates.ms_per_block + held

    def choose(self, views: list[ReplicaView], prompt_blocks: int, steps: float = DEFAULT_STEPS) -> Decision:
        uncached = {v.name: max(0, prompt_blocks - v.cached_blocks) for v in views}
        least = min(uncached.values(), default=0)
        costs = {v.name: self.cost(v, prompt_blocks, steps) + self.recompute_cost(v, prompt_blocks, least)
                 for v in views}
        # The spill rule: the home is the least loaded replica caching most of the prompt; another one is
        # allowed only when the wait at the home costs more than recomputing there (see DEFAULT_SPILL_FACTOR).
        # Prompts cached nowhere, or everywhere alike, have every replica as home: load alone decides.
        delay = {v.name: self.delay(v, prompt_blocks, steps) for v in views}
        ms_per_block = {v.name: v.rates.ms_per_block for v in views}
        home = min((delay[n] for n, u in uncached.items() if u == least), default=0.0)
        allowed = {n: c for n, c in costs.items()
                   if uncached[n] == least or home - delay[n] > self.spill * ms_per_block[n] * (uncached[n] - least)}
        return Decision(_pick_min(allowed, self.rng), costs)

    def delay(self, view: ReplicaView, prompt_blocks: int, steps: float = DEFAULT_STEPS) -> float:
        """The milliseconds a new request waits there before its own prefill."""
        return wait_ms(view, prompt_blocks, steps)

    def recompute_cost(self, view: ReplicaView, prompt_blocks: int, least_uncached: int) -> float:
        """What recomputing a prefix cached elsewhere costs the others on a busy replica. The first terms
        price only this request's own wait; the extra prefill also delays every request that queues behind
        it there, in a stationary queue about as many as queue ahead of it now. Without this, past
        saturation a hot prefix spread to every replica as soon as its home queued a little, and the fleet
        recomputed it everywhere and served fewer requests (tests/server/router/test_router_capacity.py). An idle
        replica has nobody behind: spilling there is free, so the queue at a prefix's home stays bounded."""
        extra = max(0, prompt_blocks - view.cached_blocks) - least_uncached
        return self.q * self.w * extra * view.queued


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, seed: int | None = None):
        self._turn = itertools.count()

    def choose(self, views: list[ReplicaView], prompt_blocks: int, steps: float = DEFAULT_STEPS) -> Decision:
        return Decision(views[next(self._turn) % len(views)].name, {})


class PowerOfTwoPolicy:
    """Two replicas at random; the one with fewer requests open wins (Ray Serve's default)."""

    name = "p2c"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, views: list[ReplicaView], prompt_blocks: int, steps: float = DEFAULT_STEPS) -> Decision:
        pair = self.rng.sample(views, min(2, len(views)))
        load = {v.name: float(v.in_flight + v.queued) for v in pair}
        return Decision(_pick_min(load, self.rng), load)


class PrefixAffinityPolicy:
    """The replica holding the longest cached prefix, load ignored: the death-spiral baseline."""

    name = "affinity"

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def choose(self, views: list[ReplicaView], prompt_blocks: int, steps: float = DEFAULT_STEPS) -> Decision:
        scores = {v.name: float(-v.cached_blocks) for v in views}
        return Decision(_pick_min(scores, self.rng), scores)


POLICIES = {p.name: p for p in (KVAwarePolicy, RoundRobinPolicy, PowerOfTwoPolicy, PrefixAffinityPolicy)}


def make_policy(name: str, prefix_weight: float = DEFAULT_PREFIX_WEIGHT, queue_weight: float = DEFAULT_QUEUE_WEIGHT,
                seed: int | None = None, spill_factor: float = DEFAULT_SPILL_FACTOR) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "kv":
        return KVAwarePolicy(prefix_weight, queue_weight, seed, spill_factor)
    return POLICIES[name](seed)
