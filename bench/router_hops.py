"""Where a request's time goes on each path to one namazu replica: direct, through `python -m server.router`,
and through the Ray Serve application (`--replicas 1:1`).

One replica (1 thread), requests one at a time (no queueing, so only per-hop overhead differs), fresh
prompts (no prefix-cache hits). Non-streamed requests with `max_tokens 1` expose each hop's share through
the `server-timing` headers both fronts send:

- router: `route` (read the body, tokenize, hash, score) and `upstream` (router -> replica -> first bytes);
- Ray: `hash` (ingress: read the body, tokenize, hash), `handle` (ingress -> request router -> engine
  replica actor -> head back), `engine` (inside the replica actor: namazu's app through the ASGI bridge),
  `ingress` (all of the ingress); the client's total minus `ingress` is Ray Serve's HTTP proxy hop.

Streamed requests (`max_tokens 16`) give the end-to-end TTFT and inter-token gap on each path.

    python bench/router_hops.py [--requests 40] [--prompt-tokens 200]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from router import free_port, spawn, stop, wait_healthy  # bench/ is on sys.path as `python bench/X.py`
from serve import PromptMaker, stream_request


def timings(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


async def measure(urls: dict[str, str], pm: PromptMaker, args) -> dict[str, dict[str, float]]:
    """Interleaved: each round sends one request down every path in turn, so a shared machine's load
    drifts over all paths alike."""
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in urls}
    clients = {name: httpx.AsyncClient(base_url=url, timeout=120) for name, url in urls.items()}
    try:
        for i in range(args.warmup + args.requests):
            for name, c in clients.items():
                body = {"prompt": pm.text(args.prompt_tokens), "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                total = 1000 * (time.perf_counter() - t0)
                if r.status_code != 200:
                    raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
                res = await stream_request(c, "/v1/completions", {"prompt": pm.text(args.prompt_tokens),
                                                                  "max_tokens": 16, "temperature": 0})
                if not res.ok:
                    raise SystemExit(f"{name}: stream failed: {res.error}")
                if i < args.warmup:
                    continue
                row = rows[name]
                row.setdefault("client total", []).append(total)
                for k, v in timings(r.headers.get("server-timing", "")).items():
                    row.setdefault(k, []).append(v)
                row.setdefault("stream TTFT", []).append(1000 * res.ttft)
                row.setdefault("stream ITL", []).append(1000 * float(np.median(res.itl)))
    finally:
        for c in clients.values():
            await c.aclose()
    return {name: {k: float(np.median(v)) for k, v in row.items()} for name, row in rows.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--replica-args", default="")
    p.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args(argv)

    from namazu.assets import resolve_model_path

    pm = PromptMaker(resolve_model_path(None), 0)
    load = os.getloadavg()
    log = Path(args.log_dir)
    port, rport, ray_port = free_port(), free_port(), free_port()
    urls = {"direct": f"http://127.0.0.1:{port}", "router": f"http://127.0.0.1:{rport}",
            "ray": f"http://127.0.0.1:{ray_port}"}
    procs = [spawn(["-m", "namazu.server", "--port", str(port), "--log-level", "warning",
                    *shlex.split(args.replica_args)], log / "hops-replica.log", 1)]
    ray = spawn(["-m", "namazu.server", "--port", str(ray_port), "--replicas", "1:1", "--ray-num-cpus", "2",
                 "--replica-threads", "1", "--log-level", "warning", *shlex.split(args.replica_args)],
                log / "hops-ray.log", 1)
    try:
        wait_healthy(procs[0], urls["direct"], 300, "the replica")
        procs.append(spawn(["-m", "server.router", "--port", str(rport), "--log-level", "warning",
                            "--replica", urls["direct"]], log / "hops-router.log", 1))
        wait_healthy(procs[1], urls["router"], 60, "the router")
        wait_healthy(ray, urls["ray"], 300, "the Ray Serve application")
        time.sleep(3)
        results = asyncio.run(measure(urls, pm, args))
    finally:
        stop(procs)
        stop([ray], sig_int=True)
    keys = ["client total", "route", "upstream", "hash", "handle", "engine", "ingress", "stream TTFT", "stream ITL"]
    print(f"median ms over {args.requests} requests, prompt {args.prompt_tokens} tokens; load average "
          f"{'/'.join(f'{x:.1f}' for x in load)} -> {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| path | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" if k in r else "" for k in keys) + " |")
    d, rt, ry = results["direct"], results["router"], results["ray"]
    print(f"\nrouter overhead: {rt['client total'] - d['client total']:.1f} ms per request "
          f"(route {rt.get('route', 0):.1f}); stream TTFT +{rt['stream TTFT'] - d['stream TTFT']:.1f} ms")
    if "ingress" in ry:
        print(f"ray overhead: {ry['client total'] - d['client total']:.1f} ms per request = proxy hop "
              f"{ry['client total'] - ry['ingress']:.1f} + ingress hash {ry.get('hash', 0):.1f} + handle/actor "
              f"round trip {ry['handle'] - ry.get('engine', 0):.1f} + engine in the actor minus direct "
              f"{ry.get('engine', 0) - d['client total']:.1f}; stream TTFT +{ry['stream TTFT'] - d['stream TTFT']:.1f} "
              f"ms, ITL +{ry['stream ITL'] - d['stream ITL']:.1f} ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
