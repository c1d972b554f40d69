"""Liveness of worker processes: a heartbeat the engine reads, and a watchdog for the worker's parent.

Each worker bumps a shared timestamp from a daemon thread; a process that is stopped or wedged (not
just busy in a long kernel, which releases the GIL) stops bumping it, and the engine declares the rank
hung after `HANG_SECONDS`. The watchdog ends a worker whose engine process is gone (killed with
SIGKILL, say), so no rank outlives the server.
"""
from __future__ import annotations

import os
import threading
import time

HANG_SECONDS = 8.0
_BEAT_SECONDS = 0.25


def start_heartbeat(beat) -> None:
    """`beat`: a multiprocessing Value('d') shared with the engine."""
    def run() -> None:
        while True:
            beat.value = time.monotonic()
            time.sleep(_BEAT_SECONDS)

    beat.value = time.monotonic()
    threading.Thread(target=run, name="namazu-heartbeat", daemon=True).start()


def start_parent_watchdog(parent_pid: int) -> None:
    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=run, name="namazu-parent-watchdog", daemon=True).start()


def stale_seconds(beat) -> float:
    """How long since the worker last beat (CLOCK_MONOTONIC is shared by the processes of a machine)."""
    return time.monotonic() - beat.value
