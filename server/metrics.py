"""Prometheus metrics of the server and its engine (GET /metrics).

Latencies are measured where the client sees them: from the moment the request body is parsed to the
first generated token (TTFT), between successive tokens of one sequence (inter-token latency, one
observation per token, so a step that delivers k tokens at once counts k gaps of dt/k), and to the last
token (end-to-end). Engine state (running/waiting sequences, KV usage, prefix-cache hits) is read from
`engine.stats()` at scrape time, so scraping costs nothing between scrapes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    """Reads engine.stats() when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        gauges = {
            "num_requests_running": ("num_running", "sequences in the engine's running batch"),
            "num_requests_waiting": ("num_waiting", "sequences waiting to be scheduled"),
            "kv_cache_usage_ratio": ("kv_cache_usage", "fraction of KV-cache blocks held by live sequences"),
            "peak_num_running": ("peak_num_running", "most sequences that shared one engine step"),
            "num_kv_blocks": ("num_kv_blocks", "KV-cache blocks in the pool"),
        }
        for name, (key, doc) in gauges.items():
            if key in s:
                yield GaugeMetricFamily(f"namazu_{name}", doc, value=float(s[key]))
        q, h = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        yield GaugeMetricFamily("namazu_prefix_cache_hit_rate", "prompt tokens served from the prefix "
                                "cache / prompt tokens looked up, since start", value=h / q if q else 0.0)
        yield CounterMetricFamily("namazu_prefix_cache_queries", "prompt tokens looked up in the prefix "
                                  "cache", value=float(q))
        yield CounterMetricFamily("namazu_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                  value=float(h))
        for key, doc in (("num_preemptions", "sequences preempted by recompute"),
                         ("num_steps", "engine steps run")):
            if key in s:
                yield CounterMetricFamily(f"namazu_{key}", doc, value=float(s[key]))


class ServerMetrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        disable_created_metrics()      # the *_created series only double the scrape size
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("namazu_http_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("namazu_request_success", "finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("namazu_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.cached_tokens = Counter("namazu_cached_prompt_tokens", "prompt tokens served from the prefix "
                                     "cache", registry=r)
        self.generation_tokens = Counter("namazu_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("namazu_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("namazu_inter_token_latency_seconds", "time between successive tokens of a "
                             "sequence", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("namazu_e2e_request_latency_seconds", "request arrival to its last token",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Timing of one HTTP request (all its prompts and sequences)."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last: dict[tuple[int, int], float] = {}   # (prompt, seq index) -> time of its latest token

    def on_prompt(self, num_prompt_tokens: int) -> None:
        self.m.prompt_tokens.inc(num_prompt_tokens)

    def on_cached(self, num_cached_tokens: int) -> None:
        self.m.cached_tokens.inc(num_cached_tokens)

    def on_tokens(self, key: tuple[int, int], num_new: int) -> None:
        if num_new <= 0:
            return
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.m.ttft.observe(now - self.arrival)
        prev = self.last.get(key)
        if prev is not None:
            gap = (now - prev) / num_new
            for _ in range(num_new):
                self.m.itl.observe(gap)
        self.last[key] = now
        self.m.generation_tokens.inc(num_new)

    def on_finish(self, reason: str | None) -> None:
        self.m.finished.labels(reason or "unknown").inc()

    def done(self) -> None:
        self.m.e2e.observe(time.perf_counter() - self.arrival)
