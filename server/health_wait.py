"""Waiting for a namazu HTTP process (server, router, Ray Serve application) to answer /health.

One loop for everything that starts such a process and must not talk to it before it is up: the live-process
test harness and the benchmarks that spawn replicas and routers.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(url: str, timeout: float, what: str, proc: subprocess.Popen | None = None,
                 output: Callable[[], str] = lambda: "", interval: float = 0.1) -> None:
    """Polls `url`/health until it answers 200. Raises RuntimeError at once, with `output()`, if `proc`
    exits first, and TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} did not become healthy in {timeout:.0f}s:\n{output()}")
