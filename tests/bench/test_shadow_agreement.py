"""bench/shadow_agreement.py: the acceptance length is a ratio of sums over requests (as /metrics and the refresh
gate count it), its bootstrap interval resamples whole requests, and a live number outside that interval is
marked so."""
from __future__ import annotations

import numpy as np

from bench.shadow_agreement import bootstrap, table


def test_acceptance_length_is_tokens_over_verify_steps_of_all_requests():
    mean, low, high = bootstrap(np.array([10.0, 1.0]), np.array([2.0, 1.0]))
    assert mean == 11 / 3                                  # not the mean of per-request ratios (3.0)
    assert 1.0 <= low < mean < high <= 5.0                 # resampled whole requests: between the two ratios
    assert bootstrap(np.array([2.0, 4.0, 6.0]), np.array([1.0, 2.0, 3.0])) == (2.0, 2.0, 2.0)
    assert bootstrap(np.array([]), np.array([])) == (0.0, 0.0, 0.0)


def test_a_live_number_outside_the_offline_interval_is_marked():
    row = {"requests": 10, "verify_steps": 100, "mean": 2.0, "low": 1.8, "high": 2.2}
    offs = {"seeded": {"all": row, "T=0": row, "T>0": row}}
    live = {"exact_blocks": 50.0, "expected_blocks": 0.0, "truncated_blocks": 0.0, "dropped_blocks": 0.0,
            "mean": 2.5, "mean_exact": 2.5, "mean_expected": 0.0, "serving_mean": 2.1, "ratio": 2.5 / 2.1}
    line = [x for x in table(offs, {"seeded": {"shadow": {"copy-1": live}}}).splitlines()
            if x.startswith("| seeded (`copy-1`)")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-2:] == ["**no**", "yes"], cells
