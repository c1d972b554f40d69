"""The KV-aware router's decisions, without HTTP: the cost prefers cached prefixes but never ignores
load, ties are random, the history fallback forgets after its TTL, the event index resets on a new
replica life."""
from __future__ import annotations

from server.router.index import EventIndex, RoutingHistory
from server.router.policy import KVAwarePolicy, PrefixAffinityPolicy, ReplicaView, RoundRobinPolicy, make_policy


def view(name, cached=0, active=0.0, queued=0.0, in_flight=0) -> ReplicaView:
    return ReplicaView(name, cached, active, queued, in_flight)


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
