"""/metrics follows Prometheus conventions and fits vLLM-style dashboards: a model_name label on every series,
durations in seconds, monotonic statistics as counters (`_total`), prefix-cache counters that can be rate()d;
the deprecated millisecond gauges stay beside their seconds."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.metrics import ServerMetrics

STATS = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_hit_rate": 0.5,
         "prefix_cache_queries": 400, "prefix_cache_hits": 200, "ms_per_decode_step": 12.5,
         "ms_per_prefill_block": 3.0, "num_spec_disabled_steps": 7, "num_draft_rows": 30, "num_steps": 10,
         "num_kv_blocks": 64, "acceptance_length_histogram": [1, 2]}


def families(model_name: str | None = "tiny") -> dict:
    m = ServerMetrics(lambda: dict(STATS), model_name=model_name)
    m.requests.labels("/v1/completions", "200").inc()
    m.finished.labels("stop").inc()
    m.ttft.observe(0.2)
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_every_series_has_model_name():
    fams = families()
    samples = [s for f in fams.values() for s in f.samples]
    assert samples and all(s.labels.get("model_name") == "tiny" for s in samples)
    assert fams["namazu_http_requests"].samples[0].labels == {"model_name": "tiny", "route": "/v1/completions",
                                                              "status": "200"}
    # A library user's ServerMetrics without a served name has no such label.
    assert all("model_name" not in s.labels for f in families(None).values() for s in f.samples)


def test_units_and_types():
    fams = families()
    value = lambda name: fams[name].samples[0].value  # noqa: E731
    assert value("namazu_decode_step_seconds") == 0.0125 and value("namazu_prefill_block_seconds") == 0.003
    assert value("namazu_decode_step_ms") == 12.5               # deprecated, kept
    for name, v in (("namazu_engine_num_spec_disabled_steps", 7), ("namazu_engine_num_draft_rows", 30),
                    ("namazu_prefix_cache_queries", 400), ("namazu_prefix_cache_hits", 200),
                    ("namazu_engine_num_steps", 10)):
        assert fams[name].type == "counter" and fams[name].samples[0].name == name + "_total"
        assert fams[name].samples[0].value == v
    assert fams["namazu_engine_num_kv_blocks"].type == "gauge"
    assert fams["namazu_time_to_first_token_seconds"].type == "histogram"
    assert not [n for n in fams if n.endswith("_ms") and n not in ("namazu_decode_step_ms", "namazu_prefill_block_ms")]
