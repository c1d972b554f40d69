"""KV events: replaying the log reproduces the prefix cache's key set exactly; the log is bounded and a
lagging or restarted reader gets a snapshot; a prompt hashed outside the engine matches the hashes the
engine published for it."""
from __future__ import annotations

import random

from engine_helpers import tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_manager import make_seq, run_prefill

from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig
from namazu.sampling_params import SamplingParams
from namazu.scheduler.block_manager import BlockManager
from namazu.scheduler.kv_events import ALL_CLEARED, KVEventLog, PromptHasher, prompt_block_hashes


def replay(log: KVEventLog, view: set[int], after: int) -> int:
    """Applies the log's events after `after` to `view` the way a router would; returns the new cursor."""
    while True:
        page = log.since(after, limit=3)
        if "snapshot" in page:
            view.clear()
            view.update(page["snapshot"])
            return page["last_id"]
        for e in page["events"]:
            assert e["id"] == after + 1, "event ids must be consecutive"
            after = e["id"]
            if e["type"] == ALL_CLEARED:
                view.clear()
            elif e["type"] == "stored":
                view.update(e["block_hashes"])
            else:
                view.difference_update(e["block_hashes"])
        if not page["more"]:
            return after


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 64))
def test_replayed_events_equal_the_prefix_cache(ops, max_events):
    log = KVEventLog(max_events=max_events)
    bm = BlockManager(12, 4, events=log)
    live = []
    view: set[int] = set()
    cursor = 0
    rng = random.Random(len(ops))
    for prefix, length, reset in ops:
        seq = make_seq([prefix] * 4 + [rng.randrange(3) for _ in range(length)])
        if bm.admit(seq, seq.num_tokens) is None:      # pool too small: free everything and retry
            for s in live:
                bm.free_seq(s)
            live.clear()
            if bm.admit(seq, seq.num_tokens) is None:
                continue
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
        live.append(seq)
        if len(live) > 2:
            bm.free_seq(live.pop(0))
        if reset:
            bm.reset_prefix_cache()
        cursor = replay(log, view, cursor)
        assert view == set(bm.cached), "the event-fed view differs from the prefix cache"
        assert log.stored_hashes() == set(bm.cached)


def test_stored_hashes_are_the_prompt_hashes():
    log = KVEventLog()
    bm = BlockManager(16, 4, events=log)
    tokens = list(range(100, 111))                       # 2 full blocks + 3 tokens
    run_prefill(bm, make_seq(tokens))
    stored = [h for e in log.since(0)["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    assert stored == prompt_block_hashes(tokens, 4)


def test_log_is_bounded_and_lagging_or_foreign_cursors_get_a_snapshot():
    log = KVEventLog(max_events=4)
    first = log.since(0)
    assert [e["type"] for e in first["events"]] == [ALL_CLEARED] and first["last_id"] == 1
    for i in range(10):
        log.stored([i])
    log.removed([3])
    assert log.last_id == 12 and len(log.since(8)["events"]) == 4
    old = log.since(2)                                    # events 3..8 were dropped
    assert old["snapshot"] == [0, 1, 2, 4, 5, 6, 7, 8, 9] and old["events"] == []
    assert "snapshot" in log.since(50)                    # a cursor from a longer-lived predecessor
    assert "snapshot" in log.since(10, replica_id="another-life")
    assert log.since(10, replica_id=log.replica_id)["events"][0]["id"] == 11
    restarted = KVEventLog()
    assert restarted.replica_id != log.replica_id and restarted.last_id == 1


def test_engine_publishes_the_hashes_a_prompt_hasher_computes():
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", block_size=4))
    try:
        hasher = PromptHasher.from_pretrained(tiny_checkpoint(), block_size=4)
        text = "the shared system prompt of many users, long enough for several blocks"
        ids = hasher.text_ids(text)
        engine.add_request("a", text, SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        page = engine.kv_events.since(0)
        stored = {h for e in page["events"] if e["type"] == "stored" for h in e["block_hashes"]}
        expected = hasher.hashes(ids)
        assert expected and set(expected) <= stored
        assert page["replica_id"] == engine.kv_events.replica_id
    finally:
        engine.close()
