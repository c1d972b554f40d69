"""The router's wait estimate in milliseconds (`server/router/load_model.py`) against arithmetic: the FCFS
slot simulation, the prefill queued ahead, and the rates it learns from its own requests."""
from __future__ import annotations

import math

import pytest

from server.router.load_model import (
    PRIOR,
    Pending,
    RateEstimator,
    Rates,
    decode_steps,
    expected_wait_ms,
    first_token_ms,
    slot_wait_steps,
)

SLOW_PRIOR = Rates(ms_per_block=2.0, ms_per_step=10.0, overhead_ms=10.0)


def test_a_new_request_gets_the_slot_that_frees_after_the_requests_queued_ahead():
    # two slots, sequences with 3 and 10 steps left, one request of 5 steps queued: it takes the slot
    # freed at 3 and holds it to 8; the new request gets that one at 8, before the other frees at 10
    assert slot_wait_steps([3, 10], [5], capacity=2) == 8
    assert slot_wait_steps([3, 10], [5, 1], capacity=2) == 9       # the second queued one: 8 -> 9
    assert slot_wait_steps([3], [], capacity=2) == 0                # a free slot
    assert slot_wait_steps([3, 10], [5], capacity=0) == 0           # capacity unknown: no slot wait
    assert slot_wait_steps([7, 3, 10], [], capacity=2) == 7         # a stale over-full report


def test_the_wait_is_the_prefill_ahead_plus_the_decode_steps_until_a_slot_frees():
    rates = Rates(ms_per_block=2.0, ms_per_step=10.0, overhead_ms=4.0)
    pending = [Pending(uncached=4, blocks=30, steps=16), Pending(uncached=6, blocks=30, steps=16)]
    # 3 slots, 2 running with 5 and 7 steps left: the first pending request takes the free slot (16
    # steps), the second waits for the one freed at 5 (to 21); the new request's slot frees at 7
    assert expected_wait_ms(rates, pending, [5, 7], capacity=3) == 2.0 * (4 + 6) + 10.0 * 7
    # another client's queued request, priced like the new one (8 blocks, 16 steps), takes the slot of 7
    # (to 23): the new one waits for the first pending's, freed at 16
    assert expected_wait_ms(rates, pending, [5, 7], 3, others_queued=1, new_blocks=8, new_steps=16) == \
        2.0 * (4 + 6 + 8) + 10.0 * 16
    # slots free: the prefill ahead alone
    assert expected_wait_ms(rates, pending, [5], capacity=4) == 20.0
    assert first_token_ms(rates, 20.0, uncached=3) == 20.0 + 4.0 + 6.0


def test_the_rates_are_learned_from_first_tokens_and_token_spacing():
    assert RateEstimator().rates == PRIOR
    est = RateEstimator(SLOW_PRIOR)
    for _ in range(30):
        for blocks in (2, 10, 30, 60):
            est.first_token(blocks, 12.0 + 3.0 * blocks)
        est.decode(15, 15 * 20.0)
    r = est.rates
    # the prior pulls with the weight of one observation against ~10 (each decays by 0.9 per new one)
    assert r.ms_per_block == pytest.approx(3.0, rel=0.05) and r.overhead_ms == pytest.approx(12.0, rel=0.2)
    assert r.ms_per_step == pytest.approx(20.0, rel=0.05)
    one = RateEstimator(SLOW_PRIOR)
    one.first_token(30, 12.0 + 3.0 * 30)
    assert SLOW_PRIOR.ms_per_block < one.rates.ms_per_block < 3.0   # one sample moves it part of the way


def test_degenerate_or_bad_observations_keep_the_rates_usable():
    est = RateEstimator(SLOW_PRIOR)
    for _ in range(200):
        est.first_token(24, 30.0)          # every prompt the same size: the prior keeps the fit defined
    r = est.rates
    assert math.isfinite(r.ms_per_block) and r.ms_per_block > 0 and r.overhead_ms >= 0
    assert first_token_ms(r, 0.0, 24) == pytest.approx(30.0, rel=0.1)     # the prior still weighs in
    for _ in range(50):
        est.first_token(40, 1.0)           # bigger prompts faster: no negative rate comes out
    assert est.rates.ms_per_block > 0
    est.first_token(-1, 5.0)
    est.decode(0, 5.0)
    est.decode(3, float("nan"))
    assert math.isfinite(est.rates.ms_per_step)
    with pytest.raises(ValueError):
        Rates(0.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        RateEstimator(alpha=0.0)


def test_decode_steps_reads_max_tokens_from_the_body():
    assert decode_steps({"max_tokens": 16}) == 16
    assert decode_steps({"max_completion_tokens": 8, "max_tokens": 16}) == 8
    assert decode_steps({"max_tokens": 0}) is None and decode_steps({"max_tokens": True}) is None
    assert decode_steps({"max_tokens": "9"}) is None and decode_steps(None) is None and decode_steps({}) is None


def test_late_first_tokens_do_not_starve_a_replica_but_a_real_change_gets_through():
    """A few first tokens delayed by what the router cannot see (a long prefill in the same step) must not
    multiply the replica's rate (the router would then avoid it); a lasting change of rate must still be
    learned."""
    est = RateEstimator(SLOW_PRIOR)
    for _ in range(30):
        for blocks in (2, 10, 30, 60):
            est.first_token(blocks, 12.0 + 3.0 * blocks)
    for blocks in (2, 60, 2, 60, 2, 60):                # the long prompts' first tokens came ~1.5 s late
        est.first_token(blocks, 12.0 + 3.0 * blocks + (1500.0 if blocks == 60 else 0.0))
    assert est.rates.ms_per_block < 1.7 * 3.0          # 19 ms per block if taken as they came
    for _ in range(40):                                 # the replica really got 2.5x slower
        for blocks in (2, 10, 30, 60):
            est.first_token(blocks, 12.0 + 7.5 * blocks)
    assert est.rates.ms_per_block == pytest.approx(7.5, rel=0.1)
