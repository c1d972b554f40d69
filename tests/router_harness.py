"""A live `python -m server.router` in a subprocess over live replicas (see server_harness.LiveServer)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_harness import REPO, free_port


class LiveRouter:
    def __init__(self, replicas: list[str], tokenizer: Path, *extra: str, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "server.router", "--port", str(self.port), "--tokenizer", str(tokenizer),
                     "--log-level", "warning", "--poll-interval", "0.1", "--health-interval", "0.3", *extra]
        for r in replicas:
            self.args += ["--replica", r]
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LiveRouter:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"namazu-router-{self.port}.log", "w+")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise TimeoutError(f"router did not become healthy in {self.timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def state(self) -> dict:
        return httpx.get(self.url + "/router/state", timeout=5).json()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
