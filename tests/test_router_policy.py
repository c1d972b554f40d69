"""The KV-aware router's decisions, without HTTP: the cost prefers cached prefixes but never ignores
load, ties are random, the history fallback forgets after its TTL, the event index resets on a new
replica life."""
from __future__ import annotations

from server.router.index import EventIndex, RoutingHistory
from server.router.policy import (
    KVAwarePolicy,
    PrefixAffinityPolicy,
    ReplicaView,
    RoundRobinPolicy,
    make_policy,
    queued_estimate,
)
from server.router.pool import Replica


def view(name, cached=0, active=0.0, queued=0.0, in_flight=0, waiting=()) -> ReplicaView:
    return ReplicaView(name, cached, active, queued, in_flight, tuple(waiting))


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


def test_queued_work_is_priced_like_the_new_request_and_moves_a_hot_prefix():
    """A follow-up turn (30 blocks, 26 cached on `hot`): three turns queued there are cheaper to wait for
    than recomputing 26 blocks elsewhere (the spill rule: the work waiting at `hot`, 30 more active blocks
    + 3 x 46, is under 2 x w x 26 = 208); five are not. Each queued request costs w x its uncached blocks
    + its blocks; a queued request of another client's counts as one like the new request, nothing
    cached."""
    p = KVAwarePolicy(seed=0)     # w = 4, q = 1, spill 2
    cold = view("cold", active=30)
    three = view("hot", cached=26, active=60, queued=3, waiting=[(4, 30)] * 3)
    five = view("hot", cached=26, active=60, queued=5, waiting=[(4, 30)] * 5)
    assert p.choose([three, cold], 30).replica == "hot"
    assert p.choose([five, cold], 30).replica == "cold"
    assert p.cost(three, 30) - p.cost(view("hot", cached=26, active=60), 30) == 3 * (4 * 4 + 30)
    assert p.queued_work(view("x", queued=3, waiting=[(2, 8)]), 10) == (4 * 2 + 8) + 2 * 5 * 10
    assert KVAwarePolicy(queue_weight=0.0).cost(three, 30) == KVAwarePolicy().cost(view("hot", 26, 60), 30)


def test_a_prompt_leaves_its_home_only_when_waiting_there_costs_more_than_the_recompute():
    """The spill rule on a follow-up turn (30 blocks, 26 cached on `home`): 130 more active blocks at the
    home than at an idle replica make the plain cost move it (they outweigh w x 26 = 104), the spill rule
    keeps it home (under 2 x w x 26 = 208); the work waiting there passing 208 over the other's moves it.
    A replica that caches part of the prompt needs less: the bar is the blocks it would recompute."""
    p = KVAwarePolicy(seed=0)     # w = 4, spill 2
    home = view("home", cached=26, active=140)
    idle = view("idle", active=10)
    assert p.cost(idle, 30) < p.cost(home, 30)                       # the plain cost would spill
    assert p.choose([home, idle], 30).replica == "home"
    assert KVAwarePolicy(seed=0, spill_factor=0.0).choose([home, idle], 30).replica == "idle"
    queued = view("home", cached=26, active=140, queued=2, waiting=[(4, 30)] * 2)   # 130 + 92 > 208
    assert p.choose([queued, idle], 30).replica == "idle"
    # 24 of the 26 blocks cached elsewhere: 2 to recompute, a bar of 16
    partial = view("partial", cached=24, active=120)
    assert p.choose([view("home", cached=26, active=140), partial], 30).replica == "partial"
    assert p.choose([view("home", cached=26, active=130), partial], 30).replica == "home"


def test_a_burst_of_unrelated_requests_reaches_every_replica():
    """30 requests sharing only their first block (a short common system prompt), sent at once to three
    replicas that run many sequences (nothing counts as queued): the first one makes its replica the home
    of that block, and the rest spread as the home's active blocks pass the bar of one block (w x 2)."""
    p = KVAwarePolicy(seed=0)
    active = {"a": 0.0, "b": 0.0, "c": 0.0}
    cached = {"a": 0, "b": 0, "c": 0}
    routed = {"a": 0, "b": 0, "c": 0}
    for _ in range(30):
        views = [view(n, cached=cached[n], active=active[n], in_flight=routed[n]) for n in active]
        d = p.choose(views, 7)
        active[d.replica] += 7 - cached[d.replica]
        cached[d.replica] = 1
        routed[d.replica] += 1
    assert min(routed.values()) >= 0.15 * 30, routed


def test_replica_view_takes_the_newest_open_requests_as_the_waiting_ones():
    r = Replica("http://a", RoutingHistory())
    tickets = [r.opened([], new_blocks=n, prompt_blocks=10 * n) for n in (1, 2, 3)]
    r.reported({"num_waiting": 2, "active_kv_blocks": 7})
    v = r.view([], events_max_age=2.0, now=0.0)
    assert v.queued == 2 and v.waiting == ((2, 20), (3, 30)) and v.in_flight == 3
    r.closed(tickets[0])          # finished since the last report: the queue is one shorter
    v = r.view([], events_max_age=2.0, now=0.0)
    assert v.queued == 1 and v.waiting == ((3, 30),) and v.active_blocks == 0   # 7 reported - its 10
    r.closed(tickets[0])          # closing twice is harmless
    assert r.in_flight == 2


def test_requests_sent_since_the_last_report_count_as_queued_once_the_replica_is_full():
    """A replica running up to 4 sequences at once (--max-num-seqs 4) holds 4 of this router's requests:
    the 5th and 6th sent before the next report are queued there, known at once (no herding onto a
    replica that looked idle)."""
    r = Replica("http://a", RoutingHistory())
    r.reported({"num_running": 1, "num_waiting": 0, "active_kv_blocks": 40, "max_num_seqs": 4})
    for n in range(6):
        r.opened([], new_blocks=n, prompt_blocks=10)
    v = r.view([], events_max_age=2.0, now=0.0)
    assert v.queued == 2 and v.waiting == ((4, 10), (5, 10))
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


def test_recomputing_a_prefix_on_a_busy_replica_is_charged_for_the_queue_behind_it():
    """A follow-up turn (30 blocks, 26 cached on `hot`, five turns queued there) against `busy` (two
    queued, nothing cached): by this request's wait alone `busy` is cheaper, but recomputing 26 blocks
    there delays the requests that queue behind it, about as many as queue ahead now: it waits on `hot`.
    An idle replica has nobody behind: the spill goes there as before."""
    p = KVAwarePolicy(seed=0)     # w = 4, q = 1
    hot = view("hot", cached=26, active=60, queued=5, waiting=[(4, 30)] * 5)
    busy = view("busy", active=60, queued=2, waiting=[(4, 30)] * 2)
    assert p.cost(busy, 30) < p.cost(hot, 30)
    d = p.choose([hot, busy], 30)
    assert d.replica == "hot" and d.costs["busy"] - p.cost(busy, 30) == 4 * 26 * 2 and d.costs["hot"] == p.cost(hot, 30)
    assert p.choose([hot, view("idle", active=60)], 30).replica == "idle"
    # Unrelated prompts (nothing cached anywhere) are not charged: a burst still spreads by load.
    assert p.choose([view("a", queued=2, waiting=[(4, 4)] * 2), view("b")], 4).replica == "b"
