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

Phase 3 (`--hostile-duration S`): S seconds of normal traffic alone, then S seconds of the same normal
traffic beside a hostile mix: slow readers (streams whose socket is never read: the write timeout must
cut them and abort their sequences), dribblers (a POST announcing a 1 MB body, then one byte every 2 s:
the body deadline must close them), compile storms (structured-output requests with large distinct
schemas, half hung up after 0.5 s) and hang-ups. Reported: normal requests lost, every 5xx (normal or
hostile), KV blocks leaked, how long the longest dribbler was held, and the p50/p99 latency of the normal
requests without and with the hostile mix.

    python bench/soak.py                               # 500-stream burst + 10-minute steady load
    python bench/soak.py --duration 60 --write         # a short run, table into bench/RESULTS.md
    python bench/soak.py --burst 0 --duration 0 --hostile-duration 600 --write   # the hostile mix
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
HOSTILE_BEGIN, HOSTILE_END = "<!-- soak-hostile:begin -->", "<!-- soak-hostile:end -->"
HOSTILE_SERVER_ARGS = "--write-timeout 5 --body-timeout 5 --header-timeout 5"
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


# -- the hostile mix ----------------------------------------------------------------------------------------
@dataclass
class Hostile:
    slow_readers: int = 0
    dribblers: int = 0
    dribbler_max_held_s: float = 0.0
    compiles: int = 0
    compile_statuses: dict[int, int] | None = None
    server_errors: int = 0          # 5xx answers to hostile requests


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _raw(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


def _post(path: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


async def slow_reader(port: int, end: float, h: Hostile, hold: float) -> None:
    """A stream of many tokens whose socket is never read, held `hold` seconds."""
    body = json.dumps({"prompt": "never read", "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True,
                       "logprobs": 5}).encode()
    while time.monotonic() < end:
        _, w = await _raw(port, rcvbuf=4096)
        w.write(_post("/v1/completions", body))
        h.slow_readers += 1
        await asyncio.sleep(hold)
        w.close()


async def dribbler(port: int, end: float, h: Hostile) -> None:
    """Announces a 1 MB body, then sends one byte every 2 s until the server closes the connection."""
    while time.monotonic() < end:
        r, w = await _raw(port)
        w.write(_post("/v1/completions", b"{", length=1_000_000))
        h.dribblers += 1
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 120:
                await asyncio.sleep(2.0)
                w.write(b" ")
                await w.drain()
                try:      # the 401/408, or nothing; b"" once closed
                    if await asyncio.wait_for(r.read(65536), 0.01) == b"":
                        break
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            pass
        h.dribbler_max_held_s = max(h.dribbler_max_held_s, time.monotonic() - t0)
        w.close()


async def compile_storm(url: str, end: float, h: Hostile, rng: random.Random) -> None:
    """Structured-output requests with large distinct schemas; half hang up after 0.5 s."""
    h.compile_statuses = h.compile_statuses or {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < end:
            tag, n = rng.randrange(10**9), rng.randint(150, 400)
            schema = {"type": "object", "properties": {f"f{tag}_{j}": {"type": "integer"} for j in range(n)}}
            body = {"messages": [{"role": "user", "content": "json"}], "max_tokens": 8,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
            h.compiles += 1
            try:
                if rng.random() < 0.5:
                    await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 0.5)
                    continue
                r = await client.post("/v1/chat/completions", json=body)
            except (asyncio.TimeoutError, httpx.HTTPError):
                continue
            h.compile_statuses[r.status_code] = h.compile_statuses.get(r.status_code, 0) + 1
            h.server_errors += r.status_code >= 500
            if r.status_code == 429:
                await asyncio.sleep(0.5)


async def normal_load(url: str, duration: float, concurrency: int, max_out: int, seed: int,
                      hostile: Hostile | None, port: int) -> tuple[Tally, list[float], int]:
    """Normal traffic (the steady mix, no hang-ups) for `duration` s, beside the hostile mix if given;
    returns the tally, the latencies of completed normal requests and their 5xx count."""
    rng = random.Random(seed)
    tally, latencies, errors_5xx = Tally(), [], 0
    end = time.monotonic() + duration
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        async def user(r: random.Random) -> None:
            nonlocal errors_5xx
            while time.monotonic() < end:
                t0 = time.monotonic()
                outcome = await one_request(client, r, r.random() < 0.7, 0.0, max_out)
                tally.add(outcome)
                if outcome == "completed":
                    latencies.append(time.monotonic() - t0)
                elif outcome == "clean_errors":
                    errors_5xx += 1      # no hang-ups and no bad input here: any error is the server's
        tasks = [user(random.Random(rng.random())) for _ in range(concurrency)]
        if hostile is not None:
            hr = random.Random(seed + 7)
            tasks += [slow_reader(port, end, hostile, hold=8.0) for _ in range(2)]
            tasks += [dribbler(port, end, hostile) for _ in range(8)]
            tasks += [compile_storm(url, end, hostile, random.Random(hr.random())) for _ in range(3)]
        await asyncio.gather(*tasks)
    return tally, latencies, errors_5xx


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
    p.add_argument("--hostile-duration", type=float, default=0.0,
                   help="seconds of normal traffic alone, then as long beside the hostile mix (default: 0, off)")
    p.add_argument("--hostile-concurrency", type=int, default=4, help="normal requests in flight in phase 3")
    p.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.hostile_duration:
        args.server_args += " " + HOSTILE_SERVER_ARGS

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
        rows, hostile_rows = [], []
        if args.burst:
            rss0 = _rss_mib(proc.pid)
            t0 = time.monotonic()
            tally = asyncio.run(burst(url, args.burst, args.hangup, args.max_out, args.seed))
            rows.append((f"burst: {args.burst} concurrent streams", time.monotonic() - t0, tally,
                         _leaked_blocks(url), rss0, _rss_mib(proc.pid)))
            print(rows[-1], flush=True)
        if args.duration:
            rss0 = _rss_mib(proc.pid)
            t0 = time.monotonic()
            tally = asyncio.run(steady(url, args.duration, args.concurrency, args.hangup, args.max_out,
                                       args.seed + 1))
            rows.append((f"steady: {args.concurrency} in flight for {args.duration:g} s", time.monotonic() - t0,
                         tally, _leaked_blocks(url), rss0, _rss_mib(proc.pid)))
            print(rows[-1], flush=True)
        if args.hostile_duration:
            for hostile in (None, Hostile()):
                rss0 = _rss_mib(proc.pid)
                tally, lat, e5 = asyncio.run(normal_load(url, args.hostile_duration, args.hostile_concurrency,
                                                         args.max_out, args.seed + 2, hostile, port))
                hostile_rows.append((hostile, tally, lat, e5, _leaked_blocks(url), rss0, _rss_mib(proc.pid)))
                print(hostile_rows[-1][:2], flush=True)
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
    if rows:
        print(text)
    htext = _hostile_table(hostile_rows) if hostile_rows else ""
    print(htext)
    print(f"server healthy after the soak: {alive}; exit code after SIGTERM: {code}")
    if args.write and hostile_rows:
        write_section(HOSTILE_BEGIN, HOSTILE_END, (
            f"## Soak, hostile mix (`python bench/soak.py --burst 0 --duration 0 --hostile-duration "
            f"{args.hostile_duration:g} --max-out {args.max_out} --hostile-concurrency {args.hostile_concurrency}`, "
            f"{time.strftime('%Y-%m-%d')})\n\n"
            f"Server flags: `{args.server_args}`; model: {args.model or 'embedded namazu-tiny'}. Normal traffic: "
            f"{args.hostile_concurrency} users, the steady mix without hang-ups. Hostile: 2 slow readers (a "
            "4-sequence stream of 400 tokens with logprobs whose socket is never read, held 8 s), 8 dribblers "
            "(1 MB announced, a byte every 2 s), 3 compile storms (150-400-property distinct schemas, half "
            f"hung up after 0.5 s).\n\n{htext}\n\nHealthy after the soak: {alive}; exit code after "
            f"SIGTERM: {code}."))
    if args.write and rows:
        body = (f"## Soak (`python bench/soak.py --burst {args.burst} --duration {args.duration:g} "
                f"--concurrency {args.concurrency}`, {time.strftime('%Y-%m-%d')})\n\n"
                f"Server flags: `{args.server_args}`; model: {args.model or 'embedded namazu-tiny'}; "
                f"{int(args.hangup * 100)}% of clients hang up after 1-8 chunks (streams) or 0.05-0.5 s "
                f"(non-streamed); outputs 1-{args.max_out} tokens, n 1 or 2.\n\n{text}\n\n"
                f"Healthy after the soak: {alive}; exit code after SIGTERM: {code}.")
        write_section(BEGIN, END, body)
    bad = sum(r[2].lost for r in rows) + sum(r[3] for r in rows)
    bad += sum(t.lost + e5 + leaked + (h.server_errors if h else 0) for h, t, _, e5, leaked, _, _ in hostile_rows)
    return 1 if bad or not alive or code != 0 else 0


def _hostile_table(rows: list) -> str:
    out = ["| phase | normal requests | completed | lost | normal 5xx | p50 s | p99 s | KV blocks leaked | "
           "hostile: slow readers / dribblers (longest held s) / compiles (statuses) / hostile 5xx |",
           "|---|---|---|---|---|---|---|---|---|"]
    for h, t, lat, e5, leaked, _r0, _r1 in rows:
        what = "-" if h is None else (f"{h.slow_readers} / {h.dribblers} ({h.dribbler_max_held_s:.1f}) / "
                                      f"{h.compiles} ({h.compile_statuses}) / {h.server_errors}")
        out.append(f"| {'normal alone' if h is None else 'normal + hostile'} | {t.total} | {t.completed} | "
                   f"{t.lost} | {e5} | {_percentile(lat, 0.5):.3f} | {_percentile(lat, 0.99):.3f} | {leaked} | "
                   f"{what} |")
    if len(rows) == 2 and rows[0][2] and rows[1][2]:
        out.append(f"\np99 with the hostile mix / without: "
                   f"{_percentile(rows[1][2], 0.99) / _percentile(rows[0][2], 0.99):.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
