"""namazu's KV-aware cost as a Ray Serve custom request router.

Ray Serve calls `choose_replicas` in the process holding the deployment handle (the ingress) for every
request. The ingress passes the prompt's block hashes as the request's third argument; each engine
replica publishes, through `record_routing_stats`, a snapshot of its KV events log (replica id, last
event id, every stored block hash) with its queue depth and active KV blocks. The snapshot feeds the
same `EventIndex` the HTTP router uses, the router's own routing history covers what the snapshot
cannot show yet, and the cost is `server.router.policy`'s, so both paths route alike. The wait is priced at
the rates each replica measures of its own steps (`namazu.engine.step_rate_fit`), since first tokens are not seen here.
"""
from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

import server.ray_serve.routing_state as decisions
from server.router.index import EventIndex, RoutingHistory
from server.router.load_model import DEFAULT_STEPS, Rates, first_token_ms, fleet_rates, split_open
from server.router.policy import (
    DEFAULT_PREFIX_WEIGHT,
    DEFAULT_QUEUE_WEIGHT,
    DEFAULT_SPILL_FACTOR,
    ReplicaView,
    make_policy,
    queued_estimate,
    wait_ms,
)


class NamazuRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "kv", prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
                         queue_weight: float = DEFAULT_QUEUE_WEIGHT, history_ttl: float = 120.0, recent_s: float = 5.0,
                         spill_factor: float = DEFAULT_SPILL_FACTOR, **_: Any) -> None:
        self.policy = make_policy(policy, prefix_weight, queue_weight, spill_factor=spill_factor)
        self.history_ttl, self.recent_s = history_ttl, recent_s
        self._index: dict[str, EventIndex] = {}
        self._history: dict[str, RoutingHistory] = {}
        # internal request id -> (replica, uncached prompt blocks, prompt blocks, decode steps, monotonic time
        # its first token was expected), oldest first
        self._open: dict[str, tuple[str, int, int, float, float]] = {}

    def _view(self, replica: RunningReplica, hashes: list[int], now: float, rates: Rates) -> ReplicaView:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        index = self._index.setdefault(rid, EventIndex())
        history = self._history.setdefault(rid, RoutingHistory(self.history_ttl))
        if "replica_id" in stats and (stats["replica_id"], stats["last_id"]) != (index.replica_id, index.cursor):
            index.apply({"replica_id": stats["replica_id"], "last_id": stats["last_id"],
                         "snapshot": stats["hashes"], "events": []}, now)
        cached = max(index.matched(hashes), history.matched(hashes, now, within=self.recent_s))
        mine = [(u, b, n, t) for r, u, b, n, t in self._open.values() if r == rid]
        open_blocks = sum(u for u, _, _, _ in mine)
        capacity = int(stats.get("max_num_seqs", 0))
        queued = queued_estimate(len(mine), capacity, float(stats.get("num_waiting", 0)))
        queue_len = self.replica_queue_len_cache.get(replica.replica_id) or 0
        decisions.observe(rid, indexed_blocks=len(index.hashes), history_blocks=len(history),
                          open_requests=len(mine),
                          namazu_replica_id=stats.get("replica_id"), pid=stats.get("pid"),
                          warm_at=stats.get("warm_at"))
        # Ray Serve does not show this router a request's first token: a request counts as in its prefill
        # (ahead of a new one) until its first token was expected, then as decoding from then on. For the
        # same reason the rates are the replicas' own measurements of their steps (`rates`), not learned here.
        pending, running = split_open(mine, now, rates.ms_per_step)
        return ReplicaView(rid, cached, max(float(stats.get("active_kv_blocks", 0)), float(open_blocks)),
                           float(queued), int(queue_len), pending, tuple(running), capacity, rates)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        info = _route_info(pending_request)
        hashes, blocks = info.get("hashes", []), int(info.get("prompt_blocks", 0))
        steps = float(info.get("max_tokens") or DEFAULT_STEPS)
        now = time.monotonic()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        rates = fleet_rates([r.routing_stats or {} for r in candidate_replicas])
        views = [self._view(r, hashes, now, rate) for r, rate in zip(candidate_replicas, rates)]
        decision = self.policy.choose(views, blocks, steps)
        self._history[decision.replica].record(hashes, now)
        decisions.record_costs(decision.costs)
        if pending_request is not None:     # what it adds there: the blocks not cached yet
            chosen = next(v for v in views if v.name == decision.replica)
            uncached = max(1, blocks - chosen.cached_blocks)
            expected = first_token_ms(chosen.rates, wait_ms(chosen, blocks, steps), uncached)
            self._open[pending_request.metadata.internal_request_id] = (decision.replica, uncached, blocks, steps,
                                                                        now + expected / 1000.0)
        # The chosen replica first; the rest by cost, so a full replica falls through to the next best.
        rest = sorted((r for rid, r in by_id.items() if rid != decision.replica),
                      key=lambda r: decision.costs.get(r.replica_id.unique_id, 0.0))
        return [[by_id[decision.replica]]] + ([rest] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        # choose_replicas may run several times for one request (a full replica, backoff); count here.
        decisions.record(replica_id.unique_id)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._open.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        # A request to it failed with ActorDiedError before the controller noticed.
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # The controller's view of the deployment: a replica that died, was replaced or drained is gone
        # from it, and so is everything this router believed about that replica.
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in set(self._index) | set(self._history) | {v[0] for v in self._open.values()}:
            if rid not in live:
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._index.pop(rid, None)
        self._history.pop(rid, None)
        self._open = {k: v for k, v in self._open.items() if v[0] != rid}
        decisions.forget(rid)


def _route_info(pending_request: PendingRequest | None) -> dict[str, Any]:
    if pending_request is None:
        return {}
    for arg in pending_request.args:
        if isinstance(arg, dict) and "hashes" in arg:
            return arg
    return {}
