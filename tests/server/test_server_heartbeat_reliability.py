"""An idle hung worker is reported and replaced from its heartbeat (issue 34, item 11): with the default
--step-timeout (600 s) a stopped worker was reported healthy for ten minutes, the idle ping waiting on it
the whole time, although its heartbeat was stale after 8 s."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_harness import LiveServer, make_tiny_model


def _worker_pid(server_pid: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("no worker process found")


def _health(srv: LiveServer) -> int:
    try:
        return httpx.get(srv.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return -1


def _served(srv: LiveServer) -> bool:
    try:
        return httpx.post(srv.url + "/v1/completions", json={"prompt": "back", "max_tokens": 2},
                          timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def _within(cond, timeout: float, step: float = 0.1) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_idle_hung_worker_is_unhealthy_from_its_heartbeat_and_replaced(model):
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4") as srv:
        assert _served(srv)
        pid = _worker_pid(srv.proc.pid)
        os.kill(pid, signal.SIGSTOP)         # idle and hung; --step-timeout is the default 600 s
        try:
            assert _within(lambda: _health(srv) == 503, 15, 0.1) < 15
            assert "heartbeat" in httpx.get(srv.url + "/health", timeout=2).json()["status"]
            _within(lambda: "hung" in srv.output(), 10, 0.2)      # killed as hung, still stopped
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _within(lambda: _served(srv), 60, 0.5)         # a fresh worker serves
        assert _health(srv) == 200
        assert "engine restarted" in srv.output()
