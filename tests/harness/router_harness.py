"""A live `python -m server.router` in a subprocess over live replicas (see server_harness.LiveProcess)."""
from __future__ import annotations

from pathlib import Path

import httpx
from server_harness import LiveProcess


class LiveRouter(LiveProcess):
    what = "router"
    stop_timeout = 10.0

    def __init__(self, replicas: list[str], tokenizer: Path, *extra: str, timeout: float = 60.0):
        super().__init__("server.router", "--tokenizer", str(tokenizer), "--poll-interval", "0.1",
                         "--health-interval", "0.3", *extra, *(x for r in replicas for x in ("--replica", r)),
                         timeout=timeout)

    def state(self) -> dict:
        return httpx.get(self.url + "/router/state", timeout=5).json()
