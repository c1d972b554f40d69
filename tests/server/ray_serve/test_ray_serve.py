"""namazu on a local Ray Serve (2 CPUs, tiny random checkpoint, one thread per replica).

--replicas 3:3: a shared prefix sticks to the replica that caches it and a burst reaches every replica.
--replicas 1:3: a load ramp scales the engine deployment up on queue depth and, once the load stops,
back down to one replica, with no failed request. Both are slow (Ray start-up and replica start-up
dominate: about 1 and 2 minutes on an idle 2-core machine) and bounded by explicit deadlines.
"""
from __future__ import annotations

import os
import random
import signal
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import free_port, make_tiny_model, wait_healthy

from namazu.engine_config import EngineConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray
    from ray import serve

    model = make_tiny_model(tmp_path_factory.mktemp("ray-model"))
    yield model
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def serve_app(ray_local):
    """Each test gets its own Serve instance (its own HTTP port); the local Ray stays up."""
    from ray import serve

    yield ray_local
    serve.shutdown()


def _deploy(model, lo: int, hi: int, **kw):
    from server.ray_serve.launch import ServeOptions, start

    port = free_port()
    config = EngineConfig(model=str(model), **kw.pop("engine", {}))
    start(config, ServeOptions(lo, hi, port=port, ray_num_cpus=2, **kw))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 120, "the Ray Serve application", interval=0.5)
    return url


def _running_replicas() -> int:
    from ray import serve

    dep = serve.status().applications["namazu"].deployments["NamazuEngine"]
    return dep.replica_states.get("RUNNING", 0)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(n))


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_three_replicas_route_by_prefix_and_spread_a_burst(serve_app):
    url = _deploy(serve_app, 3, 3)
    deadline = time.monotonic() + 60
    while _running_replicas() < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running_replicas() == 3
    time.sleep(1.5)           # every replica's routing stats reached the ingress's router
    rng = random.Random(0)
    prefix = "system: " + _words(rng, 60)
    served, cached = [], []
    for i in range(5):
        r = _post(url, {"prompt": f"{prefix} question {i}: {_words(rng, 3)}", "max_tokens": 2})
        assert r.status_code == 200, r.text
        served.append(r.headers["x-namazu-replica"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(served)) == 1, f"the shared prefix was spread over {set(served)}"
    assert all(c >= 320 for c in cached[1:]), cached

    system = "be brief. " + _words(rng, 4)
    bodies = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": _words(rng, 40)}],
               "max_tokens": 16, "ignore_eos": True} for _ in range(15)]
    with ThreadPoolExecutor(15) as pool:
        responses = list(pool.map(lambda b: _post(url, b, "/v1/chat/completions"), bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    counts: dict[str, int] = {}
    for r in responses:
        counts[r.headers["x-namazu-replica"]] = counts.get(r.headers["x-namazu-replica"], 0) + 1
    assert len(counts) == 3 and min(counts.values()) >= 0.15 * len(bodies), counts
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "namazu_router_decisions_total" in metrics and "namazu_router_replica_cost" in metrics


def test_autoscaling_up_under_a_ramp_and_back_down_without_failures(serve_app):
    url = _deploy(serve_app, 1, 3, upscale_delay_s=1.0, downscale_delay_s=4.0, target_queue=0.5,
                  engine={"max_num_seqs": 1})
    assert _running_replicas() == 1
    results: list[int] = []
    stop = threading.Event()

    def user(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            r = _post(url, {"prompt": _words(rng, 20), "max_tokens": 48, "ignore_eos": True})
            results.append(r.status_code)

    users = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    for t in users:
        t.start()
    try:
        peak, deadline = 1, time.monotonic() + 150
        while time.monotonic() < deadline and peak < 2:
            peak = max(peak, _running_replicas())
            time.sleep(0.5)
        time.sleep(3)                           # the new replica takes traffic before the ramp ends
    finally:
        stop.set()
        for t in users:
            t.join(timeout=180)
    assert peak >= 2, "no replica was added under a queue of 6 users on one replica with --max-num-seqs 1"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and _running_replicas() > 1:
        time.sleep(1)
    assert _running_replicas() == 1, "the deployment did not scale back down after the load stopped"
    assert results and all(s == 200 for s in results), f"failed requests: {[s for s in results if s != 200]}"


def _router_state(url: str) -> dict:
    return httpx.get(url + "/router/state", timeout=10).json()["replicas"]


def _stream(url: str, body: dict, live: dict[str, int] | None = None) -> tuple[int, list[str]]:
    """A streamed completion's data lines; `live` counts the streams each replica is sending right now."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        replica = r.headers.get("x-namazu-replica", "")
        if live is not None:
            with _live_lock:
                live[replica] = live.get(replica, 0) + 1
        try:
            return r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")]
        finally:
            if live is not None:
                with _live_lock:
                    live[replica] -= 1


_live_lock = threading.Lock()


def test_killed_replica_is_retried_elsewhere_leaves_the_router_and_its_replacement_warms_first(serve_app):
    """SIGKILL one engine replica's process while it holds requests under a steady load: no request is
    lost (non-streamed ones and streams that had sent nothing finish elsewhere, a stream cut mid-way
    ends in band), the ingress's router forgets the dead replica, and Ray Serve's replacement gets its
    first request only after its warm-up finished."""
    url = _deploy(serve_app, 3, 3, engine={"max_num_seqs": 1})     # requests queue on every replica
    deadline = time.monotonic() + 60
    while _running_replicas() < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running_replicas() == 3
    results: list[tuple[str, int, object]] = []
    live: dict[str, int] = {}       # namazu replica id -> streams it is sending now
    stop = threading.Event()

    def user(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            body = {"prompt": _words(rng, 20), "max_tokens": 24, "ignore_eos": True}
            try:
                if seed % 2 == 0:
                    # long enough that a stream seen running is still running at the kill a moment later
                    results.append(("stream", *_stream(url, {**body, "max_tokens": 64}, live)))
                else:
                    r = _post(url, body)
                    results.append(("plain", r.status_code, r.json() if r.status_code == 200 else r.text))
            except httpx.HTTPError as e:       # a dropped connection is a lost request too
                results.append(("broken", 0, repr(e)))

    users = [threading.Thread(target=user, args=(i,)) for i in range(12)]
    for t in users:
        t.start()
    try:
        # A victim in the middle of a stream (its one running request) with at least three more queued
        # (likely streams among them too, which have sent nothing yet).
        victim, deadline = None, time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            busy = [(rid, s) for rid, s in _router_state(url).items()
                    if s.get("open_requests", 0) >= 4 and s.get("pid") and live.get(s.get("namazu_replica_id"))]
            victim = busy[0] if busy else None
            time.sleep(0.05)
        assert victim is not None, f"no replica held four requests, one a stream: {_router_state(url)}, {live}"
        rid, info = victim
        os.kill(info["pid"], signal.SIGKILL)
        killed_at = time.time()
        deadline = time.monotonic() + 60
        while rid in _router_state(url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rid not in _router_state(url), "the dead replica is still in the ingress router's state"
        # The replacement: a new replica id that the router has sent requests to.
        deadline, fresh = time.monotonic() + 150, {}
        while time.monotonic() < deadline:
            state = _router_state(url)
            fresh = {r: s for r, s in state.items() if s.get("first_routed_at", 0) > killed_at
                     and s.get("warm_at") and r != rid and s.get("decisions", 0) > 0}
            if fresh:
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for t in users:
            t.join(timeout=180)
    assert fresh, f"Ray Serve's replacement replica never got a request: {_router_state(url)}"
    for r, s in fresh.items():
        assert s["warm_at"] <= s["first_routed_at"], f"replica {r} got traffic before its warm-up ended: {s}"
    assert not [x for x in results if x[0] == "broken"], [x for x in results if x[0] == "broken"]
    plain = [x for x in results if x[0] == "plain"]
    streams = [x for x in results if x[0] == "stream"]
    assert plain and streams
    assert all(code == 200 for _, code, _ in plain), [x for x in plain if x[1] != 200]
    assert all(body["usage"]["completion_tokens"] == 24 for _, _, body in plain)
    cut = 0
    for _, code, lines in streams:     # complete, or cut mid-way by the kill and ended in band
        assert code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        if any('"error"' in line for line in lines):   # only a stream that had sent tokens may be cut
            assert any('"text"' in line for line in lines if '"error"' not in line), lines
            cut += 1
    assert cut >= 1, "the victim was streaming when it was killed, yet no stream ended in band"
    assert len(_router_state(url)) == 3
