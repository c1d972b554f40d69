"""Replay A/B: captured requests through two server setups, side by side.

    python -m bench.replay --a "--num-speculative-tokens 0" \
        --b "--speculative-model DIR --num-speculative-tokens 4" \
        --requests build/drafter/capture-heldout [--limit 200] [--concurrency 1] [--temperature 0] \
        [--plot bench/replay.png] [--write NAME]

Each setup is a string of server flags (empty: the defaults, which speculate with a model's shipped
drafter). Every captured request is replayed with its own prompt token ids, sampling settings
(`--temperature` overrides the temperature of all) and output constraint (a tool-call constraint or bad-word
token ids, which /v1/completions cannot carry, are left off and counted), through /v1/completions, streamed;
per setup: mean acceptance length and its histogram (from the server's /metrics), draft acceptance rate,
drafter time per step, output tokens/s over the replay's wall time, TTFT and end-to-end p50/p99. `--write
NAME` adds the table to bench/RESULTS.md under that name.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from namazu.spec.capture import read_records
from namazu.spec.training.replay import completion_body, replay_settings
from namazu.spec.training.traffic import ReplayResult, ServerProcess, _post_stream


def captured_requests(sources: list[str], limit: int, temperature: float | None) -> tuple[list, list[dict]]:
    """The first `limit` records and their /v1/completions bodies."""
    recs, out, left = [], [], Counter()
    for rec in read_records(sources):
        body, missing = completion_body(rec, temperature)
        left.update(missing)
        recs.append(rec)
        out.append(body)
        if len(out) == limit:
            break
    for name, n in left.items():
        print(f"{n} of {len(out)} requests replayed without their {name} (/v1/completions has no field for it)",
              file=sys.stderr)
    return recs, out


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def acceptance_histogram(metrics: str) -> list[int]:
    """Verify steps per acceptance length 1, 2, ... from the cumulative Prometheus buckets."""
    cum = [(float(le), float(v)) for le, v in
           re.findall(r'^namazu_spec_acceptance_length_bucket\{le="([0-9.]+)"\} ([0-9.eE+]+)$', metrics, re.M)]
    cum.sort()
    counts, prev = [], 0.0
    for _, v in cum:
        counts.append(int(v - prev))
        prev = v
    return counts


def run_setup(name: str, flags: str, requests: list[dict], concurrency: int, log_dir: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    with ServerProcess(flags.split(), log_dir / f"server-{name}.log") as server:
        url = server.url + "/v1/completions"

        def one(body: dict) -> ReplayResult:
            return _post_stream(url, {**body, "stream": True, "stream_options": {"include_usage": True}}, 600)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, requests))
        wall = time.perf_counter() - t0
        metrics = server.metrics()
    ok = [r for r in results if r.ok]
    hist = acceptance_histogram(metrics)
    steps = sum(hist)
    tokens = sum(r.completion_tokens for r in ok)
    out = {
        "name": name, "flags": flags, "requests": len(results), "failed": len(results) - len(ok),
        "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_ms": 1e3 * float(np.percentile([r.ttft for r in ok], 50)) if ok else 0.0,
        "ttft_p99_ms": 1e3 * float(np.percentile([r.ttft for r in ok], 99)) if ok else 0.0,
        "e2e_p50_ms": 1e3 * float(np.percentile([r.e2e for r in ok], 50)) if ok else 0.0,
        "e2e_p99_ms": 1e3 * float(np.percentile([r.e2e for r in ok], 99)) if ok else 0.0,
        "acceptance_histogram": hist,
        "mean_acceptance_length": sum((i + 1) * n for i, n in enumerate(hist)) / steps if steps else None,
        "draft_acceptance_rate": _metric(metrics, "namazu_spec_draft_acceptance_rate"),
        "drafter_ms_per_step": 1e3 * _metric(metrics, "namazu_spec_drafter_seconds_per_step"),
    }
    if out["failed"]:
        out["first_error"] = next(r.error for r in results if not r.ok)
    return out


def greedy_identity(flags_a: str, flags_b: str, records: list) -> dict:
    """The captured prompts at T=0 under their output constraints through LLM(...) offline with both setups
    (fp32): how many outputs are token-identical (speculation must never change a greedy output)."""
    import dataclasses

    from namazu import LLM, SamplingParams
    from namazu.engine_config import EngineConfig
    from namazu.server import build_parser

    outs = []
    for flags in (flags_a, flags_b):
        cfg = EngineConfig.from_cli_args(build_parser().parse_args(flags.split()))
        kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        kw.update(dtype="float32", executor="inline")
        with LLM(**kw) as llm:
            params = [SamplingParams(temperature=0, max_tokens=replay_settings(r)["max_tokens"], **r.structured)
                      for r in records]
            res = llm.generate(prompt_token_ids=[r.prompt_token_ids for r in records], sampling_params=params,
                               use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in res])
    same = sum(a == b for a, b in zip(*outs))
    return {"prompts": len(records), "identical": same, "tokens": sum(len(a) for a in outs[0])}


def regenerate(sources: list[str], limit: int, temperature: float, top_p: float) -> list:
    """The held-out captured prompts answered again by the target at one sampling setting (seeded, the
    captured max_tokens and output constraint), offline: every request then counts at that setting, not only
    the ones captured with it."""
    from namazu import LLM, SamplingParams
    from namazu.spec.capture import read_records
    from namazu.spec.training.train import Example

    recs = list(read_records(sources))[:limit]
    params = [SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0, seed=i,
                             max_tokens=int(r.sampling.get("max_tokens") or 128), **r.structured)
              for i, r in enumerate(recs)]
    with LLM(None, executor="inline") as llm:
        outs = llm.generate(prompt_token_ids=[r.prompt_token_ids for r in recs], sampling_params=params,
                            use_tqdm=False)
    return [Example(r.prompt_token_ids + list(o.outputs[0].token_ids), len(r.prompt_token_ids), temperature == 0)
            for r, o in zip(recs, outs) if len(o.outputs[0].token_ids) >= 2]


def simulate(sources: list[str], drafters: list[str], k: int, limit: int, examples: list | None = None
             ) -> list[dict]:
    """Acceptance length without a server: decoding replayed over each held-out captured output (draft k
    from the context before the anchor, accept the prefix equal to the captured tokens, move on by
    accepted + 1). For greedy (T=0) captures this is exactly what the engine's verify step counts; for
    sampled captures it is greedy drafts matched against one sample (a proxy). `drafters`: NAME=DIR or
    ngram."""
    import torch

    from namazu.assets import resolve_model_path
    from namazu.spec.dflash import DFlashDrafter
    from namazu.spec.drafters import NgramProposer
    from namazu.spec.training.train import Target, acceptance_length, load_examples

    examples = examples if examples is not None else load_examples(sources, 4096)[:limit]
    target_path = str(resolve_model_path(None))
    rows = []
    for spec in drafters:
        name, _, path = spec.partition("=")
        if name == "ngram":
            ngram = NgramProposer()
            taus: dict[str, list[int]] = {"greedy": [], "sampled": []}
            tried = {kind: np.zeros(k) for kind in taus}
            took = {kind: np.zeros(k) for kind in taus}
            for ex in examples:
                kind = "greedy" if ex.greedy else "sampled"
                a = ex.loss_from
                while a < len(ex.ids) - 1:
                    kk = min(k, len(ex.ids) - 1 - a)
                    d = ngram.propose_tokens(ex.ids[:a + 1], kk)
                    acc = 0
                    while acc < len(d) and d[acc] == ex.ids[a + 1 + acc]:
                        acc += 1
                    taus[kind].append(acc + 1)
                    tried[kind][:min(acc + 1, len(d))] += 1
                    took[kind][:acc] += 1
                    a += acc + 1
            res = {kind: {"mean_acceptance_length": float(np.mean(v)), "verify_steps": len(v),
                          "histogram": np.bincount(v, minlength=k + 2)[1:].tolist(),
                          "position_acceptance": (took[kind] / np.maximum(tried[kind], 1)).round(4).tolist()}
                   for kind, v in taus.items() if v}
        else:
            t = Target(target_path, [])
            with torch.no_grad():
                c = t.model.config
                drafter = DFlashDrafter.load(path, c.vocab_size, c.hidden_size, c.num_hidden_layers)
            t.layers = drafter.cfg.target_layers
            res = acceptance_length(drafter, t, examples, k, max_examples=limit)
        rows.append({"name": name, **res})
    return rows


def simulation_table(rows: list[dict]) -> str:
    lines = ["| drafter | T=0 outputs: mean acceptance length (exact) | verify steps | histogram (1, 2, ...) | "
             "acceptance of draft 1, 2, ... given the ones before | sampled outputs: greedy-match proxy |",
             "|---|---:|---:|---|---|---:|"]
    for r in rows:
        g, s = r.get("greedy", {}), r.get("sampled", {})
        pos = ", ".join(f"{x:.2f}" for x in g.get("position_acceptance", []))
        lines.append(f"| {r['name']} | {g.get('mean_acceptance_length', 0):.2f} | {g.get('verify_steps', 0)} | "
                     f"{g.get('histogram', '-')} | {pos or '-'} | {s.get('mean_acceptance_length', 0):.2f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| setup | requests | mean acceptance length | acceptance histogram (1, 2, ...) | draft acceptance "
             "| drafter ms/step | tok/s | TTFT p50 / p99 ms | e2e p50 / p99 ms |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['requests'] - r['failed']}/{r['requests']} | "
                     f"{f(r['mean_acceptance_length'])} | {r['acceptance_histogram'] or '-'} | "
                     f"{f(r['draft_acceptance_rate'], '{:.0%}')} | {f(r['drafter_ms_per_step'], '{:.1f}')} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        h = np.asarray(r["acceptance_histogram"] or [0], dtype=float)
        if h.sum():
            ax1.bar(np.arange(1, len(h) + 1) + i * width, h / h.sum(), width, label=r["name"])
    ax1.set_xlabel("acceptance length (tokens per verify step)")
    ax1.set_ylabel("share of verify steps")
    ax1.legend()
    names = [r["name"] for r in rows]
    ax2.bar(names, [r["tokens_per_s"] for r in rows], color=["C0", "C1", "C2", "C3"][:len(rows)])
    ax2.set_ylabel("output tokens/s")
    for i, r in enumerate(rows):
        ax2.text(i, r["tokens_per_s"], f"e2e p50 {r['e2e_p50_ms']:.0f} ms", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default=None, help="server flags of setup A ('' = defaults)")
    ap.add_argument("--b", default=None, help="server flags of setup B")
    ap.add_argument("--a-name", default="A")
    ap.add_argument("--b-name", default="B")
    ap.add_argument("--requests", nargs="+", required=True, help="capture directories or shard files")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (1: batch-1 latency)")
    ap.add_argument("--temperature", type=float, default=None, help="override every request's temperature")
    ap.add_argument("--plot", default=None, help="PNG to write")
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument("--write", default=None, metavar="NAME", help="add the table to bench/RESULTS.md as NAME")
    ap.add_argument("--identity", action="store_true",
                    help="instead: check greedy outputs of A and B are token-identical (offline, fp32)")
    ap.add_argument("--simulate", nargs="+", default=None, metavar="NAME=DIR|ngram",
                    help="instead: acceptance length of these drafters replayed offline over the captures")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step in --simulate")
    ap.add_argument("--regenerate", type=float, default=None, metavar="T",
                    help="with --simulate: answer the held-out prompts again at temperature T (top-p "
                         "--top-p) with the target first, so that every request counts at that setting")
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args(argv)
    if args.simulate:
        examples = regenerate(args.requests, args.limit, args.regenerate, args.top_p) \
            if args.regenerate is not None else None
        rows = simulate(args.requests, args.simulate, args.k, args.limit, examples)
        print(simulation_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        if args.write:
            from bench.results_md import write_section

            body = (f"### Acceptance length, offline replay of held-out captures: {args.write}\n\n"
                    f"`python -m bench.replay --requests ... --simulate {' '.join(args.simulate)} --k {args.k} "
                    f"--limit {args.limit}"
                    + (f" --regenerate {args.regenerate:g} --top-p {args.top_p:g}" if args.regenerate is not None
                       else "") + f"`\n\n{simulation_table(rows)}")
            write_section(f"<!-- replay-{args.write}:begin -->", f"<!-- replay-{args.write}:end -->", body)
        return 0
    if args.a is None or args.b is None:
        ap.error("--a and --b are required (or --simulate)")
    recs, reqs = captured_requests(args.requests, args.limit, args.temperature)
    if not reqs:
        print(f"no captured requests in {args.requests}", file=sys.stderr)
        return 1
    if args.identity:
        res = greedy_identity(args.a, args.b, recs)
        print(f"greedy outputs identical: {res['identical']}/{res['prompts']} prompts ({res['tokens']} tokens)")
        if args.json:
            Path(args.json).write_text(json.dumps(res) + "\n")
        return 0 if res["identical"] == res["prompts"] else 1
    log_dir = Path(tempfile.mkdtemp(prefix="namazu-replay-"))
    rows = [run_setup(args.a_name, args.a, reqs, args.concurrency, log_dir),
            run_setup(args.b_name, args.b, reqs, args.concurrency, log_dir)]
    temp = "own" if args.temperature is None else f"{args.temperature:g}"
    print(f"{len(reqs)} captured requests, temperature {temp}, concurrency {args.concurrency} "
          f"(server logs: {log_dir})")
    print(table(rows))
    a, b = rows
    if a["tokens_per_s"] and b["tokens_per_s"]:
        print(f"{args.b_name} / {args.a_name} tokens/s: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x")
    if args.plot:
        plot(rows, args.plot)
    if args.write:
        from bench.results_md import write_section

        cmd = "python -m bench.replay " + " ".join(
            a if a and " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
        speed = (f"\n\n{args.b_name} / {args.a_name} output tokens/s: "
                 f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x" if a["tokens_per_s"] else "")
        body = (f"### Replay: {args.write}\n\n`{cmd}`\n\n{len(reqs)} held-out captured requests, temperature "
                f"{temp}, concurrency {args.concurrency}; load average {os.getloadavg()[0]:.1f} on a shared "
                f"machine.\n\n{table(rows)}{speed}")
        write_section(f"<!-- replay-{args.write}:begin -->", f"<!-- replay-{args.write}:end -->", body)
    if args.json:
        Path(args.json).write_text(json.dumps({"temperature": temp, "concurrency": args.concurrency,
                                               "rows": rows}, indent=1) + "\n")
    return 0 if not (a["failed"] or b["failed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
