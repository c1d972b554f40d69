"""A live namazu server for the API tests: a deterministic tiny random checkpoint (byte-level tokenizer,
chat template) served by `python -m namazu.server` in a subprocess on a free port of 127.0.0.1."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A deterministic random 'tiny' checkpoint with the byte-level tokenizer and a chat template."""
    from namazu.assets.random_model import write_random_checkpoint

    return write_random_checkpoint(path, "tiny", seed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m namazu.server` in a subprocess; `with LiveServer(model_dir, ...) as srv: srv.url`."""

    def __init__(self, model: Path, *extra: str, api_key: str | None = None, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.model = model
        self.args = [sys.executable, "-m", "namazu.server", "--model", str(model), "--port", str(self.port),
                     "--log-level", "warning", *extra]
        if api_key:
            self.args += ["--api-key", api_key]
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.log = None

    def __enter__(self) -> LiveServer:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"namazu-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server did not become healthy in {self.timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The /metrics samples as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out
