"""KV-aware routing benchmark: 3 namazu replicas behind `python -m server.router`, four policies.

Workload (replayed, Poisson arrivals): many users share a few long system prompts and hold multi-turn
conversations; turn k of a user carries the system prompt, the user's earlier turns and the model's
earlier answers, plus a new question, and is sent only after turn k-1's answer arrived. Every run uses
fresh text (its own seed) so no run finds another run's prefixes in a cache; each point first sends one
request per system prompt through the policy under test (not counted: a running service has its system
prompts computed; --cold skips it). Per policy and rate: TTFT
p50/p99, prompt tokens computed (prompt - cached, from the usage chunks), prefix-cache hit rate, the
share of requests each replica got, and each replica's queue depth over time (GET /load, 4 Hz). Then a
burst of unrelated chat requests (all at once) checks that every replica still gets work.

    python bench/router.py                                  # 3 namazu-tiny replicas, 1 thread each
    python bench/router.py --rates 1,2 --policies round_robin,kv --users 12
    python bench/router.py --rates 3:9:2 --policies round_robin,kv     # each policy's highest sustained rate
    python bench/router.py --system-len 384 --users 80 --rates 12:17:1  # short system prompts
    python bench/router.py --ray                            # also through `--replicas 3:3` (Ray Serve)

Writes a table to stdout, a section of bench/RESULTS.md (--write) and bench/router.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`
from serve import PromptMaker, Result, arrivals, stream_request

from server.health_wait import wait_healthy as health_wait

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
START, END = "<!-- bench-router:start -->", "<!-- bench-router:end -->"
POLICIES = ("round_robin", "p2c", "affinity", "kv")
SUSTAINED = 0.95      # a rate is sustained when requests finish at >= 95% of the rate they arrived at


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str) -> None:
    try:
        health_wait(url, timeout, what, proc, interval=0.3)
    except (RuntimeError, TimeoutError) as err:
        proc.terminate()
        raise SystemExit(str(err).strip()) from None


def spawn(args: list[str], log: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen], sig_int: bool = False) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(2) if sig_int else p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class Run:
    front: str                     # "router" or "ray"
    policy: str
    rate: float
    results: list[Result]
    wall: float
    shares: dict[str, int]         # requests per replica during the run
    queue: list[tuple[float, int, int, int]] = field(default_factory=list)   # (t, replica, waiting, running)
    offered: float = float("nan")  # the realized arrival rate: requests / last scheduled arrival (s)
    rates: str = ""                # the router's measured ms per prefill block / per decode step, per replica
    meta: list[dict] = field(default_factory=list)   # per conversation turn: user, turn, system prompt, send time


async def sample_queues(urls: list[str], out: list, stop_event: asyncio.Event, t0: float) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop_event.is_set():
            for i, u in enumerate(urls):
                try:
                    load = (await client.get(u + "/load")).json()
                    out.append((time.perf_counter() - t0, i, load["num_waiting"], load["num_running"]))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            try:
                await asyncio.wait_for(stop_event.wait(), 0.25)
            except asyncio.TimeoutError:
                pass


async def conversations(client: httpx.AsyncClient, pm: PromptMaker, rate: float, args, seed: int
                        ) -> tuple[list[Result], float, list[dict]]:
    """The conversation turns at `rate`; returns their results, the realized offered rate and each turn's
    place in the workload (user, turn, system prompt, scheduled send time)."""
    rng = np.random.default_rng(seed)
    n = args.users * args.turns
    times = arrivals(rate, n, rng)
    systems = [pm.text(args.system_len) for _ in range(args.systems)]
    histories = [[{"role": "system", "content": systems[u % args.systems]}] for u in range(args.users)]
    questions = [pm.text(args.turn_input_len) for _ in range(n)]
    previous: list[asyncio.Future | None] = [None] * args.users
    if not args.cold:
        # A service's system prompts live for hours: the point starts with each one computed once, by one
        # request through the policy under test (not counted), so that its tail is the steady state and not
        # the few first turns that arrive while every system prompt is still being computed (both policies
        # pay that; it was most of the KV-aware router's tail: bench/RESULTS.md).
        await asyncio.gather(*(stream_request(client, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": pm.text(8)}],
            "max_tokens": 1}) for text in systems))
    t0 = time.perf_counter()

    async def one(i: int, user: int, prev: asyncio.Future | None, done: asyncio.Future) -> Result:
        await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
        if prev is not None:
            await prev
        try:
            msgs = histories[user] + [{"role": "user", "content": questions[i]}]
            res = await stream_request(client, "/v1/chat/completions", {
                "messages": msgs, "max_tokens": args.turn_output_len, "temperature": 0.8, "seed": i})
            histories[user] = msgs + [{"role": "assistant", "content": res.text}]
            return res
        finally:
            done.set_result(None)

    # Users take turns in a random order (each exactly `turns` times), so no policy gets stickiness for
    # free from a user count that happens to divide the replica count.
    order = rng.permutation(np.repeat(np.arange(args.users), args.turns))
    tasks, meta, turns = [], [], [0] * args.users
    for i in range(n):
        user = int(order[i])
        meta.append({"user": user, "turn": turns[user], "system": user % args.systems, "at": float(times[i])})
        turns[user] += 1
        done = asyncio.get_running_loop().create_future()
        tasks.append(one(i, user, previous[user], done))
        previous[user] = done
    return list(await asyncio.gather(*tasks)), n / float(times[-1]), meta


async def burst(client: httpx.AsyncClient, pm: PromptMaker, args) -> list[Result]:
    system = pm.text(16)
    bodies = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": pm.text(96)}],
               "max_tokens": 8} for _ in range(args.burst)]
    return list(await asyncio.gather(*(stream_request(client, "/v1/chat/completions", b) for b in bodies)))


def router_rates(url: str) -> str:
    """Each replica's rates, 'ms per block/ms per step': as the router learned them from its requests (its
    wait estimate's), then in parentheses as the replica measured them of its own steps (its last /load)."""
    reps = httpx.get(url + "/router/state", timeout=10).json()["replicas"]

    def own(load: dict) -> str:
        return f"{load.get('ms_per_prefill_block', 0.0):.1f}/{load.get('ms_per_decode_step', 0.0):.1f}"

    return " ".join(f"{r['rates']['ms_per_block']:.1f}/{r['rates']['ms_per_step']:.1f} ({own(r['load'] or {})})"
                    for r in reps)


def router_shares(url: str) -> dict[str, int]:
    return {r["url"]: r["routed"] for r in httpx.get(url + "/router/state", timeout=10).json()["replicas"]}


def ray_shares(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("namazu_router_decisions_total{"):
            out[line.split('"')[1]] = int(float(line.rpartition(" ")[2]))
    return out


def diff(after: dict[str, int], before: dict[str, int], replicas: int) -> dict[str, int]:
    d = {k: v - before.get(k, 0) for k, v in after.items()}
    while len(d) < replicas:              # a replica that never got a request has no counter yet
        d[f"unseen-{len(d)}"] = 0
    return d


async def measure(front: str, url: str, policy: str, rate: float, pm: PromptMaker, args, seed: int,
                  replica_urls: list[str], shares) -> Run:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256)) as c:
        before = shares(url)
        queue: list = []
        stop_event = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_queues(replica_urls, queue, stop_event, t0))
        offered, meta = float("nan"), []
        if np.isnan(rate):
            results = await burst(c, pm, args)
        else:
            results, offered, meta = await conversations(c, pm, rate, args, seed)
        wall = time.perf_counter() - t0
        stop_event.set()
        await sampler
        return Run(front, policy, rate, results, wall, diff(shares(url), before, 3), queue, offered, meta=meta)


def summarize(run: Run) -> dict:
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    total = sum(run.shares.values()) or 1
    waits = [w for _, _, w, _ in run.queue]
    done = len(ok) / run.wall
    return {"front": run.front, "policy": run.policy, "rate": "burst" if np.isnan(run.rate) else f"{run.rate:g}",
            "requests": len(run.results), "failed": len(run.results) - len(ok),
            "ttft_p50": 1000 * float(np.percentile(ttft, 50)) if ttft else float("nan"),
            "ttft_p99": 1000 * float(np.percentile(ttft, 99)) if ttft else float("nan"),
            "computed": prompt - cached, "prompt": prompt, "hit": cached / prompt if prompt else 0.0,
            "min_share": min(run.shares.values()) / total, "shares": "/".join(str(v) for v in run.shares.values()),
            # no samples through Ray Serve (its replicas have no HTTP port): blank, not zero
            "max_queue": max(waits) if waits else None, "mean_queue": float(np.mean(waits)) if waits else None,
            "offered": run.offered, "req_s": done,
            # kept up: finished as fast as requests arrived (a run that falls behind ends late)
            "kept_up": bool(done >= SUSTAINED * run.offered) if not np.isnan(run.offered) else None,
            "rates": run.rates}


COLUMNS = [("front", "front", "{}"), ("policy", "policy", "{}"), ("rate", "rate req/s", "{}"),
           ("requests", "requests", "{}"), ("failed", "failed", "{}"), ("ttft_p50", "TTFT p50 ms", "{:.0f}"),
           ("ttft_p99", "TTFT p99 ms", "{:.0f}"), ("computed", "prompt tokens computed", "{}"),
           ("hit", "prefix hit", "{:.1%}"), ("shares", "requests per replica", "{}"),
           ("min_share", "min share", "{:.0%}"), ("max_queue", "max queue", "{}"),
           ("mean_queue", "mean queue", "{:.2f}"),
           ("offered", "req/s offered", "{:.2f}"), ("req_s", "req/s done", "{:.2f}"), ("kept_up", "kept up", "{}"),
           ("rates", "ms/block / ms/step per replica: router's (replica's own)", "{}")]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    def cell(r: dict, k: str, f: str) -> str:
        return "" if r[k] is None or (isinstance(r[k], float) and np.isnan(r[k])) else f.format(r[k])
    return "\n".join([head, sep] + ["| " + " | ".join(cell(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows])


def plot(runs: list[Run], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conv = [r for r in rows if r["front"] == "router" and r["rate"] != "burst"]
    policies = [p for p in POLICIES if any(r["policy"] == p for r in conv)]
    # Queues over time at the highest rate the KV-aware router kept up with (where the policies differ most
    # in queueing); the top rate when it kept up with none.
    kept = [float(r["rate"]) for r in conv if r["policy"] == "kv" and r["kept_up"]]
    top = max(kept or [float(r["rate"]) for r in conv] or [0.0])
    fig, axes = plt.subplots(1, 3 + len(policies), figsize=(5 * (3 + len(policies)), 4))
    for i, p in enumerate(policies):
        rs = sorted((r for r in conv if r["policy"] == p), key=lambda r: float(r["rate"]))
        x = [float(r["rate"]) for r in rs]
        c = f"C{i}"
        axes[0].plot(x, [r["ttft_p99"] for r in rs], "o-", color=c, label=f"{p} p99")
        axes[0].plot(x, [r["ttft_p50"] for r in rs], "s:", color=c, label=f"{p} p50")
        axes[1].plot(x, [r["computed"] for r in rs], "o-", color=c, label=p)
        axes[2].plot([r["offered"] for r in rs], [r["req_s"] for r in rs], "o-", color=c, label=p)
    axes[0].set(title="TTFT vs request rate", xlabel="req/s", ylabel="ms", yscale="log")
    axes[1].set(title="prompt tokens computed", xlabel="req/s")
    hi = max((r["offered"] for r in conv), default=1.0)
    axes[2].plot([0, hi], [0, hi], "k:", lw=0.8, label="offered")
    axes[2].set(title="throughput: requests done vs offered", xlabel="req/s offered", ylabel="req/s done")
    for ax in axes[:3]:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax, p in zip(axes[3:], policies):
        run = next((r for r in runs if r.front == "router" and r.policy == p and r.rate == top), None)
        if run is None:
            continue
        for i in range(3):
            pts = [(t, w) for t, k, w, _ in run.queue if k == i]
            if pts:
                ax.plot(*zip(*pts), label=f"replica {i}")
        ax.set(title=f"queue depth, {p} @ {top:g} req/s", xlabel="s", ylabel="waiting sequences")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def one_point(args, pm: PromptMaker, replicas: list[str], policy: str, rate: float, seed: int) -> Run:
    """One router process with `policy` over the replicas, one measured point, the router stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["-m", "server.router", "--port", str(port), "--policy", policy, "--log-level", "warning",
           "--seed", "0", *shlex.split(args.router_args)] + [x for r in replicas for x in ("--replica", r)]
    if args.model:
        cmd += ["--tokenizer", args.model]
    proc = spawn(cmd, Path(args.log_dir) / f"router-{policy}.log", 1)
    try:
        wait_healthy(proc, url, 60, "the router")
        await asyncio.sleep(1.0)             # the first event/load polls landed
        run = await measure("router", url, policy, rate, pm, args, seed, replicas, router_shares)
        run.rates = router_rates(url)
    finally:
        stop([proc])
    print(table([summarize(run)]).splitlines()[-1], flush=True)
    return run


async def bench_router(args, pm: PromptMaker, replicas: list[str], runs: list[Run]) -> None:
    # Rate by rate, every policy in turn (the order rotated from one rate to the next), so that a shared
    # machine's load drifting over the run weighs on all policies alike at each rate; each point gets a
    # fresh router (its index and estimates start from the replicas' reports) and fresh text.
    policies = args.policies.split(",")
    for ri, rate in enumerate(args.rate_list):
        for k in range(len(policies)):
            policy = policies[(ri + k) % len(policies)]
            runs.append(await one_point(args, pm, replicas, policy, rate, 1000 * ri + 7))
    for policy in policies:
        runs.append(await one_point(args, pm, replicas, policy, float("nan"), 0))


async def bench_ray(args, pm: PromptMaker, runs: list[Run]) -> None:
    for policy in ("round_robin", "kv"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = ["-m", "namazu.server", "--port", str(port), "--replicas", "3:3", "--router-policy", policy,
               "--ray-num-cpus", "2", "--replica-threads", "1", "--log-level", "warning",
               *shlex.split(args.replica_args)]
        if args.model:
            cmd += ["--model", args.model]
        proc = spawn(cmd, Path(args.log_dir) / f"ray-{policy}.log", 1)
        try:
            wait_healthy(proc, url, 300, "the Ray Serve application")
            await asyncio.sleep(5.0)             # all three replicas up and their routing stats in
            for ri, rate in enumerate(args.ray_rate_list):
                run = await measure("ray", url, policy, rate, pm, args, 1000 * ri + 7, [], ray_shares)
                runs.append(run)
                print(table([summarize(run)]).splitlines()[-1], flush=True)
            run = await measure("ray", url, policy, float("nan"), pm, args, 0, [], ray_shares)
            runs.append(run)
            print(table([summarize(run)]).splitlines()[-1], flush=True)
        finally:
            stop([proc], sig_int=True)


def highest_sustained(points: list[dict]) -> dict | None:
    """The point at the highest rate below which every rate run was sustained (one policy, sorted by
    rate): a rate kept up above one that was not is noise, not capacity."""
    best = None
    for r in points:
        if not r["kept_up"]:
            break
        best = r
    return best


def parse_rates(text: str) -> list[float]:
    """'10,11,12' or 'start:stop:step' (stop included), e.g. '10:14:0.5' for a fine grid near saturation."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0 or stop < start:
                raise ValueError
            rates = [round(start + i * step, 6) for i in range(int(round((stop - start) / step)) + 1)]
        else:
            rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--rates {text!r}: want a list (10,11,12) or start:stop:step with step > 0") from None
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"--rates {text!r}: every rate must be > 0 req/s")
    return rates


def verdict(rows: list[dict]) -> list[str]:
    out = []
    for front in ("router", "ray"):
        conv = [r for r in rows if r["front"] == front and r["rate"] != "burst"]
        for rate in sorted({r["rate"] for r in conv}, key=float):
            rr = next((r for r in conv if r["rate"] == rate and r["policy"] == "round_robin"), None)
            kv = next((r for r in conv if r["rate"] == rate and r["policy"] == "kv"), None)
            if rr and kv and rr["computed"]:
                out.append(f"- {front}, {rate} req/s: kv computes {kv['computed'] / rr['computed']:.2f}x the prompt "
                           f"tokens of round-robin; TTFT round-robin / kv: p50 {rr['ttft_p50'] / kv['ttft_p50']:.1f}x, "
                           f"p99 {rr['ttft_p99'] / kv['ttft_p99']:.1f}x (kept up: round-robin {rr['kept_up']}, "
                           f"kv {kv['kept_up']})")
        caps = {}
        for policy in POLICIES:
            mine = sorted((r for r in conv if r["policy"] == policy), key=lambda r: float(r["rate"]))
            if mine:
                best = caps[policy] = highest_sustained(mine)
                out.append(f"- {front}, {policy}: highest rate sustained "
                           + (f"{best['rate']} req/s ({best['req_s']:.2f} done/s)" if best else "none of those run")
                           + f"; most done/s at any rate {max(r['req_s'] for r in mine):.2f}")
        for owner in ("round_robin", "kv"):
            cap = caps.get(owner)
            rr = cap and next((r for r in conv if r["rate"] == cap["rate"] and r["policy"] == "round_robin"), None)
            kv = cap and next((r for r in conv if r["rate"] == cap["rate"] and r["policy"] == "kv"), None)
            if rr and kv:
                p99_rr, p99_kv = rr["ttft_p99"], kv["ttft_p99"]
                out.append(f"- {front}, at the highest rate {owner} sustains ({cap['rate']} req/s): TTFT p99 "
                           f"round-robin {p99_rr:.0f} ms, kv {p99_kv:.0f} ms ({p99_rr / p99_kv:.1f}x lower with kv); "
                           f"prompt tokens kv/round-robin {kv['computed'] / max(1, rr['computed']):.2f}x "
                           f"(kept up: round-robin {rr['kept_up']}, kv {kv['kept_up']})")
        b = next((r for r in rows if r["front"] == front and r["rate"] == "burst" and r["policy"] == "kv"), None)
        if b:
            out.append(f"- {front}, burst of {b['requests']} unrelated requests: least-loaded replica got "
                       f"{b['min_share']:.0%} ({b['shares']})")
    return out


def write_dump(runs: list[Run], path: Path) -> None:
    """One JSON line per request, to see which requests make a tail (a turn's place in its conversation,
    its system prompt, what was cached)."""
    with path.open("w") as f:
        for run in runs:
            for i, r in enumerate(run.results):
                rec = {"front": run.front, "policy": run.policy, "rate": None if np.isnan(run.rate) else run.rate,
                       "ok": r.ok, "ttft_ms": 1e3 * r.ttft, "e2e_ms": 1e3 * r.e2e, "prompt_tokens": r.prompt_tokens,
                       "cached_tokens": r.cached_tokens, **(run.meta[i] if i < len(run.meta) else {})}
                f.write(json.dumps(rec) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint of the replicas (default: embedded namazu-tiny)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rates", default="1,2,3", help="conversation request rates (req/s, Poisson): a list, or "
                   "start:stop:step for a fine grid near saturation")
    p.add_argument("--users", type=int, default=60, help="conversations per point (x --turns requests: p99 over "
                   "240 requests by default, not set by the slowest one or two)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts shared by the users")
    # Long enough that prefill, which the router saves, is a real part of a turn's cost (at 384 tokens a
    # turn's time is mostly decode and slot waits, which no routing saves: bench/RESULTS.md).
    p.add_argument("--system-len", type=int, default=1536)
    p.add_argument("--turn-input-len", type=int, default=32)
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--cold", action="store_true",
                   help="start each point with its system prompts cached nowhere (default: one request per system "
                        "prompt, not counted, computes each once first, as in a service that has been running)")
    p.add_argument("--burst", type=int, default=30, help="unrelated requests sent at once after each sweep")
    p.add_argument("--replica-args", default="", help="extra flags for each replica")
    p.add_argument("--router-args", default="", help="extra flags for the router, e.g. '--prefix-weight 2'")
    p.add_argument("--ray", action="store_true", help="also run round_robin and kv through --replicas 3:3")
    p.add_argument("--ray-rates", default=None, help="conversation rates through Ray Serve (default: --rates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", default=None, metavar="FILE",
                   help="write every request as a JSON line (front, policy, rate, TTFT, tokens, its turn) to FILE")
    p.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    p.add_argument("--plot", default=str(HERE / "router.png"))
    p.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args(argv)
    args.rate_list = parse_rates(args.rates)
    args.ray_rate_list = parse_rates(args.ray_rates or args.rates)

    from namazu.assets import resolve_model_path

    tok_dir = resolve_model_path(args.model)
    pm = PromptMaker(tok_dir, args.seed)
    load_before = os.getloadavg()
    t_start = time.time()
    runs: list[Run] = []
    ports = [free_port() for _ in range(3)]
    replicas = [f"http://127.0.0.1:{port}" for port in ports]
    procs = []
    try:
        for i, port in enumerate(ports):
            cmd = ["-m", "namazu.server", "--port", str(port), "--log-level", "warning",
                   *shlex.split(args.replica_args)]
            if args.model:
                cmd += ["--model", args.model]
            procs.append(spawn(cmd, Path(args.log_dir) / f"replica-{i}.log", 1))
        for proc, url in zip(procs, replicas):
            wait_healthy(proc, url, 300, "a replica")
        print(table([]), flush=True)
        asyncio.run(bench_router(args, pm, replicas, runs))
    finally:
        stop(procs)
    if args.ray:
        asyncio.run(bench_ray(args, pm, runs))
    load_after = os.getloadavg()
    order = {p: i for i, p in enumerate(POLICIES)}
    runs.sort(key=lambda r: (r.front != "router", order.get(r.policy, 9), np.isnan(r.rate),
                             0 if np.isnan(r.rate) else r.rate))
    rows = [summarize(r) for r in runs]
    print()
    print(table(rows))
    lines = verdict(rows)
    print("\n".join(lines))
    if args.dump:
        write_dump(runs, Path(args.dump))
    plot(runs, rows, Path(args.plot))
    if args.write:
        shown, skip = [], False     # --log-dir and --dump name paths of this machine: not part of the record
        for a in (argv if argv is not None else sys.argv[1:]):
            if skip or a.startswith(("--log-dir=", "--dump=")):
                skip = False
                continue
            skip = a in ("--log-dir", "--dump")
            if not skip:
                shown.append(a)
        command = "python bench/router.py " + shlex.join(shown)
        extra = f" `{args.replica_args}`" if args.replica_args else ""
        start = ("system prompts cached nowhere at its start" if args.cold
                 else "after one uncounted request per system prompt")
        setup = (f"Model `{tok_dir.name}`, 3 replicas{extra}, each `OMP_NUM_THREADS=1`; "
                 f"{os.cpu_count()} CPU cores ({platform.machine()}) shared with the router, the client and other "
                 f"jobs. Conversations: {args.users} users over {args.systems} system prompts of {args.system_len} "
                 f"tokens, {args.turns} turns of {args.turn_input_len} in / {args.turn_output_len} out tokens "
                 f"({args.users * args.turns} requests per point, {start}); "
                 f"burst: {args.burst} unrelated chat requests at "
                 f"once. Wall time {time.time() - t_start:.0f} s. 1/5/15-minute load average "
                 f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start, "
                 f"{'/'.join(f'{x:.1f}' for x in load_after)} at the end.")
        section = "\n".join([
            "## KV-aware router (`python bench/router.py`)", "", f"Command: `{command.strip()}`", "", setup, "",
            table(rows), "", *lines, "", f"![router]({Path(args.plot).name})", "",
            "prompt tokens computed: prompt tokens minus cached prompt tokens, summed over the usage chunks; "
            "prefix hit: cached / prompt tokens; min share: the least-used replica's share of the requests; "
            "max queue: most sequences waiting on one replica (GET /load, 4 Hz). Each point uses fresh text, so "
            "no point finds another's prefixes cached. The machine is shared: points are noisy when the load "
            "average is above the core count."])
        write_section(START, END, section)
        print(f"\nwrote {HERE / 'RESULTS.md'} and {args.plot}")


if __name__ == "__main__":
    main()
