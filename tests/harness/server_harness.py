"""Live HTTP processes for the API tests: a deterministic tiny random checkpoint (byte-level tokenizer,
chat template) served by `python -m namazu.server` in a subprocess on a free port of 127.0.0.1, and the one
start-and-wait-for-/health helper every live process (server, router, Ray Serve app) uses."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from server.health_wait import wait_healthy

REPO = Path(__file__).resolve().parents[2]


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A deterministic random 'tiny' checkpoint with the byte-level tokenizer and a chat template."""
    from namazu.assets.random_model import write_random_checkpoint

    return write_random_checkpoint(path, "tiny", seed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveProcess:
    """A `python -m MODULE --port P ...` HTTP process on a free port of 127.0.0.1, up once its /health
    answers; its output goes to a temporary log (`output()`), and leaving the block stops it."""

    what = "process"
    stop_timeout = 20.0

    def __init__(self, module: str, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", module, "--port", str(self.port), "--log-level", "warning", *args]
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.log = None

    def __enter__(self) -> LiveProcess:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"namazu-{self.what}-{self.port}.log", "w+")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.timeout, self.what, self.proc, self.output)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None and not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)


class LiveServer(LiveProcess):
    """`python -m namazu.server` in a subprocess; `with LiveServer(model_dir, ...) as srv: srv.url`."""

    what = "server"

    def __init__(self, model: Path, *extra: str, api_key: str | None = None, timeout: float = 180.0):
        super().__init__("namazu.server", "--model", str(model), *extra,
                         *(("--api-key", api_key) if api_key else ()), timeout=timeout)
        self.api_key = api_key
        self.model = model

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The /metrics samples as {'name{labels}': value}, without the model_name label every series of a
        server has (tests/test_server_metrics.py checks it)."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        return parse_metrics(text)


def parse_metrics(text: str, keep_model_name: bool = False) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if not keep_model_name:
                key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out
