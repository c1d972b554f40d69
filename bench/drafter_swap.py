"""A live drafter swap under concurrent streams: nothing lost, greedy outputs unchanged, what it costs.

    python bench/drafter_swap.py --requests CAPTURE --to DRAFTER_DIR [--streams 32] [--limit 64]

Serves namazu-tiny with its shipped drafter (`--speculative-disable-batch-size 0`, so that every step drafts
and the swap matters) and `--admin-key`, with the shipped drafter and DRAFTER_DIR under a temporary
`--drafter-root`. Round 1 streams the captured prompts (greedy, their captured lengths) `--streams` at a time
and, once every stream has its first token, POSTs /admin/drafter with DRAFTER_DIR. Round 2 runs the same
requests again on the swapped server, without a swap. Prints: requests completed / failed in each round,
outputs identical across the rounds (greedy: speculation never changes them, whichever drafter), the swap's
HTTP latency, the preemptions it caused, the KV blocks held at the end (must be 0), and acceptance per drafter
from /metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from namazu.assets import resolve_model_path
from namazu.spec.capture import read_records
from namazu.spec.training.traffic import ServerProcess

ADMIN = "bench-admin-key"


async def stream(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event) -> tuple[bool, str]:
    text = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return False, str(chunk["error"])[:200]
                text.append(chunk["choices"][0]["text"])
                first.set()
    except httpx.HTTPError as e:
        return False, f"{type(e).__name__}: {e}"
    return True, "".join(text)


async def round_(url: str, bodies: list[dict], streams: int, swap_to: str | None) -> dict:
    sem = asyncio.Semaphore(streams)
    first = asyncio.Event()
    swap: dict = {}

    async def one(body: dict) -> tuple[bool, str]:
        async with sem:
            return await stream(client, url, body, first)

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(one(b)) for b in bodies]
        if swap_to is not None:
            await first.wait()
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            r = await client.post(url + "/admin/drafter", json={"path": swap_to},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
            swap = {"status": r.status_code, "seconds": time.perf_counter() - t0, "answer": r.json(),
                    "in_flight": sum(not t.done() for t in tasks)}
        results = await asyncio.gather(*tasks)
    return {"results": results, "swap": swap}


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="capture directories or shard files")
    ap.add_argument("--to", required=True, help="the drafter directory to swap to")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--limit", type=int, default=64)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="namazu-swap-"))
    shutil.copytree(Path(resolve_model_path(None)) / "drafter", root / "shipped")
    shutil.copytree(args.to, root / "new")
    bodies = [{"prompt": r.prompt_token_ids, "max_tokens": max(len(o) for o in r.output_token_ids) or 1,
               "temperature": 0, "ignore_eos": True, "stream": True}
              for r in list(read_records(args.requests))[:args.limit]]
    flags = ["--admin-key", ADMIN, "--drafter-root", str(root), "--speculative-model", str(root / "shipped"),
             "--speculative-disable-batch-size", "0", "--speculative-min-confidence", "0.01",
             "--max-num-seqs", str(args.streams), "--max-waiting-seqs", str(2 * args.streams)]
    with ServerProcess(flags, root / "server.log") as server:
        one = asyncio.run(round_(server.url, bodies, args.streams, "new"))
        two = asyncio.run(round_(server.url, bodies, args.streams, None))
        deadline = time.time() + 10
        while metric(server.metrics(), "namazu_kv_cache_usage_ratio") and time.time() < deadline:
            time.sleep(0.2)
        text = server.metrics()
        log = (root / "server.log").read_text()
    ok1, ok2 = (sum(ok for ok, _ in r["results"]) for r in (one, two))
    same = sum(a == b for (oa, a), (ob, b) in zip(one["results"], two["results"]) if oa and ob)
    swap = one["swap"]
    print(f"{len(bodies)} captured prompts, greedy, {args.streams} streams at a time; swap to {args.to}")
    print("| round | completed | failed |\n|---|---:|---:|")
    print(f"| 1 (swap while {swap.get('in_flight')} requests were in flight) | {ok1} | {len(bodies) - ok1} |")
    print(f"| 2 (the swapped server, no swap) | {ok2} | {len(bodies) - ok2} |")
    print(f"outputs identical across the rounds: {same}/{min(ok1, ok2)}")
    print(f"swap: HTTP {swap.get('status')} in {swap.get('seconds', 0):.2f} s, {swap.get('answer')}")
    print(f"preemptions: {metric(text, 'namazu_engine_num_preemptions_total'):.0f}; KV usage at the end: "
          f"{metric(text, 'namazu_kv_cache_usage_ratio'):.3f}")
    for m in re.finditer(r'^namazu_spec_drafter_draft_tokens_total\{.*drafter="([^"]+)".*\} ([0-9.e+]+)$', text, re.M):
        d = m.group(1)
        acc = re.search(rf'^namazu_spec_drafter_acceptance_length_sum\{{.*drafter="{re.escape(d)}".*\}} ([0-9.e+]+)$',
                        text, re.M)
        cnt = re.search(rf'^namazu_spec_drafter_acceptance_length_count\{{.*drafter="{re.escape(d)}".*\}} ([0-9.e+]+)$',
                        text, re.M)
        mean = float(acc.group(1)) / float(cnt.group(1)) if acc and cnt and float(cnt.group(1)) else float("nan")
        print(f"drafter {d}: {float(m.group(2)):.0f} drafts verified, mean acceptance length {mean:.2f}")
    print("swap logged:", "yes" if "drafter swapped" in log else "no")
    failed = len(bodies) - ok1 + len(bodies) - ok2
    if failed:
        print("first failure:", next(t for ok, t in one["results"] + two["results"] if not ok), file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
