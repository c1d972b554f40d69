"""Faults of the process tree and the server's life cycle, against live servers on 127.0.0.1: the
model-runner worker killed (SIGKILL) while idle and while busy, a hung worker, SIGTERM with requests in
flight, start-up refusals, and connections that send nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import REPO, LiveServer, make_tiny_model

ARGS = ("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def worker_pid(server_pid: int) -> int:
    """The spawned model-runner process among the server's children (not multiprocessing's tracker)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
        for pid in children:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("no worker process found")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def running(srv: LiveServer) -> float:
    return srv.metrics()["namazu_num_requests_running"]


def health(srv: LiveServer) -> int:
    try:
        return httpx.get(srv.url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return -1


def wait_for(cond, timeout: float, step: float = 0.1) -> float:
    """Seconds until cond() held; fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def served(srv: LiveServer) -> bool:
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "back", "max_tokens": 2}, timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


class Stream:
    """A streaming completion read on a thread: its SSE data lines, and whether it ended with [DONE]."""

    def __init__(self, srv: LiveServer, max_tokens: int = 230):
        self.lines: list[str] = []
        self.started = threading.Event()
        body = {"prompt": "long stream", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

        def run() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> tuple[list[dict], bool]:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        done = bool(self.lines) and self.lines[-1] == "[DONE]"
        return [json.loads(x) for x in self.lines if x != "[DONE]"], done


def slow_steps() -> tuple[str, ...]:
    """Streams outlast the fault on any machine: each step takes at least 50 ms."""
    return ("--debug-step-delay", "0.05")


def test_worker_killed_while_idle_is_noticed_and_restarted(model):
    with LiveServer(model, *ARGS) as srv:
        os.kill(worker_pid(srv.proc.pid), signal.SIGKILL)
        assert wait_for(lambda: health(srv) != 200, 10, 0.05) < 10
        wait_for(lambda: served(srv), 60, 0.5)
        assert health(srv) == 200 and srv.proc.poll() is None


def test_worker_killed_while_busy_fails_requests_in_flight_then_serves_again(model):
    with LiveServer(model, *ARGS, *slow_steps()) as srv:
        stream = Stream(srv)
        assert stream.started.wait(30)
        result: dict = {}

        def blocking() -> None:
            result["r"] = httpx.post(srv.url + "/v1/completions", timeout=120,
                                     json={"prompt": "waiting", "max_tokens": 230, "ignore_eos": True})
        t = threading.Thread(target=blocking, daemon=True)
        t.start()
        wait_for(lambda: running(srv) >= 2, 30, 0.02)       # both in the engine when the worker dies
        os.kill(worker_pid(srv.proc.pid), signal.SIGKILL)
        assert wait_for(lambda: health(srv) != 200, 10, 0.05) < 10
        chunks, done = stream.result()
        assert done and "error" in chunks[-1], chunks[-1:]
        assert chunks[-1]["error"]["code"] == "engine_unavailable"
        t.join(60)
        assert result["r"].status_code == 503 and result["r"].json()["error"]["code"] == "engine_unavailable"
        assert "Retry-After" in result["r"].headers
        wait_for(lambda: served(srv), 60, 0.5)


def test_worker_death_without_restarts_exits_non_zero(model):
    with LiveServer(model, *ARGS, "--max-worker-restarts", "0") as srv:
        os.kill(worker_pid(srv.proc.pid), signal.SIGKILL)
        assert wait_for(lambda: srv.proc.poll() is not None or health(srv) != 200, 10, 0.05) < 10
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1, srv.output()
        assert "died" in srv.output()


def test_hung_worker_is_killed_after_the_step_timeout(model):
    with LiveServer(model, *ARGS, "--step-timeout", "2") as srv:
        pid = worker_pid(srv.proc.pid)
        os.kill(pid, signal.SIGSTOP)         # hung: alive, but no step ever completes
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hang", "max_tokens": 4}, timeout=60)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert r.status_code == 503, r.text
        wait_for(lambda: served(srv), 60, 0.5)


def test_sigterm_finishes_short_requests_and_ends_long_ones_cleanly(model):
    with LiveServer(model, *ARGS, *slow_steps(), "--shutdown-timeout", "2") as srv:
        long = Stream(srv, max_tokens=230)          # 230 steps x 50 ms: far past the 2 s allowed; 20: within
        assert long.started.wait(30)
        result: dict = {}

        def blocking(name: str, max_tokens: int) -> None:
            result[name] = httpx.post(srv.url + "/v1/completions", timeout=60,
                                      json={"prompt": name, "max_tokens": max_tokens, "ignore_eos": True})
        threads = [threading.Thread(target=blocking, args=a, daemon=True) for a in (("short", 20), ("long", 230))]
        for t in threads:
            t.start()
        wait_for(lambda: running(srv) >= 3, 30, 0.02)       # all three in flight at the signal
        wpid = worker_pid(srv.proc.pid)
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(srv) != 200, 5, 0.05) < 5
        for t in threads:
            t.join(60)
        chunks, done = long.result()
        assert done and chunks[-1]["error"]["code"] == "engine_unavailable", chunks[-1:]
        assert result["short"].status_code == 200, result["short"].text
        assert result["short"].json()["usage"]["completion_tokens"] == 20
        assert result["long"].status_code == 503 and result["long"].json()["error"]["message"]
        assert srv.proc.wait(timeout=30) == 0, srv.output()
        assert wait_for(lambda: not alive(wpid), 10) < 10        # the engine shut its worker down


def test_silent_connections_are_closed(model):
    with LiveServer(model, *ARGS, "--header-timeout", "1", "--body-timeout", "1") as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:      # says nothing at all
            s.settimeout(10)
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", srv.port)) as s:      # headers, then no body
            s.settimeout(10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert served(srv)


@pytest.mark.parametrize("argv,key_env,message", [
    (["--api-key", ""], None, "empty"),
    (["--api-key", "  "], None, "empty"),
    ([], "", "NAMAZU_API_KEY) is empty"),
    (["--shutdown-timeout", "0"], None, "shutdown-timeout"),
    (["--max-waiting-seqs", "-1"], None, "max-waiting-seqs"),
])
def test_start_up_refusals(argv, key_env, message):
    env = {k: v for k, v in os.environ.items() if k != "NAMAZU_API_KEY"}
    if key_env is not None:
        env["NAMAZU_API_KEY"] = key_env
    p = subprocess.run([sys.executable, "-m", "namazu.server", *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_defaults_bind_loopback_and_no_cors():
    from namazu.server import build_parser

    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1"
    assert not any("cors" in a.dest for a in build_parser()._actions)


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(model):
    # 64 sequences x 1000 tokens with top-20 logprobs make ~50 MB of events, many times what the socket
    # buffers hold (the client's receive buffer is pinned at 4 KiB; the server's send buffer grows to at
    # most tcp_wmem's 4 MiB); each step takes >= 50 ms, so the request cannot end by itself in under 50 s,
    # long after a server, however slow at writing events, has filled the buffers. The server must cut the
    # client (write timeout 1 s once the buffers are full) and abort all 64 sequences before they finish.
    with LiveServer(model, "--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--max-num-seqs", "64",
                    *slow_steps(), "--write-timeout", "1") as srv:
        body = json.dumps({"prompt": "never read", "n": 64, "max_tokens": 1000, "ignore_eos": True,
                           "stream": True, "logprobs": 20}).encode()
        before = srv.metrics()
        aborted = 'namazu_request_success_total{finish_reason="abort"}'
        length = 'namazu_request_success_total{finish_reason="length"}'

        def ended() -> bool:
            m = srv.metrics()
            return m.get(aborted, 0) + m.get(length, 0) >= before.get(aborted, 0) + before.get(length, 0) + 64

        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(ended, 180, 0.2)
        m = srv.metrics()
        assert m.get(aborted, 0) - before.get(aborted, 0) == 64, "the request ended by itself, not cut"
        assert m.get(length, 0) == before.get(length, 0)
        wait_for(lambda: srv.metrics()["namazu_kv_cache_usage_ratio"] == 0.0, 10)
        # The response generator was closed when the client was cut, not when garbage collection found it.
        assert srv.metrics()["namazu_requests_in_flight"] == 0
        assert "without completing response" not in srv.output()
        assert served(srv)


def test_hung_worker_is_noticed_while_idle(model):
    with LiveServer(model, *ARGS, "--step-timeout", "2") as srv:
        pid = worker_pid(srv.proc.pid)
        os.kill(pid, signal.SIGSTOP)         # hung while nothing runs: only a ping can tell
        try:
            assert wait_for(lambda: health(srv) != 200, 10, 0.05) < 10
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait_for(lambda: served(srv), 60, 0.5)
        assert "hung" in srv.output()
