"""The step-rate fit cannot run away (issue 34, item 6): a concave step cost fits a negative intercept,
and the outlier cap then fed negative times back until /load reported 1.6e83 ms per prefill block and
0 per decode step; the router ignores reported rates no step could have."""
from __future__ import annotations

import random

import pytest

from namazu.engine.step_rate_fit import DecayedLinearFit, StepRates
from server.router.load_model import MAX_REPORTED_MS, PRIOR, fleet_rates, reported_rates


def test_a_negative_intercept_does_not_feed_back():
    r = StepRates(block_size=16)
    rng = random.Random(0)
    for _ in range(StepRates.WARM_STEPS + 30):        # prefill steps alone, on a line with intercept -60
        blocks = rng.choice([8, 16, 32])
        r.observe(16 * blocks, 10.0 * blocks - 60.0)
    for _ in range(400):                              # then ordinary decode steps of 5 ms
        r.observe(0, 5.0)
    assert r.ms_per_decode_step == pytest.approx(5.0, rel=0.05)
    assert 0.0 < r.ms_per_prefill_block < 12.0


def test_nonnegative_fit_is_the_best_fit_on_the_bound():
    fit = DecayedLinearFit(0.1)
    for x, y in ((8, 20.0), (16, 100.0), (32, 260.0)):     # free fit: intercept -60, slope 10
        fit.add(x, y)
    assert fit.solve()[0] < 0
    intercept, slope = fit.solve_nonnegative()
    assert intercept == 0.0 and slope > 0
    fit2 = DecayedLinearFit(0.1)
    for x, y in ((1, 9.0), (2, 7.0), (3, 5.0)):            # falling: slope 0, the mean
        fit2.add(x, y)
    assert fit2.solve_nonnegative()[1] == 0.0


@pytest.mark.parametrize("bad", [1.6e83, MAX_REPORTED_MS * 2, float("inf"), -3.0, 0.0, True, "5"])
def test_the_router_ignores_rates_no_step_could_have(bad):
    rates = reported_rates({"ms_per_decode_step": bad, "ms_per_prefill_block": bad})
    assert rates.ms_per_step == PRIOR.ms_per_step and rates.ms_per_block == PRIOR.ms_per_block
    fleet = fleet_rates([{"ms_per_decode_step": 12.0, "ms_per_prefill_block": 1.5},
                         {"ms_per_decode_step": bad, "ms_per_prefill_block": bad}])
    assert fleet[1].ms_per_step == 12.0 and fleet[1].ms_per_block == 1.5     # its twin's, not the absurd one
