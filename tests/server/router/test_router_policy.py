"""The KV-aware router's decisions, without HTTP: the cost prefers cached prefixes but never ignores
load, ties are random, the history fallback forgets after its TTL, the event index resets on a new
replica life."""
from __future__ import annotations

import pytest

from namazu.scheduler.kv_events import KVEventLog
from server.router.index import EventIndex, RoutingHistory
from server.router.load_model import Pending, RateEstimator, Rates
from server.router.policy import (
    KVAwarePolicy,
    PrefixAffinityPolicy,
    ReplicaView,
    RoundRobinPolicy,
    make_policy,
    queued_estimate,
)
from server.router.pool import Replica

RATES = Rates(ms_per_block=2.0, ms_per_step=10.0, overhead_ms=10.0)


def view(name, cached=0, active=0.0, queued=0.0, in_flight=0, pending=(), running=(), capacity=0) -> ReplicaView:
    """Rates: 2 ms per prefill block, 10 ms per decode step."""
    return ReplicaView(name, cached, active, queued, in_flight, tuple(Pending(*p) for p in pending),
                       tuple(running), capacity, RATES)


def test_cached_prefix_wins_when_load_is_equal():
    p = KVAwarePolicy(prefix_weight=1.0, seed=0)
    d = p.choose([view("a"), view("b", cached=20), view("c", cached=5)], prompt_blocks=24)
    assert d.replica == "b"
    assert d.costs["a"] - d.costs["b"] == 20 and d.costs["c"] - d.costs["b"] == 15


def test_load_outweighs_affinity_no_death_spiral():
    views = [view("hot", cached=20, active=200, queued=3), view("cold", active=10)]
    assert KVAwarePolicy(seed=0).choose(views, 24).replica == "cold"
    assert PrefixAffinityPolicy(seed=0).choose(views, 24).replica == "hot"   # the baseline that spirals


def test_queue_term_counts():
    views = [view("a", queued=2), view("b")]
    assert KVAwarePolicy(queue_weight=4.0, seed=0).choose(views, 4).replica == "b"
    d = KVAwarePolicy(queue_weight=0.0, seed=0).choose(views, 4)
    assert d.costs["a"] == d.costs["b"]


def test_the_queue_term_is_the_wait_in_prefill_blocks_plus_the_blocks_the_requests_ahead_hold():
    """A follow-up turn (30 blocks, 26 cached on `hot`), three of this router's turns waiting there (4
    uncached blocks, 16 decode steps each) behind four full slots: the wait is their 12 blocks of prefill
    (24 ms) plus the decode steps until a slot frees for the new request (the fourth freed, at 3 steps: 30
    ms); the queue term prices it as w x 54 ms / 2 ms per block, plus the 3 x 30 blocks they will hold.
    Another client's queued request counts as one like the new request, nothing cached."""
    p = KVAwarePolicy(seed=0)     # w = 4, q = 1, spill 2
    hot = view("hot", cached=26, active=60, queued=3, pending=[(4, 30, 16)] * 3, running=(1, 2, 3, 3),
               capacity=4)
    assert p.delay(hot, 30, 16) == 2.0 * 12 + 10.0 * 3
    assert p.queued_work(hot, 30, 16) == 4 * 54 / 2 + 3 * 30
    assert p.cost(hot, 30, 16) - p.cost(view("hot", cached=26, active=60), 30, 16) == 4 * 54 / 2 + 3 * 30
    other = view("x", queued=1, capacity=0)       # one queued, not this router's: 10 blocks, 16 steps
    assert p.queued_work(other, 10, 16) == 4 * (2.0 * 10) / 2 + 10
    assert KVAwarePolicy(queue_weight=0.0).cost(hot, 30) == KVAwarePolicy().cost(view("hot", 26, 60), 30)


def test_a_prompt_leaves_its_home_when_the_wait_there_in_ms_exceeds_the_recompute():
    """The spill rule on a follow-up turn (30 blocks, 26 cached on `home`, recomputing them at `idle`
    costs 26 x 2 ms, the bar 2 x 52 = 104 ms). The same queue (one turn waiting, four full slots, the same
    active blocks) is a short wait when the running sequences are about to finish (2 steps: 8 + 20 ms)
    and a long one when they have 14 steps left (8 + 140 ms): in blocks the two homes look alike, in
    time only the second is worth leaving."""
    p = KVAwarePolicy(seed=0)
    idle = view("idle", active=60, capacity=4)

    def home(left: int) -> ReplicaView:
        return view("home", cached=26, active=60, queued=1, pending=[(4, 30, 16)], running=(left,) * 4,
                    capacity=4)
    assert p.delay(home(2), 30, 16) == 28.0 and p.delay(home(14), 30, 16) == 148.0
    assert p.choose([home(2), idle], 30, 16).replica == "home"
    assert p.choose([home(14), idle], 30, 16).replica == "idle"
    assert KVAwarePolicy(seed=0, spill_factor=0.0).choose([home(2), idle], 30, 16).replica == "home"  # cost
    # running sequences alone (free slots, no queue) never move it: the first token would not wait
    busy = view("home", cached=26, active=400, running=(14,) * 3, capacity=4)
    assert p.delay(busy, 30, 16) == 0.0 and p.choose([busy, idle], 30, 16).replica == "home"
    # 24 of the 26 blocks cached elsewhere: 2 to recompute, a bar of 8 ms
    partial = view("partial", cached=24, active=60, capacity=4)
    assert p.choose([home(2), partial], 30, 16).replica == "partial"
    assert p.choose([view("home", cached=26, active=60, capacity=4), partial], 30, 16).replica == "home"


def test_a_burst_of_unrelated_requests_reaches_every_replica():
    """30 requests sharing only their first block (a short common system prompt), sent at once to three
    replicas that run many sequences (nothing counts as queued): the first one makes its replica the home
    of that block; each one sent there waits for the prefill of those sent before it (none has its first
    token yet), so the rest spread as soon as that wait passes the bar of one block (2 x 2 ms)."""
    p = KVAwarePolicy(seed=0)
    names = ("a", "b", "c")
    cached = dict.fromkeys(names, 0)
    pending: dict[str, list] = {n: [] for n in names}
    for _ in range(30):
        views = [view(n, cached=cached[n], active=sum(7 for _ in pending[n]), in_flight=len(pending[n]),
                      pending=pending[n], capacity=64) for n in names]
        d = p.choose(views, 7, 8)
        pending[d.replica].append((7 - cached[d.replica], 7, 8))
        cached[d.replica] = 1
    routed = {n: len(pending[n]) for n in names}
    assert min(routed.values()) >= 0.15 * 30, routed


def test_replica_view_pending_until_the_first_token_then_running_with_steps_left():
    """The router's own requests on a replica: those without a first token are pending (their prefill is
    ahead of a new request), those streaming hold a slot with their max_tokens minus the steps since their
    first token left; the queue is still this router's requests beyond the slots or the report."""
    r = Replica("http://a", RoutingHistory(), rates=RateEstimator(RATES))
    r.reported({"num_running": 0, "num_waiting": 0, "active_kv_blocks": 7, "max_num_seqs": 2})
    tickets = [r.opened([], new_blocks=n, prompt_blocks=10 * n, steps=16, now=0.0) for n in (1, 2, 3)]
    v = r.view([], events_max_age=2.0, now=0.0)
    assert v.queued == 1 and v.in_flight == 3 and v.capacity == 2 and v.running == ()
    assert v.pending == (Pending(1, 10, 16), Pending(2, 20, 16), Pending(3, 30, 16))
    r.first_token(tickets[0], now=0.05)        # 50 ms for 1 block with a free slot: a first-token sample
    r.first_token(tickets[1], now=0.08)        # found the first one in its prefill: 3 blocks, 80 ms
    assert r.rates.first_tokens == 2
    v = r.view([], events_max_age=2.0, now=0.05 + 0.001 * 5 * r.rates.rates.ms_per_step)
    assert v.pending == (Pending(3, 30, 16),) and v.running == pytest.approx((11.0, 14.0))
    r.first_token(tickets[2], now=0.2)         # sent with both slots taken: its wait is not a prefill sample
    assert r.rates.first_tokens == 2
    r.closed(tickets[0], completion_tokens=16, now=0.05 + 0.3, streamed=True)   # 15 steps in 300 ms
    assert r.rates.decodes == 1 and r.rates.rates.ms_per_step == pytest.approx(10.0 + 0.1 * (20.0 - 10.0))
    v = r.view([], events_max_age=2.0, now=0.4)
    # the report's 7 blocks less the 10 the finished one held, plus the 6 this router's requests added
    assert v.in_flight == 2 and v.active_blocks == 0 + 6
    r.closed(tickets[0])          # closing twice is harmless
    assert r.in_flight == 2
    two = r.opened([], new_blocks=1, prompt_blocks=10, steps=16, now=1.0, choices=2)
    r.first_token(two, now=1.0)
    r.closed(two, completion_tokens=32, now=1.3, streamed=True)   # 2 choices of 16 tokens, side by side
    assert r.rates.decodes == 2 and r.rates.rates.ms_per_step == pytest.approx(11.0 + 0.1 * (20.0 - 11.0))


def test_requests_sent_since_the_last_report_count_as_queued_once_the_replica_is_full():
    """A replica running up to 4 sequences at once (--max-num-seqs 4) holds 4 of this router's requests:
    the 5th and 6th sent before the next report are queued there, known at once (no herding onto a
    replica that looked idle), and all six are ahead of a new request until their first tokens."""
    r = Replica("http://a", RoutingHistory())
    r.reported({"num_running": 1, "num_waiting": 0, "active_kv_blocks": 40, "max_num_seqs": 4})
    for n in range(6):
        r.opened([], new_blocks=n, prompt_blocks=10)
    v = r.view([], events_max_age=2.0, now=0.0)
    assert v.queued == 2 and [p.uncached for p in v.pending] == [0, 1, 2, 3, 4, 5]
    assert queued_estimate(in_flight=3, capacity=4, reported_waiting=1) == 1   # other clients' queue
    assert queued_estimate(in_flight=3, capacity=0, reported_waiting=0) == 0   # capacity unknown
    r.forget()
    assert r.capacity == 0


def test_ties_are_broken_at_random():
    p = KVAwarePolicy(seed=1)
    picks = {p.choose([view("a"), view("b"), view("c")], 4).replica for _ in range(60)}
    assert picks == {"a", "b", "c"}


def test_round_robin_cycles_and_unknown_policy_is_refused():
    rr = RoundRobinPolicy()
    views = [view("a"), view("b")]
    assert [rr.choose(views, 1).replica for _ in range(4)] == ["a", "b", "a", "b"]
    try:
        make_policy("nearest")
    except ValueError as e:
        assert "unknown routing policy" in str(e)
    else:
        raise AssertionError("an unknown policy must be refused")


def test_history_counts_leading_blocks_and_expires():
    h = RoutingHistory(ttl=10.0)
    h.record([1, 2, 3], now=0.0)
    assert h.matched([1, 2, 3, 4], now=5.0) == 3
    assert h.matched([9, 2, 3], now=5.0) == 0           # chained: a miss ends the prefix
    assert h.matched([1, 2], now=5.0, within=2.0) == 0  # sent 5 s ago, not in the last 2 s
    h.record([1], now=8.0)
    assert h.matched([1, 2], now=12.0) == 1             # 2 and 3 expired at 10, 1 was refreshed at 8
    assert h.matched([1], now=19.0) == 0


def test_event_index_applies_deltas_and_resets_on_a_new_replica_life():
    idx = EventIndex()
    idx.apply({"replica_id": "r1", "last_id": 3, "more": False, "events": [
        {"id": 1, "type": "all_cleared", "block_hashes": []},
        {"id": 2, "type": "stored", "block_hashes": [10, 11, 12]},
        {"id": 3, "type": "removed", "block_hashes": [12]}]}, now=0.0)
    assert idx.hashes == {10, 11} and idx.cursor == 3 and idx.matched([10, 11, 12]) == 2
    idx.apply({"replica_id": "r1", "last_id": 3, "more": False, "events": [
        {"id": 3, "type": "removed", "block_hashes": [10]}]}, now=1.0)     # replayed id: ignored
    assert idx.hashes == {10, 11}
    idx.apply({"replica_id": "r2", "last_id": 1, "more": False, "events": [
        {"id": 1, "type": "all_cleared", "block_hashes": []}]}, now=2.0)   # restarted replica
    assert idx.hashes == set() and idx.replica_id == "r2" and idx.num_resets == 2
    idx.apply({"replica_id": "r2", "last_id": 9, "snapshot": [5, 6], "events": [], "more": False}, now=3.0)
    assert idx.hashes == {5, 6} and idx.cursor == 9
    assert idx.fresh(1.0, now=3.5) and not idx.fresh(1.0, now=5.0)


def test_a_snapshot_replaces_what_the_index_believed_so_evicted_blocks_are_forgotten():
    # A router that fell behind the replica's bounded log gets a snapshot; blocks evicted meanwhile are
    # in neither the snapshot nor any event it will see again, so the snapshot must replace the index
    # (merged, they would count as cached forever and keep pulling their prefix to this replica).
    log = KVEventLog(replica_id="r1", max_events=4)
    idx = EventIndex()
    log.stored([1, 2, 3])
    idx.apply(log.since(idx.cursor, replica_id=idx.replica_id), now=0.0)
    assert idx.matched([1, 2, 3]) == 3
    log.removed([2, 3])                                     # evicted, then the log wraps past the cursor
    for h in range(10, 16):
        log.stored([h])
    page = log.since(idx.cursor, replica_id=idx.replica_id)
    assert "snapshot" in page
    assert not idx.apply(page, now=1.0)
    assert idx.hashes == log.stored_hashes() == {1, *range(10, 16)}
    assert idx.matched([1, 2, 3]) == 1 and idx.num_resets == 1       # same life of the replica: no reset
    log.stored([20])
    idx.apply(log.since(idx.cursor, replica_id=idx.replica_id), now=2.0)   # deltas again from there
    assert idx.hashes == log.stored_hashes()


def test_recomputing_a_prefix_on_a_busy_replica_is_charged_for_the_queue_behind_it():
    """A follow-up turn (30 blocks, 26 cached on `hot`, five turns queued there) against `busy` (four
    queued, nothing cached), both with four full slots: `busy` is a shorter wait and the spill rule
    allows it, but recomputing 26 blocks there delays the requests that queue behind it, about as many as
    queue ahead now (w x 26 x 4): it waits on `hot`. An idle replica has nobody behind: the spill goes
    there as before."""
    p = KVAwarePolicy(seed=0)     # w = 4, q = 1
    hot = view("hot", cached=26, active=60, queued=5, pending=[(4, 30, 16)] * 5, running=(16,) * 4, capacity=4)
    busy = view("busy", active=60, queued=4, pending=[(4, 30, 16)] * 4, running=(4,) * 4, capacity=4)
    assert p.delay(hot, 30, 16) - p.delay(busy, 30, 16) > 2 * 2.0 * 26           # the spill rule allows it
    assert p.cost(busy, 30, 16) < p.cost(hot, 30, 16)
    d = p.choose([hot, busy], 30, 16)
    assert d.replica == "hot" and d.costs["busy"] - p.cost(busy, 30, 16) == 4 * 26 * 4
    assert d.costs["hot"] == p.cost(hot, 30, 16)
    assert p.choose([hot, view("idle", active=60, capacity=4)], 30, 16).replica == "idle"
    # Unrelated prompts (nothing cached anywhere) are not charged: a burst still spreads by load.
    assert p.choose([view("a", queued=2, pending=[(4, 4, 16)] * 2), view("b")], 4).replica == "b"
