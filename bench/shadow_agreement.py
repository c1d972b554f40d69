"""Live shadow against offline replay: does a shadow drafter's acceptance on live traffic agree with the offline
replay of the same drafter on the same requests (issue 32's acceptance)?

    python -m bench.shadow_agreement --requests build/capture-oldmix --shadow DIR [--drafter DIR] \
        [--limit 60] [--concurrency 8] [--out build/shadow-agreement]

Two passes, each an offline replay and a live run of the same requests:
- "seeded": every request with its captured seed, so every verify step (and every shadow block) is decided by
  the exact rule, the draft against the target's own seeded sample; offline this is the refresh gate's
  measurement (`namazu.spec.training.replay`: each request alone, k and --min-confidence as the refresh
  replays them);
- "unseeded": the T>0 requests' seeds dropped, as a client that sends none: verified by the lossless ratio rule
  (higher acceptance than the seeded exact match at T>0), the shadow's blocks of those requests scored by the
  expected acceptance, a lower bound where the shadow's draft leaves the serving drafter's verified path;
  offline one draw per request.
Offline: acceptance length (tokens over verify steps) with a 95% bootstrap interval over requests, overall and
for T=0 / T>0. Live: a server serving `--drafter` with `--shadow-drafter SHADOW --shadow-fraction 1`, the requests
posted concurrently (/v1/completions, their prompt ids and sampling settings), its /metrics saved; the shadow's
live mean (exact; expected), the serving drafter's on the same requests, and whether each lies inside the
offline interval of its pass. The server's --seed (`--server-seed`, default 1) differs from the offline engine's
0, so the unseeded requests' draws differ between the two (with equal seeds they would draw the same in
arrival order).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from namazu.spec.capture import read_records
from namazu.spec.shadow_report import from_prometheus
from namazu.spec.training.replay import completion_body, replay_acceptance
from namazu.spec.training.traffic import ServerProcess, _post_stream

SHIPPED = "namazu/assets/namazu-tiny/drafter"


def bootstrap(tokens: np.ndarray, steps: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple:
    """Acceptance length (a ratio of sums over requests) and its 95% percentile interval, requests resampled."""
    if not len(tokens):
        return 0.0, 0.0, 0.0
    idx = np.random.default_rng(seed).integers(0, len(tokens), (resamples, len(tokens)))
    boot = tokens[idx].sum(-1) / np.maximum(steps[idx].sum(-1), 1)
    low, high = np.quantile(boot, [0.025, 0.975])
    return float(tokens.sum() / max(steps.sum(), 1)), float(low), float(high)


def replay_unseeded(records: list, engine_kwargs: dict) -> dict:
    """`replay_acceptance` with the T>0 requests' seeds dropped: each request alone, its verify steps by the
    lossless ratio rule (an engine-drawn seed), as unseeded live traffic is verified. One draw per request."""
    import dataclasses

    from namazu import LLM
    from namazu.spec.training.replay import RequestAcceptance, replay_params

    out = {}
    with LLM(**{"executor": "inline", **engine_kwargs}) as llm:
        engine = llm.engine
        for rec in records:
            params = replay_params(rec)
            if params.temperature > 0:
                params = dataclasses.replace(params, seed=None)
            before = engine.get_stats()
            engine.add_request(f"replay-{rec.request_id}", None, params, prompt_token_ids=rec.prompt_token_ids,
                               stream=False)
            while engine.has_unfinished_requests():
                engine.step()
            after = engine.get_stats()
            hist = [a - b for a, b in zip(after.acceptance_length_histogram, before.acceptance_length_histogram)]
            out[rec.request_id] = RequestAcceptance(rec.request_id, hist,
                                                    after.num_generated_tokens - before.num_generated_tokens,
                                                    after.num_steps - before.num_steps)
    return out


def offline(records: list, drafter: str, k: int, min_confidence: float, out: Path, seeded: bool) -> dict:
    kw = {"speculative_model": drafter, "num_speculative_tokens": k, "speculative_min_confidence": min_confidence,
          "dtype": "float32"}
    if seeded:
        res = replay_acceptance(records, kw, out / "offline.ndjson", desc="offline")
    else:
        res = replay_unseeded(records, kw)
    rows = {}
    for name, keep in (("all", lambda t: True), ("T=0", lambda t: t == 0), ("T>0", lambda t: t > 0)):
        sel = [res[r.request_id] for r in records if keep(float(r.sampling.get("temperature") or 0.0))]
        tok = np.array([r.verify_tokens for r in sel], dtype=float)
        ver = np.array([r.verify_steps for r in sel], dtype=float)
        mean, low, high = bootstrap(tok, ver)
        rows[name] = {"requests": len(sel), "verify_steps": int(ver.sum()), "verify_tokens": int(tok.sum()),
                      "mean": mean, "low": low, "high": high}
    return rows


def live(records: list, flags: list[str], seeded: bool, concurrency: int, out: Path, name: str) -> dict:
    bodies, left = [], Counter()
    for rec in records:
        body, missing = completion_body(rec)
        left.update(missing)
        body.update(stream=True, stream_options={"include_usage": True})
        if not seeded and float(body.get("temperature") or 0.0) > 0:
            body.pop("seed", None)
        bodies.append(body)
    for what, n in left.items():     # offline they have them: those requests differ between the two
        print(f"{name}: {n} of {len(bodies)} requests posted without their {what} "
              "(/v1/completions has no field for it)", file=sys.stderr)
    t0 = time.perf_counter()
    with ServerProcess(flags, out / f"server-{name}.log") as server:
        url = server.url + "/v1/completions"
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda b: _post_stream(url, b, 600), bodies))
        metrics = server.metrics()
    (out / f"metrics-{name}.txt").write_text(metrics)
    shadows = from_prometheus(metrics)
    failed = [r for r in results if not r.ok]
    return {"wall_s": time.perf_counter() - t0, "failed": len(failed),
            "first_error": failed[0].error if failed else "", "shadow": shadows}


def table(offs: dict, runs: dict) -> str:
    def iv(row: dict) -> str:
        return f"{row['mean']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"

    def inside(x: float, row: dict) -> str:
        return "yes" if row["low"] <= x <= row["high"] else "**no**"

    lines = ["| offline replay (each request alone) | all | T=0 | T>0 |", "|---|---:|---:|---:|"]
    for name, off in offs.items():
        lines.append(f"| {name} ({off['all']['requests']} requests: {off['T=0']['requests']} T=0, "
                     f"{off['T>0']['requests']} T>0; {off['all']['verify_steps']} verify steps) | {iv(off['all'])} | "
                     f"{iv(off['T=0'])} | {iv(off['T>0'])} |")
    lines += ["", "| live pass | shadow blocks exact / expected (truncated, dropped) | shadow mean (exact; expected) "
                  "| serving mean, same requests | shadow / serving | shadow in the offline interval (all) | "
                  "serving in it |", "|---|---:|---:|---:|---:|---|---|"]
    for name, run in runs.items():
        a = offs[name]["all"]
        for sid, n in run["shadow"].items():
            lines.append(
                f"| {name} (`{sid}`) | {n['exact_blocks']:.0f} / {n['expected_blocks']:.0f} "
                f"({n['truncated_blocks']:.0f}, {n['dropped_blocks']:.0f}) | {n['mean']:.3f} "
                f"({n['mean_exact']:.3f}; {n['mean_expected']:.3f}) | "
                f"{n['serving_mean']:.3f} | {n['ratio']:.3f}x | {inside(n['mean'], a)} | "
                f"{inside(n['serving_mean'], a)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="capture directories or shard files")
    ap.add_argument("--shadow", required=True, help="the shadow drafter's directory")
    ap.add_argument("--drafter", default=SHIPPED, help="the serving drafter (and the one replayed offline)")
    ap.add_argument("--k", type=int, default=6, help="draft tokens per verify step (the shipped drafter's 6)")
    ap.add_argument("--min-confidence", type=float, default=0.01)
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--passes", nargs="+", default=["seeded", "unseeded"], choices=("seeded", "unseeded"))
    ap.add_argument("--server-seed", type=int, default=1,
                    help="the live server's --seed: the unseeded requests' draws (offline: the engine's default 0, "
                         "so the two passes draw independently)")
    ap.add_argument("--out", default="build/shadow-agreement")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = list(read_records(args.requests))[:args.limit]
    if not records:
        raise SystemExit(f"no captured requests in {' '.join(args.requests)}")
    flags = ["--speculative-model", args.drafter, "--num-speculative-tokens", str(args.k),
             "--speculative-min-confidence", str(args.min_confidence), "--dtype", "float32",
             "--shadow-drafter", args.shadow, "--shadow-fraction", "1",
             "--seed", str(args.server_seed)]
    t0 = time.perf_counter()
    offs, runs = {}, {}
    for name in args.passes:
        offs[name] = offline(records, args.drafter, args.k, args.min_confidence, out, name == "seeded")
        print(f"offline replay, {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        runs[name] = live(records, flags, name == "seeded", args.concurrency, out, name)
        print(f"live {name}: {runs[name]['wall_s']:.0f} s, {runs[name]['failed']} failed", flush=True)
    (out / "result.json").write_text(json.dumps({"offline": offs, "live": runs, "flags": flags}, indent=1) + "\n")
    print(table(offs, runs))
    return 1 if any(r["failed"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
