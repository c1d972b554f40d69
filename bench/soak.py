"""Soak test: a burst of concurrent streams with random disconnects, then a steady load, against a live
server; every request must end completed, disconnected by its client, or with a clean error.

Phase 1 (burst): `--burst` streaming requests at once (mixed prompt and output lengths; a fraction of the
clients hang up after a random number of chunks). Phase 2 (steady): `--duration` seconds with
`--concurrency` requests always in flight (streamed and not, same mix of lengths and hang-ups).

Each request is classified:
- completed: 200 and every choice has exactly max_tokens tokens (ignore_eos), streams end with [DONE];
- disconnected: the client hung up on purpose;
- clean error: an OpenAI-shaped error (4xx/5xx JSON, or an in-band error event followed by [DONE]);
- lost: anything else (a reset connection, a stream without [DONE], a wrong token count, a client
  timeout). Must be 0.
After each phase, once the server is idle, the KV blocks still held (must be 0) and the server's RSS
(server process plus its workers) are recorded.

    python bench/soak.py                               # 500-stream burst + 10-minute steady load
    python bench/soak.py --duration 60 --write         # a short run, table into bench/RESULTS.md
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

from server.health_wait import wait_healthy

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
WORDS = "the quick brown fox jumps over a lazy dog while 鯰 swims in the river under 東京 skies".split()


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    clean_errors: int = 0
    lost: int = 0

    def add(self, outcome: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)

    @property
    def total(self) -> int:
        return self.completed + self.disconnected + self.clean_errors + self.lost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the model-runner workers), MiB."""
    total = 0
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            # Every series carries model_name; the soak reads them by bare name.
            key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def _leaked_blocks(url: str, timeout: float = 60) -> int:
    """KV blocks still held once the server is idle (waits for running requests to drain)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        held = round(m["namazu_kv_cache_usage_ratio"] * m["namazu_engine_num_kv_blocks"])
        if (held == 0 and m["namazu_num_requests_running"] == 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _body(rng: random.Random, stream: bool, max_out: int) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((2, 8, 32, 96))))
    return {"prompt": prompt, "max_tokens": rng.randint(1, max_out), "ignore_eos": True, "stream": stream,
            "temperature": rng.choice((0.0, 0.8)), "n": rng.choice((1, 1, 1, 2))}


async def one_request(client: httpx.AsyncClient, rng: random.Random, stream: bool, hangup: float,
                      max_out: int) -> str:
    body = _body(rng, stream, max_out)
    want = body["max_tokens"]
    hang_after = rng.randint(1, 8) if rng.random() < hangup else None
    try:
        if not stream:
            if hang_after is not None:
                try:
                    await asyncio.wait_for(client.post("/v1/completions", json=body), rng.uniform(0.05, 0.5))
                except asyncio.TimeoutError:
                    return "disconnected"
                return "completed"      # it finished before the hang-up
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return "clean_errors" if "error" in r.json() else "lost"
            out = r.json()
            ok = out["usage"]["completion_tokens"] == want * body["n"] and len(out["choices"]) == body["n"]
            return "completed" if ok else "lost"
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return "clean_errors" if "error" in json.loads(r.text) else "lost"
            chunks, done, error = 0, False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                error = error or "error" in event
                chunks += 1
                if hang_after is not None and chunks >= hang_after:
                    return "disconnected"
            if error:
                return "clean_errors" if done else "lost"
            return "completed" if done else "lost"
    except (httpx.HTTPError, json.JSONDecodeError):
        return "lost"


async def burst(url: str, n: int, hangup: float, max_out: int, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        rngs = [random.Random(rng.random()) for _ in range(n)]
        for outcome in await asyncio.gather(*(one_request(client, r, True, hangup, max_out) for r in rngs)):
            tally.add(outcome)
    return tally


async def steady(url: str, duration: float, concurrency: int, hangup: float, max_out: int, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    end = time.monotonic() + duration
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        async def user(r: random.Random) -> None:
            while time.monotonic() < end:
                tally.add(await one_request(client, r, r.random() < 0.7, hangup, max_out))
        await asyncio.gather(*(user(random.Random(rng.random())) for _ in range(concurrency)))
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded namazu-tiny)")
    p.add_argument("--burst", type=int, default=500, help="concurrent streams of phase 1 (default: 500)")
    p.add_argument("--duration", type=float, default=600, help="seconds of steady load (default: 600)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in phase 2 (default: 32)")
    p.add_argument("--hangup", type=float, default=0.2, help="fraction of clients that hang up (default: 0.2)")
    p.add_argument("--max-out", type=int, default=64, help="longest output of a request (default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--max-num-seqs 64 --max-waiting-seqs 1024 --kv-cache-memory 256MiB",
                   help="extra flags for the server")
    p.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = p.parse_args(argv)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "namazu.server", "--port", str(port), "--log-level", "warning",
           *args.server_args.split()]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        try:
            wait_healthy(url, 600, "the server", proc, interval=0.3)
        except (RuntimeError, TimeoutError) as err:
            raise SystemExit(f"the server did not start: {err}") from None
        rows = []
        rss0 = _rss_mib(proc.pid)
        t0 = time.monotonic()
        tally = asyncio.run(burst(url, args.burst, args.hangup, args.max_out, args.seed))
        rows.append((f"burst: {args.burst} concurrent streams", time.monotonic() - t0, tally, _leaked_blocks(url),
                     rss0, _rss_mib(proc.pid)))
        print(rows[-1], flush=True)
        rss0 = _rss_mib(proc.pid)
        t0 = time.monotonic()
        tally = asyncio.run(steady(url, args.duration, args.concurrency, args.hangup, args.max_out, args.seed + 1))
        rows.append((f"steady: {args.concurrency} in flight for {args.duration:g} s", time.monotonic() - t0, tally,
                     _leaked_blocks(url), rss0, _rss_mib(proc.pid)))
        print(rows[-1], flush=True)
        alive = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        code = proc.wait(timeout=120)
    table = ["| phase | wall s | requests | completed | disconnected (by client) | clean errors | lost | "
             "KV blocks leaked | RSS start MiB | RSS end MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, wall, t, leaked, r0, r1 in rows:
        table.append(f"| {name} | {wall:.0f} | {t.total} | {t.completed} | {t.disconnected} | {t.clean_errors} | "
                     f"{t.lost} | {leaked} | {r0:.0f} | {r1:.0f} |")
    text = "\n".join(table)
    print(text)
    print(f"server healthy after the soak: {alive}; exit code after SIGTERM: {code}")
    if args.write:
        body = (f"## Soak (`python bench/soak.py --burst {args.burst} --duration {args.duration:g} "
                f"--concurrency {args.concurrency}`, {time.strftime('%Y-%m-%d')})\n\n"
                f"Server flags: `{args.server_args}`; model: {args.model or 'embedded namazu-tiny'}; "
                f"{int(args.hangup * 100)}% of clients hang up after 1-8 chunks (streams) or 0.05-0.5 s "
                f"(non-streamed); outputs 1-{args.max_out} tokens, n 1 or 2.\n\n{text}\n\n"
                f"Healthy after the soak: {alive}; exit code after SIGTERM: {code}.")
        write_section(BEGIN, END, body)
    bad = sum(r[2].lost for r in rows) + sum(r[3] for r in rows)
    return 1 if bad or not alive or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
