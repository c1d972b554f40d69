"""The router's replicas: health checks, load and KV-event polling, and the router's own estimates.

Each replica is polled on its own task: `GET /health` (a replica failing `fail_threshold` checks in a
row, or refusing a forwarded request, is taken out, its requests still waiting for a first byte are
re-sent elsewhere, and everything the router knew about its cache is dropped), `GET /load` (queue
depth, active KV blocks) and `GET /kv/events?after=N` (the index).
Reports are up to a poll interval old, so the router corrects them with its own changes since: active
blocks = reported - prompt blocks of its requests that finished since + uncached prompt blocks of its
requests sent since (a cached prefix is shared, not added); queued = reported - its requests finished
since. A burst arriving between two polls therefore spreads, and a replica that just finished a long
prompt does not look busy until the next poll. The router also times its own requests on each replica
(first token, spacing of the streamed tokens) for the replica's rates (`load_model.RateEstimator`, pulled
toward the rates the replica reports it measured of its own steps), and
knows which of them are still before their first token: those are the prefill ahead of a new request.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from server.router.index import EventIndex, RoutingHistory
from server.router.load_model import RateEstimator, first_token_ms, fleet_rates, split_open
from server.router.policy import ReplicaView, queued_estimate, wait_ms

logger = logging.getLogger(__name__)
_tickets = itertools.count()


@dataclass
class OpenRequest:
    """A request this router has open on a replica."""

    uncached: int              # prompt blocks it prefills there (as the router believed at routing)
    blocks: int                # prompt blocks
    steps: float               # decode steps it will run (its max_tokens, or the replica's typical length)
    sent_at: float             # monotonic seconds
    ahead: int                 # blocks prefilled before or with it: its own and those of requests it found in prefill
    free_slot: bool            # a slot was free when it was sent: its first-token time measures prefill alone
    first_at: float | None = None   # its first token (for a non-streamed request: when it was expected)
    choices: int = 1           # sequences it samples (n): its usage counts the tokens of all of them


@dataclass
class Replica:
    url: str
    history: RoutingHistory
    index: EventIndex = field(default_factory=EventIndex)
    healthy: bool = False
    failures: int = 0
    load: dict[str, Any] = field(default_factory=dict)   # the last /load answer
    # Requests this router has open there, oldest first (the replica queues FCFS).
    open: dict[int, OpenRequest] = field(default_factory=dict)
    # The router's own changes since the last /load report: blocks its new requests add (their uncached
    # prompt), and the requests that finished with the prompt blocks they held.
    opened_blocks: int = 0
    closed_blocks: int = 0
    closed_requests: int = 0
    num_routed: int = 0
    last_error: str = ""
    rates: RateEstimator = field(default_factory=RateEstimator)
    # Set when the replica is taken out: requests waiting for its first byte stop waiting and move on.
    out: asyncio.Event = field(default_factory=asyncio.Event)

    def view(self, hashes: list[int], events_max_age: float, now: float) -> ReplicaView:
        fresh = self.index.fresh(events_max_age, now)
        if fresh:   # the index, plus what was sent there too recently to show up in its events
            cached = max(self.index.matched(hashes), self.history.matched(hashes, now, within=events_max_age))
        else:
            cached = self.history.matched(hashes, now)
        queued = queued_estimate(self.in_flight, self.capacity, self.reported_waiting)
        rates = self.rates.rates
        pending, running = split_open([(o.uncached, o.blocks, o.steps, o.first_at) for o in self.open.values()],
                                      now, rates.ms_per_step)
        # Other clients' sequences in the slots: their lengths unknown, half a typical one left on average.
        others = max(0, int(self.load.get("num_running", 0)) - self.closed_requests - self.in_flight)
        running += [self.rates.steps / 2] * others
        return ReplicaView(
            name=self.url, cached_blocks=cached,
            active_blocks=max(0.0, self.load.get("active_kv_blocks", 0) - self.closed_blocks) + self.opened_blocks,
            queued=float(queued), in_flight=self.in_flight, pending=pending, running=tuple(running),
            capacity=self.capacity, rates=rates)

    @property
    def capacity(self) -> int:
        """Sequences it runs at once (its --max-num-seqs; 0 if its /load does not say)."""
        return int(self.load.get("max_num_seqs", 0))

    @property
    def reported_waiting(self) -> int:
        return max(0, int(self.load.get("num_waiting", 0)) - self.closed_requests)

    @property
    def in_flight(self) -> int:
        return len(self.open)

    def opened(self, hashes: list[int], new_blocks: int, prompt_blocks: int, steps: float | None = None,
               stream: bool = True, now: float | None = None, choices: int = 1) -> int:
        """Counts a request sent there (`steps`: its max_tokens, if it set one; `stream`: whether its first
        token will be seen; `choices`: sequences it samples, n); returns the ticket `first_token` and
        `closed` take back."""
        now = time.monotonic() if now is None else now
        self.num_routed += 1
        self.opened_blocks += new_blocks
        self.history.record(hashes)
        prefilling = sum(o.uncached for o in self.open.values() if o.first_at is None or o.first_at > now)
        free_slot = queued_estimate(self.in_flight + 1, self.capacity, self.reported_waiting) == 0
        entry = OpenRequest(new_blocks, prompt_blocks, float(steps) if steps else self.rates.steps, now,
                            new_blocks + prefilling, free_slot, choices=max(1, choices))
        if not stream:      # no first token to see: assume it came when expected
            view = self.view(hashes, 0.0, now)
            expected = first_token_ms(view.rates, wait_ms(view, prompt_blocks, entry.steps), new_blocks)
            entry.first_at = now + expected / 1000.0
        ticket = next(_tickets)
        self.open[ticket] = entry
        return ticket

    def first_token(self, ticket: int, now: float | None = None) -> None:
        """The request's first streamed bytes arrived (the replica sends nothing before its first token)."""
        entry = self.open.get(ticket)
        if entry is None or entry.first_at is not None:
            return
        entry.first_at = time.monotonic() if now is None else now
        if entry.free_slot:
            self.rates.first_token(entry.ahead, 1000.0 * (entry.first_at - entry.sent_at))

    def closed(self, ticket: int, completion_tokens: int | None = None, now: float | None = None,
               streamed: bool = False) -> None:
        """The request ended; `completion_tokens` from its usage, if the router saw it; `streamed`: its
        tokens after the first arrived one by one, so their spacing is the replica's decode step."""
        entry = self.open.pop(ticket, None)
        if entry is None:
            return
        self.closed_blocks += entry.blocks
        self.closed_requests += 1
        if completion_tokens:
            now = time.monotonic() if now is None else now
            tokens = completion_tokens // entry.choices     # its choices decode side by side
            if streamed and entry.first_at is not None and tokens > 1:
                self.rates.decode(tokens - 1, 1000.0 * (now - entry.first_at))
            self.rates.output(tokens)

    def reported(self, load: dict[str, Any]) -> None:
        self.load = load
        self.opened_blocks = self.closed_blocks = self.closed_requests = 0

    def forget(self) -> None:
        """Out of rotation: nothing believed about its cache or load survives (its rates do: the same
        replica coming back runs at the same speed)."""
        self.healthy = False
        self.out.set()
        self.index.clear()
        self.history.clear()
        self.reported({})


class ReplicaPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, *, poll_interval: float = 0.25,
                 health_interval: float = 1.0, fail_threshold: int = 2, events_max_age: float = 2.0,
                 history_ttl: float = 120.0, headers: dict[str, str] | None = None):
        if not urls:
            raise ValueError("the router needs at least one --replica URL")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {urls}")
        self.replicas = {u: Replica(u, RoutingHistory(history_ttl)) for u in urls}
        self.client = client
        self.poll_interval, self.health_interval = poll_interval, health_interval
        self.fail_threshold, self.events_max_age = fail_threshold, events_max_age
        self.headers = headers or {}
        self.block_size: int | None = None
        self._tasks: list[asyncio.Task] = []

    # -- views --------------------------------------------------------------------------------------------
    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def views(self, hashes: list[int], exclude: set[str]) -> list[ReplicaView]:
        now = time.monotonic()
        return [r.view(hashes, self.events_max_age, now) for r in self.healthy() if r.url not in exclude]

    def mark_failed(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            logger.warning("replica %s taken out: %s", replica.url, why)
        replica.last_error = why
        replica.failures = max(replica.failures, self.fail_threshold)
        replica.forget()

    # -- polling ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas.values()))
        self._tasks = [asyncio.create_task(self._loop(r)) for r in self.replicas.values()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    async def _loop(self, replica: Replica) -> None:
        last_health = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_interval)
            if time.monotonic() - last_health >= self.health_interval or not replica.healthy:
                last_health = time.monotonic()
                await self.check(replica)
            elif replica.healthy:
                await self.poll(replica)

    async def check(self, replica: Replica) -> None:
        """One health check; a healthy replica is then polled for load and events at once."""
        try:
            r = await self.client.get(replica.url + "/health", timeout=max(1.0, self.health_interval))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
        if not ok:
            replica.failures += 1
            replica.last_error = why
            if replica.failures >= self.fail_threshold:
                self.mark_failed(replica, why)
            return
        if not replica.healthy:
            logger.info("replica %s is healthy", replica.url)
            replica.out = asyncio.Event()
        replica.failures = 0
        replica.healthy = True
        await self.poll(replica)

    async def poll(self, replica: Replica) -> None:
        try:
            r = await self.client.get(replica.url + "/load", headers=self.headers, timeout=2.0)
            r.raise_for_status()
            self.reported(replica, r.json())
            self._check_block_size(replica, replica.load.get("block_size"))
            more = True
            while more:
                r = await self.client.get(replica.url + "/kv/events", headers=self.headers, timeout=2.0,
                                          params={"after": replica.index.cursor,
                                                  **({"replica_id": replica.index.replica_id}
                                                     if replica.index.replica_id else {})})
                r.raise_for_status()
                more = replica.index.apply(r.json())
        except (httpx.HTTPError, ValueError, KeyError) as e:
            # Load or events missing: routing falls back to the router's own history for this replica.
            replica.last_error = f"poll failed: {type(e).__name__}: {e}"
            logger.debug("replica %s: %s", replica.url, replica.last_error)

    def reported(self, replica: Replica, load: dict[str, Any]) -> None:
        """A replica's /load answer. What the replicas measured of their own steps becomes each one's rate
        prior (`load_model.fleet_rates`: a replica that has not measured yet borrows its twins')."""
        replica.reported(load)
        replicas = list(self.replicas.values())
        for rep, prior in zip(replicas, fleet_rates([rep.load for rep in replicas])):
            rep.rates.set_prior(prior)

    def _check_block_size(self, replica: Replica, block_size: Any) -> None:
        if block_size is None:
            return
        if self.block_size is None:
            self.block_size = int(block_size)
        elif int(block_size) != self.block_size:
            raise ValueError(f"replica {replica.url} uses --block-size {block_size}, the others "
                             f"{self.block_size}: their block hashes cannot be compared")
