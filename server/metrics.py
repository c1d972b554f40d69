"""Prometheus metrics of the server and its engine (GET /metrics).

Latencies are measured where the client sees them: from the moment the request body is parsed to the
first generated token (TTFT), between successive tokens of one sequence (inter-token latency, one
observation per token, so a step that delivers k tokens at once counts k gaps of dt/k), and to the last
token (end-to-end). Engine state (running/waiting sequences, KV usage, prefix-cache hits) is read from
`engine.stats()` at scrape time, so scraping costs nothing between scrapes.

Names follow Prometheus conventions (seconds, counters end in `_total`) and every series of a server
carries `model_name` (the served model name), as vLLM's dashboards select on. Two millisecond gauges keep
their old names beside the new seconds ones (`namazu_decode_step_ms`, `namazu_prefill_block_ms`): the
KV-aware router's tests and dashboards built on it read them; they are deprecated.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


# Engine statistics under the names dashboards expect; any other numeric field is exported as
# namazu_engine_<field> (a counter if listed in _MONOTONIC, else a gauge), so new engine stats show up
# without touching this file.
_RENAMED = {
    "num_running": ("namazu_num_requests_running", "sequences in the engine's running batch"),
    "num_waiting": ("namazu_num_requests_waiting", "sequences waiting to be scheduled"),
    "kv_cache_usage": ("namazu_kv_cache_usage_ratio", "fraction of KV-cache blocks held by live sequences"),
    "prefix_cache_hit_rate": ("namazu_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / "
                              "prompt tokens admitted, since start"),
    "ms_per_decode_step": ("namazu_decode_step_ms", "deprecated: namazu_decode_step_seconds in milliseconds"),
    "ms_per_prefill_block": ("namazu_prefill_block_ms", "deprecated: namazu_prefill_block_seconds in "
                             "milliseconds"),
    "peak_num_running": ("namazu_peak_num_running", "most sequences that shared one engine step"),
    "requests_in_flight": ("namazu_requests_in_flight", "engine requests the server is streaming now"),
    "peak_requests_in_flight": ("namazu_peak_requests_in_flight", "most engine requests in flight at once"),
}
_MONOTONIC = {"num_preemptions", "num_steps", "num_prompt_tokens", "num_generated_tokens", "num_draft_tokens",
              "num_accepted_draft_tokens", "prefix_cache_queries", "prefix_cache_hits",
              "grammar_cache_hits", "grammar_cache_misses", "grammar_mask_rows", "grammar_mask_seconds",
              "drafter_seconds", "num_draft_blocks", "num_drafts_proposed", "num_spec_disabled_steps",
              "num_draft_rows", "num_drafter_swaps", "shadow_seconds"}
# Counters under the names vLLM's dashboards use (vllm:prefix_cache_queries / _hits): the hit rate over any
# window is rate(hits) / rate(queries); namazu_prefix_cache_hit_rate stays the since-start ratio.
_COUNTERS = {
    "prefix_cache_queries": ("namazu_prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("namazu_prefix_cache_hits", "prompt tokens found in the prefix cache"),
}
# Millisecond statistics, also exported in seconds under these names.
_SECONDS = {
    "ms_per_decode_step": ("namazu_decode_step_seconds", "measured duration of an engine step of decodes (the "
                           "KV-aware router's wait estimate; 0 until measured)"),
    "ms_per_prefill_block": ("namazu_prefill_block_seconds", "measured time one more prompt block adds to an "
                             "engine step (0 until measured)"),
}


class _EngineCollector(Collector):
    """Reads the engine's statistics when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any]], const: dict[str, str]):
        self.stats = stats
        self.const = const

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        f = _Families(self.const)
        yield from _speculation_metrics(stats, f)
        yield from _drafter_metrics(stats, f)
        yield from _shadow_metrics(stats, f)
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in _SECONDS:
                yield f.gauge(*_SECONDS[key], float(value) / 1000.0)
            if key in _RENAMED:
                yield f.gauge(*_RENAMED[key], float(value))
            elif key in _COUNTERS:
                yield f.counter(*_COUNTERS[key], float(value))
            elif key in _MONOTONIC:
                yield f.counter(f"namazu_engine_{key}", f"engine statistic {key}", float(value))
            else:
                yield f.gauge(f"namazu_engine_{key}", f"engine statistic {key}", float(value))


class _Families:
    """Metric families with the server's constant labels (model_name), or none."""

    def __init__(self, const: dict[str, str]):
        self.names, self.values = list(const), list(const.values())

    def _one(self, family: Any, value: float) -> Any:
        family.add_metric(self.values, value)
        return family

    def gauge(self, name: str, doc: str, value: float) -> Any:
        if not self.names:
            return GaugeMetricFamily(name, doc, value=value)
        return self._one(GaugeMetricFamily(name, doc, labels=self.names), value)

    def counter(self, name: str, doc: str, value: float) -> Any:
        if not self.names:
            return CounterMetricFamily(name, doc, value=value)
        return self._one(CounterMetricFamily(name, doc, labels=self.names), value)

    def histogram(self, name: str, doc: str, buckets: list, sum_value: float) -> Any:
        if not self.names:
            return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum_value)
        h = HistogramMetricFamily(name, doc, labels=self.names)
        h.add_metric(self.values, buckets, sum_value)
        return h


def _histogram_buckets(hist: list[int]) -> tuple[list, float]:
    """Prometheus buckets of a histogram of verify steps per acceptance length (index i: i + 1 tokens)."""
    cum, buckets = 0, []
    for i, n in enumerate(hist):
        cum += n
        buckets.append((str(float(i + 1)), cum))
    buckets.append(("+Inf", cum))
    return buckets, float(sum((i + 1) * n for i, n in enumerate(hist)))


def _drafter_metrics(stats: dict[str, Any], f: _Families) -> Iterator[Any]:
    """Acceptance per drafter id (the series above split at each drafter swap), and which one serves."""
    by = stats.get("acceptance_by_drafter") or {}
    if not by:
        return
    names, values = f.names + ["drafter"], f.values
    hist = HistogramMetricFamily("namazu_spec_drafter_acceptance_length", "tokens emitted per verify step, by "
                                 "the drafter that made the drafts", labels=names)
    drafted = CounterMetricFamily("namazu_spec_drafter_draft_tokens", "drafts verified, by drafter", labels=names)
    accepted = CounterMetricFamily("namazu_spec_drafter_accepted_tokens", "drafts accepted, by drafter",
                                   labels=names)
    for drafter, tally in sorted(by.items()):
        hist.add_metric([*values, drafter], *_histogram_buckets(tally["acceptance_length_histogram"]))
        drafted.add_metric([*values, drafter], float(tally["num_draft_tokens"]))
        accepted.add_metric([*values, drafter], float(tally["num_accepted_draft_tokens"]))
    serving = GaugeMetricFamily("namazu_spec_drafter_serving", "1 for the drafter serving now", labels=names)
    serving.add_metric([*values, str(stats.get("drafter_id", ""))], 1.0)
    yield from (hist, drafted, accepted, serving)


def _shadow_metrics(stats: dict[str, Any], f: _Families) -> Iterator[Any]:
    """A shadow drafter's scores (`namazu/spec/shadow.py`), labelled by drafter id and role: role="shadow" the
    shadow's blocks, role="serving" the serving drafter's verify steps on the same (shadowed) sequences."""
    by = stats.get("shadow_acceptance") or {}
    if not by:
        return
    names, values = f.names + ["drafter", "role"], f.values
    hist = HistogramMetricFamily("namazu_spec_shadow_acceptance_length", "tokens per verify step on the shadowed "
                                 "requests: the shadow drafter's exact-rule blocks (role shadow; T=0, seeded, or "
                                 "drafted without q) and the serving drafter's steps (role serving)", labels=names)
    expected = CounterMetricFamily("namazu_spec_shadow_expected_acceptance_length_sum", "sum of the shadow's "
                                   "expected tokens per verify step over its ratio-rule blocks (T > 0, unseeded)",
                                   labels=names)
    blocks = CounterMetricFamily("namazu_spec_shadow_blocks", "shadow draft blocks scored, by rule",
                                 labels=[*names, "rule"])
    short = CounterMetricFamily("namazu_spec_shadow_unscored_blocks", "shadow blocks scored on fewer positions than "
                                "drafted (truncated: the target's rows left its path) or not at all (dropped)",
                                labels=[*names, "why"])
    mean = GaugeMetricFamily("namazu_spec_shadow_mean_acceptance_length", "the shadow's mean tokens per verify "
                             "step over every scored block, since start", labels=names)
    serving_id = str(stats.get("drafter_id", ""))
    for drafter, t in sorted(by.items()):
        hist.add_metric([*values, drafter, "shadow"], *_histogram_buckets(t["acceptance_length_histogram"]))
        hist.add_metric([*values, serving_id, "serving"],
                        *_histogram_buckets(t["serving_acceptance_length_histogram"]))
        expected.add_metric([*values, drafter, "shadow"], float(t["expected_acceptance_length_sum"]))
        blocks.add_metric([*values, drafter, "shadow", "exact"], float(t["num_exact_blocks"]))
        blocks.add_metric([*values, drafter, "shadow", "expected"], float(t["num_expected_blocks"]))
        short.add_metric([*values, drafter, "shadow", "truncated"], float(t["num_truncated_blocks"]))
        short.add_metric([*values, drafter, "shadow", "dropped"], float(t["num_dropped_blocks"]))
        mean.add_metric([*values, drafter, "shadow"], float(t["mean_acceptance_length"]))
    steps = stats.get("num_steps", 0)
    yield from (hist, expected, blocks, short, mean)
    yield f.gauge("namazu_spec_shadow_seconds_per_step", "shadow drafter wall time per engine step (context, "
                  "drafting, scoring), mean since start", stats.get("shadow_seconds", 0.0) / steps if steps else 0.0)


def _speculation_metrics(stats: dict[str, Any], f: _Families) -> Iterator[Any]:
    """Acceptance length per verify step (a histogram), draft acceptance rate, draft block length, drafter time
    per step."""
    hist = stats.get("acceptance_length_histogram") or []
    if hist:
        buckets, total = _histogram_buckets(hist)
        yield f.histogram("namazu_spec_acceptance_length", "tokens emitted per verify step (drafts accepted + the "
                          "bonus token)", buckets, total)
    drafted = stats.get("num_draft_tokens", 0)
    yield f.gauge("namazu_spec_draft_acceptance_rate", "accepted draft tokens / drafted tokens, since start",
                  stats.get("num_accepted_draft_tokens", 0) / drafted if drafted else 0.0)
    blocks = stats.get("num_draft_blocks", 0)
    yield f.gauge("namazu_spec_draft_block_length", "drafts proposed per drafted sequence, mean since start "
                  "(below --num-speculative-tokens where blocks end early: --speculative-min-confidence)",
                  stats.get("num_drafts_proposed", 0) / blocks if blocks else 0.0)
    steps = stats.get("num_steps", 0)
    yield f.gauge("namazu_spec_drafter_seconds_per_step", "drafter wall time per engine step, mean since start",
                  stats.get("drafter_seconds", 0.0) / steps if steps else 0.0)


class ServerMetrics:
    """One registry per app, so several apps (tests) never share counters."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str | None = None):
        disable_created_metrics()      # the *_created series only double the scrape size
        self.registry = CollectorRegistry()
        r = self.registry
        const = {"model_name": model_name} if model_name else {}
        names, values = list(const), list(const.values())

        def bound(metric: Any) -> Any:
            """The metric's child for the constant labels (the metric itself when there are none)."""
            return metric.labels(*values) if values else metric

        requests = Counter("namazu_http_requests", "HTTP requests by route and status code",
                           [*names, "route", "status"], registry=r)
        finished = Counter("namazu_request_success", "finished sequences by finish reason",
                           [*names, "finish_reason"], registry=r)
        self.requests = _Prefixed(requests, values)
        self.finished = _Prefixed(finished, values)
        self.prompt_tokens = bound(Counter("namazu_prompt_tokens", "prompt tokens of admitted requests", names,
                                           registry=r))
        self.cached_tokens = bound(Counter("namazu_cached_prompt_tokens", "prompt tokens served from the prefix "
                                           "cache", names, registry=r))
        self.generation_tokens = bound(Counter("namazu_generation_tokens", "generated tokens", names, registry=r))
        self.ttft = bound(Histogram("namazu_time_to_first_token_seconds", "request arrival to first token", names,
                                    buckets=_TTFT_BUCKETS, registry=r))
        self.itl = bound(Histogram("namazu_inter_token_latency_seconds", "time between successive tokens of a "
                                   "sequence", names, buckets=_ITL_BUCKETS, registry=r))
        self.e2e = bound(Histogram("namazu_e2e_request_latency_seconds", "request arrival to its last token",
                                   names, buckets=_E2E_BUCKETS, registry=r))
        r.register(_EngineCollector(engine_stats, const))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class _Prefixed:
    """A labelled metric whose leading labels (model_name) are fixed: `.labels(route, status)`."""

    def __init__(self, metric: Any, prefix: list[str]):
        self.metric, self.prefix = metric, prefix

    def labels(self, *values: str) -> Any:
        return self.metric.labels(*self.prefix, *values)


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
