"""The rates a replica measures of its own steps (`namazu.engine.step_rate_fit`) and reports to the KV-aware router:
the fit against arithmetic, the engine's timing of its steps against a fake clock whose steps cost a known
amount, and the router's reading of a report (`load_model.reported_rates`)."""
from __future__ import annotations

import math
from collections import deque

import pytest
from engine_helpers import prompts, tiny_checkpoint

import namazu.engine.llm_engine
from namazu.engine.llm_engine import LLMEngine
from namazu.engine.step_rate_fit import DecayedLinearFit, StepRates
from namazu.engine_config import EngineConfig
from namazu.sampling_params import SamplingParams
from server.router.load_model import PRIOR, Rates, fleet_rates, reported_rates
from server.router.policy import Decision


def test_decayed_fit_recovers_a_line_and_needs_spread_for_a_slope():
    fit = DecayedLinearFit(0.1)
    assert fit.solve() == (0.0, None)
    for _ in range(5):
        fit.add(0.0, 7.0)
    assert fit.solve() == (pytest.approx(7.0), None)     # one x only: the mean, no slope
    for x in (1.0, 3.0, 2.0, 5.0):
        fit.add(x, 7.0 + 2.5 * x)
    intercept, slope = fit.solve()
    assert intercept == pytest.approx(7.0) and slope == pytest.approx(2.5)
    assert fit.intercept_at(2.0) != pytest.approx(7.0)   # a fixed slope moves the intercept
    # the newest observation weighs 1, the one before 0.9: a lasting change wins over time
    late = DecayedLinearFit(0.5)
    for y in (10.0, 10.0, 20.0, 20.0, 20.0, 20.0, 20.0):
        late.add(0.0, y)
    assert 19.0 < late.solve()[0] < 20.0
    with pytest.raises(ValueError):
        DecayedLinearFit(0.0)


def test_step_rates_skip_the_warm_steps_and_cap_an_outlier():
    r = StepRates(block_size=16)
    assert (r.ms_per_decode_step, r.ms_per_prefill_block) == (0.0, 0.0)
    for _ in range(StepRates.WARM_STEPS):
        r.observe(320, 5000.0)               # start-up: never counted
    assert r.ms_per_decode_step == 0.0
    for i in range(40):
        r.observe(0, 6.0)
        r.observe(16 * (1 + i % 4), 6.0 + 0.75 * (1 + i % 4))
    assert r.ms_per_decode_step == pytest.approx(6.0) and r.ms_per_prefill_block == pytest.approx(0.75)
    r.observe(0, 10_000.0)                   # a pause: counts as at most 3x the fit
    assert r.ms_per_decode_step < 6.0 * 1.2
    # Decodes alone first: the first prefill steps are the slope's first news, not outliers of a fit
    # that has none.
    d = StepRates(block_size=16)
    for _ in range(StepRates.WARM_STEPS + 30):
        d.observe(0, 5.0)
    d.observe(16 * 40, 5.0 + 40 * 2.0)
    assert d.ms_per_prefill_block == pytest.approx(2.0)
    with pytest.raises(ValueError):
        StepRates(0)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_times_its_steps_and_fits_both_rates(monkeypatch, async_scheduling):
    """Every step costs 4 ms plus 0.5 ms per 16 prompt tokens on a fake clock that moves only while the
    host waits for a step's results: the engine must recover both numbers exactly, with its steps launched
    ahead of the previous one's results (async) or not."""
    clock = _Clock()
    monkeypatch.setattr(namazu.engine.llm_engine.time, "perf_counter", clock)
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", max_num_seqs=1,
                                    async_scheduling=async_scheduling, num_speculative_tokens=0,
                                    enable_prefix_caching=False))
    try:
        sizes: deque[int] = deque()
        submit, collect = engine.executor.submit, engine.executor.collect

        def timed_submit(batch):
            sizes.append(batch.num_tokens)
            return submit(batch)

        def timed_collect():
            n = sizes.popleft()
            clock.t += (4.0 + (0.5 * n / 16 if n > 1 else 0.0)) / 1000.0
            return collect()

        monkeypatch.setattr(engine.executor, "submit", timed_submit)
        monkeypatch.setattr(engine.executor, "collect", timed_collect)
        for i, ids in enumerate(prompts(6, lo=20, hi=90, seed=3)):
            engine.add_request(str(i), None, SamplingParams(max_tokens=6, ignore_eos=True), prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            engine.step()
        stats = engine.get_stats()
        assert stats.ms_per_decode_step == pytest.approx(4.0)
        assert stats.ms_per_prefill_block == pytest.approx(0.5)
    finally:
        engine.close()


def test_the_router_reads_a_report_field_by_field_and_keeps_the_prior_for_what_is_missing():
    assert reported_rates({}) == PRIOR
    assert reported_rates({"ms_per_decode_step": 0.0, "ms_per_prefill_block": 0.0}) == PRIOR   # not measured
    got = reported_rates({"ms_per_decode_step": 30.0, "ms_per_prefill_block": 0.4})
    assert got == Rates(ms_per_block=0.4, ms_per_step=30.0, overhead_ms=30.0)
    for bad in (math.nan, math.inf, -1.0, True, "3"):
        half = reported_rates({"ms_per_decode_step": 30.0, "ms_per_prefill_block": bad})
        assert half == Rates(ms_per_block=PRIOR.ms_per_block, ms_per_step=30.0, overhead_ms=30.0)


def test_a_replica_that_has_not_measured_borrows_its_twins_rates():
    """The spill rule compares replicas: one that just started must not be priced at a prior measured on
    other hardware beside twins that measured theirs."""
    gpu = {"ms_per_decode_step": 25.0, "ms_per_prefill_block": 0.3}
    got = fleet_rates([gpu, {}, {"ms_per_decode_step": 35.0, "ms_per_prefill_block": 0.5}, {"ms_per_decode_step": 0.0}])
    assert got[0] == Rates(ms_per_block=0.3, ms_per_step=25.0, overhead_ms=25.0)
    assert got[1] == got[3] == Rates(ms_per_block=0.5, ms_per_step=35.0, overhead_ms=35.0)   # the (upper) median
    assert fleet_rates([{}, {}]) == [PRIOR, PRIOR]        # nobody measured yet


def test_the_ray_serve_request_router_prices_waits_at_the_replicas_reported_rates():
    """Ray Serve shows the request router no first token, so the rates in a replica's view are the ones the
    replicas report in their routing stats."""
    pytest.importorskip("ray.serve")
    import asyncio
    from collections import namedtuple
    from types import SimpleNamespace

    from server.ray_serve.request_router import NamazuRequestRouter

    router = object.__new__(NamazuRequestRouter)     # no Ray controller: only the routing decision
    router.initialize_state()
    router._replica_queue_len_cache = {}
    seen = {}

    def choose(views, blocks, steps):
        seen.update({v.name: v.rates for v in views})
        return Decision(views[0].name, {})

    router.policy.choose = choose

    def replica(name: str, **stats: float) -> SimpleNamespace:
        return SimpleNamespace(replica_id=namedtuple("ReplicaID", "unique_id")(name),
                               routing_stats={"max_num_seqs": 4, "num_waiting": 0, **stats})

    asyncio.run(router.choose_replicas([replica("gpu", ms_per_decode_step=25.0, ms_per_prefill_block=0.3),
                                        replica("fresh")]))
    assert seen == {"gpu": Rates(ms_per_block=0.3, ms_per_step=25.0, overhead_ms=25.0),
                    "fresh": Rates(ms_per_block=0.3, ms_per_step=25.0, overhead_ms=25.0)}


def test_the_standalone_router_starts_from_the_replicas_own_rates_and_learns_from_there():
    """Before its first request to a replica the router's rates are what the replicas report (here its twin:
    it has not measured yet), not a prior measured elsewhere; the router's own first-token times then move
    them as before."""
    from server.router.pool import ReplicaPool

    pool = ReplicaPool(["http://a", "http://b"], client=None)
    r = pool.replicas["http://a"]
    pool.reported(r, {"max_num_seqs": 4, "num_running": 0, "num_waiting": 0})
    assert r.view([], 2.0, now=0.0).rates == PRIOR            # nothing measured anywhere yet
    pool.reported(pool.replicas["http://b"], {"max_num_seqs": 4, "ms_per_decode_step": 30.0,
                                              "ms_per_prefill_block": 0.5})
    assert r.view([], 2.0, now=0.0).rates == pytest.approx(Rates(ms_per_block=0.5, ms_per_step=30.0, overhead_ms=30.0))
    ticket = r.opened([], new_blocks=20, prompt_blocks=20, now=0.0)
    r.first_token(ticket, now=0.060)                          # 60 ms for 20 blocks: slower than reported
    learned = r.view([], 2.0, now=0.1).rates
    assert learned.ms_per_block > 0.5 and r.rates.first_tokens == 1
