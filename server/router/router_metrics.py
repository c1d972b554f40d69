"""The router's own Prometheus metrics (GET /metrics on the router): decisions, retries, and each
replica's score and state as of the last decision."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from server.router.pool import ReplicaPool


class RouterMetrics:
    def __init__(self, pool: ReplicaPool, policy: str):
        self.pool = pool
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("namazu_router_decisions", "requests routed, by replica and policy",
                                 ["replica", "policy"], registry=r)
        self.retries = Counter("namazu_router_retries", "requests re-sent elsewhere after a replica failed "
                               "before streaming anything", ["replica"], registry=r)
        self.failed = Counter("namazu_router_failed_requests", "requests no replica could serve", registry=r)
        self.prompt_blocks = Counter("namazu_router_prompt_blocks", "prompt blocks of routed requests",
                                     registry=r)
        self.matched_blocks = Counter("namazu_router_predicted_cached_blocks", "prompt blocks the router "
                                      "expected the chosen replica to have cached", registry=r)
        self.cost = Gauge("namazu_router_replica_cost", "the replica's cost at the last decision (lower wins "
                          "among the replicas the spill rule allows)", ["replica"], registry=r)
        self.healthy = Gauge("namazu_router_replica_healthy", "1 if the replica is in rotation",
                             ["replica"], registry=r)
        self.cached = Gauge("namazu_router_replica_indexed_blocks", "block hashes the router's index holds "
                            "for the replica", ["replica"], registry=r)
        self.active = Gauge("namazu_router_replica_active_kv_blocks", "active KV blocks the replica "
                            "reported last", ["replica"], registry=r)
        self.queued = Gauge("namazu_router_replica_queue_depth", "requests waiting on the replica, as "
                            "reported last", ["replica"], registry=r)
        self.in_flight = Gauge("namazu_router_replica_in_flight", "requests this router has open there",
                               ["replica"], registry=r)
        self.ms_per_block = Gauge("namazu_router_replica_prefill_ms_per_block", "the router's estimate of the "
                                  "replica's prefill time per uncached prompt block", ["replica"], registry=r)
        self.ms_per_step = Gauge("namazu_router_replica_decode_step_ms", "the router's estimate of the "
                                 "replica's decode step time", ["replica"], registry=r)
        for url in pool.replicas:
            self.decisions.labels(url, policy)
            self.retries.labels(url)

    def render(self) -> bytes:
        for url, rep in self.pool.replicas.items():
            self.healthy.labels(url).set(1.0 if rep.healthy else 0.0)
            self.cached.labels(url).set(len(rep.index.hashes))
            self.active.labels(url).set(float(rep.load.get("active_kv_blocks", 0)))
            self.queued.labels(url).set(float(rep.load.get("num_waiting", 0)))
            self.in_flight.labels(url).set(rep.in_flight)
            rates = rep.rates.rates
            self.ms_per_block.labels(url).set(rates.ms_per_block)
            self.ms_per_step.labels(url).set(rates.ms_per_step)
        return generate_latest(self.registry)
