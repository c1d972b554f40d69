"""bench/router.py's reading of a sweep: each policy's highest sustained rate, and TTFT p99 of both
policies there (the issue's acceptance number), from the rows it measured."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import router as bench_router  # noqa: E402


def row(policy: str, rate: float, kept: bool, p99: float, computed: int) -> dict:
    return {"front": "router", "policy": policy, "rate": f"{rate:g}", "kept_up": kept, "ttft_p99": p99,
            "ttft_p50": p99 / 3, "computed": computed, "req_s": rate * (0.99 if kept else 0.9)}


def test_highest_sustained_rate_stops_at_the_first_rate_not_kept_up_and_p99_is_reported_there():
    rows = [row("round_robin", 10, True, 300, 1000), row("round_robin", 11, True, 900, 1000),
            row("round_robin", 12, False, 4000, 1000), row("round_robin", 13, True, 5000, 1000),   # noise
            row("kv", 10, True, 100, 500), row("kv", 11, True, 250, 550), row("kv", 12, True, 600, 580),
            row("kv", 13, False, 3000, 700)]
    lines = bench_router.verdict(rows)
    assert ("- router, round_robin: highest rate sustained 11 req/s (10.89 done/s); most done/s at any rate "
            "12.87") in lines
    assert any(line.startswith("- router, kv: highest rate sustained 12 req/s") for line in lines)
    assert ("- router, at the highest rate round_robin sustains (11 req/s): TTFT p99 round-robin 900 ms, kv 250 ms "
            "(3.6x lower with kv); prompt tokens kv/round-robin 0.55x (kept up: round-robin True, kv True)") in lines
    assert ("- router, at the highest rate kv sustains (12 req/s): TTFT p99 round-robin 4000 ms, kv 600 ms "
            "(6.7x lower with kv); prompt tokens kv/round-robin 0.58x (kept up: round-robin False, kv True)") in lines


def test_rate_grids():
    assert bench_router.parse_rates("10:12:0.5") == [10.0, 10.5, 11.0, 11.5, 12.0]
    assert bench_router.parse_rates("6,9,12") == [6.0, 9.0, 12.0]
    for bad in ("12:10:1", "10:12:0", "0,3", "a,b", "1:2"):
        with pytest.raises(SystemExit, match="--rates"):
            bench_router.parse_rates(bad)
