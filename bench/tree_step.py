"""Decode speed with draft trees (`--speculative-tree-budget N`) against the chain and speculation off, in one run.

    python bench/tree_step.py [--budgets 8 16] [--batch 1 8] [--temperatures 0 0.7] [--rounds 3]
                              [--groups 4] [--output-len 48] [--threads 1] [--modes eager graph] [--sync]
                              [--ignore-eos]
    python bench/tree_step.py --acceptance 48 [--budgets 24] [--temperatures 0 0.7 1.0] [--seeds 1 2]
                              [--requests CAPTURE [--keep-seeds]] [--tree-candidates 0 64]

Setups, one inline engine each, kept for the whole run: off (no speculation); chain (the model's shipped DFlash2
drafter named by flags, so it drafts at every batch size, --k drafts: its block size - 1); tree@N for each
budget (the same drafter and depth, a tree of N draft nodes, width up to 8; tree@N:K with several
--tree-candidates). Each round runs every generate
call on every setup in turn, the order rotating, so that a shared machine's load falls on all alike; a first
round is run and not counted. Per setup, batch size and temperature (median over rounds): decode tokens/s
(the tokens after each prompt's first over the wall time from the batch's last first token to its end: the
phase speculation speeds up), output tokens/s, engine ms per step, tokens per verify step (mean acceptance
length), verify rows per verify step (1 + rows the engine planned), and the ratios to off and to the chain.
Answers end at EOS or --output-len (--ignore-eos: always --output-len; past EOS the target writes text no
drafter was trained on, which understates acceptance). Prompts: 64 held-out chat requests of the drafter's
traffic mix (`namazu.spec.training.traffic`, valid split)
through the default model's chat template, the same for every setup. T > 0 requests carry no seed, so their
rows take the lossless rule with the drafter's q (a request's own seed takes exact matching, and accepts less).
--acceptance N: no timing; tokens per verify step of the chain and each tree on the first N prompts at
once (16 sequences per step, synchronous scheduling, answers ending at EOS or --output-len), once per
engine --seeds value (the engine-drawn per-sequence seeds at T > 0). With --requests CAPTURE: the first N
requests captured at each temperature instead, each with its own sampling settings (top-p, max_tokens),
unseeded unless --keep-seeds; --tree-candidates: a tree column per budget and candidate count.
--modes eager graph: every setup once per mode (graph: `enforce_eager=False`, CPU torch.compile under inductor,
tree verifies in tree entries: docs/speculative.md, "In the step"), in the same rounds; the table adds each
graph setup's decode speed against the same setup eager ("vs eager"); "vs off" and "vs chain" stay within a mode.
--sync turns async scheduling off in every setup. The first tables of bench/RESULTS.md needed it: async
planning then assumed all N rows of the step in flight accepted, so near `max_tokens` it planned a tree's
sequence fewer rows; it now assumes the tree's depth (docs/speculative.md, "In the step").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prompts() -> list[list[int]]:
    from namazu.assets import resolve_model_path
    from namazu.spec.training.traffic import build_requests
    from namazu.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(resolve_model_path(None))
    return [tok.encode_chat(r["messages"], tools=r["tools"] or None) for r in build_requests(64, split="valid", seed=1)]


def _engines(args) -> dict[str, object]:
    from namazu import LLM
    from namazu.assets import default_model_path
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    drafter = str(default_model_path() / SHIPPED_DRAFTER_DIR)
    setups = {"off": dict(num_speculative_tokens=0), "chain": dict(speculative_tree_budget=0)}
    many = len(args.tree_candidates) > 1
    setups.update({f"tree@{n}" + (f":{c}" if many else ""):
                   dict(speculative_tree_budget=n, speculative_tree_candidates=c)
                   for n in args.budgets for c in args.tree_candidates})
    llms = {}
    for mode in args.modes:
        for name, kw in setups.items():
            if name != "off":
                kw = dict(kw, speculative_model=drafter, num_speculative_tokens=args.k,
                          speculative_disable_batch_size=0)
            label = f"{mode}/{name}" if len(args.modes) > 1 else name
            llms[label] = LLM(None, executor="inline", threads=args.threads, kv_cache_memory="256MiB",
                              enforce_eager=mode == "eager", max_num_seqs=max(args.batch),
                              async_scheduling=not args.sync, **kw)
    return llms


def _measure(llm, batches, params) -> dict[str, float]:
    from namazu.engine.llm_engine import mean_acceptance_length

    s0 = llm.engine.get_stats()
    wall = dec_wall = 0.0
    tokens = dec_tokens = 0
    for batch in batches:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        took = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        wall += took
        tokens += made
        dec_wall += took - max(o.metrics.get("time_to_first_token", 0.0) for o in outs)
        dec_tokens += made - len(outs)
    s1 = llm.engine.get_stats()
    hist = np.array(s1.acceptance_length_histogram or [0]) - np.array(s0.acceptance_length_histogram or [0])
    verifies = int(hist.sum())
    steps = s1.num_steps - s0.num_steps
    return {"dec_tok_s": dec_tokens / max(dec_wall, 1e-9), "tok_s": tokens / wall,
            "step_ms": 1e3 * wall / max(steps, 1),
            "tau": mean_acceptance_length(hist.tolist()),
            "rows": 1 + (s1.num_draft_tokens - s0.num_draft_tokens) / verifies if verifies else 0.0}


def _captured(args, temp: float) -> tuple[list[list[int]], list]:
    """The --requests records captured at `temp`: prompt ids and their own sampling settings (top-p, max_tokens,
    output constraint), less the seed unless --keep-seeds (a seeded row verifies by exact match with the
    target's seeded sample, not by the rejection rule with q)."""
    import dataclasses

    from namazu.spec.capture import read_records
    from namazu.spec.training.replay import replay_params

    recs = [r for r in read_records(args.requests) if np.isclose(float(r.sampling.get("temperature") or 0.0), temp)]
    params = []
    for r in recs[:args.acceptance]:
        p = replay_params(r)
        params.append(p if args.keep_seeds else dataclasses.replace(p, seed=None))
    return [r.prompt_token_ids for r in recs[:args.acceptance]], params


def _acceptance(args, prompts) -> None:
    from namazu import LLM, SamplingParams
    from namazu.assets import default_model_path
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    drafter = str(default_model_path() / SHIPPED_DRAFTER_DIR)
    setups = [(0, 0)] + [(b, c) for b in args.budgets for c in args.tree_candidates]
    name = lambda b, c: "chain" if b == 0 else f"tree@{b}" + (f" over {c}" if len(args.tree_candidates) > 1 else "")  # noqa: E731
    print("| T | requests | " + " | ".join(name(b, c) for b, c in setups) + " |")
    print("|---:|---:|" + "---:|" * len(setups))
    for temp in args.temperatures:
        if args.requests:
            batch, params = _captured(args, temp)
        else:
            batch = prompts[:args.acceptance]
            params = SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=args.ignore_eos)
        cells = []
        for b, c in setups:
            taus = []
            for seed in args.seeds:
                with LLM(None, executor="inline", threads=args.threads, speculative_model=drafter,
                         num_speculative_tokens=args.k, speculative_disable_batch_size=0, speculative_tree_budget=b,
                         speculative_tree_candidates=c, async_scheduling=False, seed=seed, max_num_seqs=16) as llm:
                    llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
                    taus.append(llm.engine.get_stats().mean_acceptance_length)
            cells.append(taus)
        chain = statistics.mean(cells[0])
        print(f"| {temp:g} | {len(batch)} | " + " | ".join(
            " / ".join(f"{t:.2f}" for t in taus) + f" ({statistics.mean(taus) / chain:.2f}x)" for taus in cells) + " |",
            flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4, help="generate calls per setup, batch, temperature and round")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--k", type=int, default=None, help="chain drafts and tree depth (default: block size - 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "graph"])
    ap.add_argument("--sync", action="store_true", help="async scheduling off in every setup")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--acceptance", type=int, default=0, metavar="N",
                    help="only tokens per verify step, on N prompts (no timing)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="engine seeds of --acceptance")
    ap.add_argument("--requests", nargs="+", default=None, metavar="CAPTURE",
                    help="--acceptance over these captured requests, each temperature's own, with their sampling "
                         "settings (not the traffic prompts)")
    ap.add_argument("--keep-seeds", action="store_true", help="--requests with their own seeds (exact-match rule)")
    ap.add_argument("--tree-candidates", type=int, nargs="+", default=[64],
                    help="--speculative-tree-candidates of each tree (0: the drafter's selector_k); with several, a "
                         "tree setup per budget and count (tree@N:K)")
    args = ap.parse_args(argv)

    from namazu import SamplingParams

    prompts = _prompts()
    if args.acceptance:
        _acceptance(args, prompts)
        return 0
    llms = _engines(args)
    names = list(llms)
    rows: dict[tuple[str, float, int], list[dict]] = {}
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for r in range(-1, args.rounds):              # round -1: warm-up, not counted
        for temp in args.temperatures:
            params = SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=args.ignore_eos)
            for bsz in args.batch:
                first = (r + 1) * bsz * args.groups
                batches = [[prompts[(first + g * bsz + i) % len(prompts)] for i in range(bsz)]
                           for g in range(args.groups)]
                for j in range(len(names)):
                    name = names[(r + j) % len(names)]
                    got = _measure(llms[name], batches, params)
                    if r >= 0:
                        rows.setdefault((name, temp, bsz), []).append(got)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    both = len(args.modes) > 1
    print("| T | batch | setup | decode tok/s | vs off | vs chain |" + (" vs eager |" if both else "") +
          " output tok/s | engine ms/step | tokens per verify step | verify rows per verify step |")
    print("|---:|---:|---|---:|---:|---:|" + ("---:|" if both else "") + "---:|---:|---:|---:|")
    for temp in args.temperatures:
        for bsz in args.batch:
            def med(name: str, key: str, temp=temp, bsz=bsz) -> float:
                return statistics.median(x[key] for x in rows[(name, temp, bsz)])
            for name in names:
                mode = name.split("/")[0] + "/" if "/" in name else ""
                off, chain = med(f"{mode}off", "dec_tok_s"), med(f"{mode}chain", "dec_tok_s")
                spec = "- | -" if name.endswith("off") else f"{med(name, 'tau'):.2f} | {med(name, 'rows'):.1f}"
                dec = med(name, 'dec_tok_s')
                # graph mode against the same setup eager (run in the same rounds)
                vs_eager = "" if not both else " - |" if not name.startswith("graph/") else \
                    f" {dec / med('eager/' + name.split('/', 1)[1], 'dec_tok_s'):.2f}x |"
                print(f"| {temp:g} | {bsz} | {name} | {dec:.1f} | {dec / off:.2f}x | {dec / chain:.2f}x |{vs_eager} "
                      f"{med(name, 'tok_s'):.1f} | {med(name, 'step_ms'):.2f} | {spec} |")
    for llm in llms.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
