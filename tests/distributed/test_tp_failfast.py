"""`python -m namazu.server --tp 4` serves the default model (namazu-tiny) to the openai client; then
fail-fast under tensor parallelism: SIGKILL (dead) or SIGSTOP (hung: its peers wait in a collective
forever, only its missing heartbeat tells) one of four worker ranks of a live `--tp 4` server under
load. Within 10 s /health fails and every in-flight stream ends with an error; the server then exits
non-zero with a message naming the rank's pid, and no worker process is left behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_harness import LiveServer

from namazu.assets import default_model_path


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            kids.append(int(entry))
    return sorted(kids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stream(url: str, outcome: dict, started: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True,
            "temperature": 0}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome["end"] = "done"
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["end"] = "error"
                    break
                outcome["chunks"] = outcome.get("chunks", 0) + 1
                if outcome["chunks"] >= 2:
                    started.set()
            else:
                outcome.setdefault("end", "closed without [DONE]")
    except httpx.HTTPError as err:
        outcome["end"] = f"transport error: {type(err).__name__}"
    outcome["at"] = time.monotonic()


@pytest.mark.parametrize("sig, words", [(signal.SIGKILL, "died"), (signal.SIGSTOP, "is hung")])
def test_a_dead_or_hung_rank_fails_fast_and_leaves_no_process(sig, words):
    with LiveServer(default_model_path(), "--tp", "4", "--max-model-len", "256", "--served-model-name", "tiny",
                    "--kv-cache-memory", "16MiB") as srv:
        workers = _children(srv.proc.pid)
        assert len(workers) == 4, workers
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "日本の首都は"}],
                                              max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "日本の首都は"}], max_tokens=8, temperature=0,
            stream=True) if c.choices)
        assert chat.choices[0].message.content and streamed == chat.choices[0].message.content
        outcomes = [{} for _ in range(4)]
        started = [threading.Event() for _ in outcomes]
        threads = [threading.Thread(target=_stream, args=(srv.url, o, s), daemon=True)
                   for o, s in zip(outcomes, started)]
        for t in threads:
            t.start()
        for s in started:
            assert s.wait(60), "streams did not start"
        victim = workers[2]
        os.kill(victim, sig)
        killed = time.monotonic()
        unhealthy = None
        while time.monotonic() - killed < 15:
            try:
                if httpx.get(srv.url + "/health", timeout=1).status_code != 200:
                    unhealthy = time.monotonic() - killed
                    break
            except httpx.HTTPError:
                unhealthy = time.monotonic() - killed
                break
            time.sleep(0.1)
        assert unhealthy is not None and unhealthy < 10, unhealthy
        for t in threads:
            t.join(15)
        for o in outcomes:
            assert o.get("end") not in (None, "done"), outcomes
            assert o["at"] - killed < 10, outcomes
        srv.proc.wait(timeout=30)
        assert srv.proc.returncode != 0
        out = srv.output()
        assert f"rank 2 (pid {victim}) {words}" in out, out
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)]


def test_ranks_end_when_the_engine_process_is_killed(tmp_path):
    """SIGKILL of the engine's own process (no cleanup runs there): every rank notices its parent is
    gone and exits, so no worker is orphaned."""
    import subprocess
    import sys

    from namazu.assets.random_model import write_random_checkpoint

    ckpt = write_random_checkpoint(tmp_path / "m", "tiny", seed=1)
    script = ("import time\nfrom namazu import LLM\n"
              f"llm = LLM({str(ckpt)!r}, tensor_parallel_size=2)\n"
              "print(*llm.engine.executor.pids, flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
