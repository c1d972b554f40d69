"""The DFlash drafter's cost per engine step, and decode speed with it, against speculation off, in one run.

    python bench/drafter_step.py [--drafters shipped=namazu/assets/namazu-tiny/drafter NAME=DIR ...]
                                 [--requests CAPTURE_DIR] [--batch 1 2 4 8] [--rounds 3] [--output-len 48]
                                 [--groups 8] [--ignore-eos] [--k N] [--min-confidence 0 0.3 ...]
                                 [--modes eager graph] [--auto-threshold N] [--dtype float32] [--tp N]
                                 [--executor inline|mp] [--json-schema FILE]

Every setup (per mode: speculation off; one per drafter and --min-confidence threshold at --k draft
tokens, drafting at every batch size, named DRAFTER@THRESHOLD when several thresholds are swept; and
auto, the default engine: the model's shipped drafter with its default threshold, off above the
batch-size threshold) is an inline engine kept for the whole run; each round runs every generate call on
every setup in turn (the order rotating), so that a shared machine's load falls on all of them alike. A
first round at every batch size is run and not counted (graph mode
compiles its ladder entries there).
Per setup and batch (median over rounds): drafter ms per step (`drafter_seconds` / steps: extending the
context cache and drafting), engine ms per step, CPU ms per step (this process's CPU time: with --threads 1 it
moves much less than the wall clock with other processes' load, so "vs off (CPU)", output tokens per CPU
second against off's, is the ratio to compare on a shared machine), output tokens/s, decode tokens/s (the
tokens after each prompt's first, over the wall time from the batch's last first token to its end: the phase
drafting speeds up, without the prefills it does not touch), output tokens per engine step (every step,
prefills and plain steps included: what the draft policy's choices cost in steps, a count the machine's load
does not move), mean acceptance length, verify rows per verify step (1 + drafts verified) and drafts proposed
per drafted sequence; then off / on / auto side by side with their ratios, and the largest batch at which
drafting paid (the break-even that `namazu/spec/selection.py` takes as the auto threshold). Greedy, answers
end at EOS or --output-len (--ignore-eos: always --output-len; past EOS the target writes text no drafter was
trained on, which understates acceptance), --groups generate calls per round on other prompts; prompts are
held-out captured prompts (--requests) or, by default, 64 held-out chat requests of the drafter's traffic mix
(`namazu.spec.training.traffic`, valid split) through the default model's chat template.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", default=None, metavar="NAME=DIR",
                    help="drafters run at every batch size (default: the default model's shipped one)")
    ap.add_argument("--requests", nargs="*", default=None, help="capture dirs whose prompts to use")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--auto-threshold", type=int, default=None, metavar="N",
                    help="--speculative-disable-batch-size of the auto setup (default: the engine's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--k", type=int, default=None,
                    help="draft tokens per step of a named drafter (default: its block size - 1, as served)")
    ap.add_argument("--groups", type=int, default=8,
                    help="generate calls per setup, batch size and round, each on other prompts")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="always --output-len tokens (default: answers end at EOS, as served; greedy outputs "
                         "are the same with and without drafting, so every setup still does the same work)")
    ap.add_argument("--min-confidence", type=float, nargs="+", default=[0.0], metavar="X",
                    help="--speculative-min-confidence of the named drafters' setups, one setup per value "
                         "(0: full blocks)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-schema", default=None, metavar="FILE",
                    help="every request constrained to this JSON schema (the grammar's bitmask rows in every step)")
    ap.add_argument("--executor", choices=["inline", "mp"], default="inline",
                    help="inline: the worker in this process (its CPU time is this process's); mp: the worker in "
                         "its own process, as the server runs it (the engine's host work overlaps the step)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks per engine (worker processes over gloo, --threads each)")
    ap.add_argument("--dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="engine dtype(s), each a set of setups per mode (auto: the engine's default; float32 "
                         "keeps greedy answers identical across setups: in bfloat16 a 7-row verify and a 1-row "
                         "step round differently, and near-ties can flip)")
    ap.add_argument("--prose", choices=["ja", "en"], default=None,
                    help="prompts from the corpus's held-out test split of this language, as raw completions "
                         "(text unlike the drafter's chat traffic)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (0: greedy, answers checked identical across setups)")
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "graph"],
                    help="eager steps, and/or decode, verify and draft steps as compiled graphs")
    ap.add_argument("--breakdown", action="store_true",
                    help="then, per setup at the first batch size: this process's CPU ms per engine step by step "
                         "kind (plain decode, verify) and by part (target forward, logits, drafter context and "
                         "proposal, the rest of the worker's step, the engine outside it)")
    args = ap.parse_args(argv)
    if args.breakdown and (args.executor != "inline" or args.tp > 1):
        ap.error("--breakdown times the worker's parts in this process: it needs --executor inline and --tp 1")

    from namazu import LLM, SamplingParams
    from namazu.assets import default_model_path
    from namazu.engine.llm_engine import mean_acceptance_length
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    if args.requests:
        from namazu.spec.capture import read_records

        prompts = [r.prompt_token_ids for r in read_records(args.requests)]
    elif args.prose:
        # Text unlike the drafter's traffic: the opening of held-out corpus lines as raw completion
        # prompts (no chat template), the model continuing the prose.
        import gzip

        from namazu.assets import resolve_model_path
        from namazu.tiny.corpus import default_corpus_dir, split_path
        from namazu.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(resolve_model_path(None))
        prompts = []
        with gzip.open(split_path(default_corpus_dir(), args.prose, "test"), "rt", encoding="utf-8") as f:
            for line in f:
                ids = tok.encode(line.strip())
                if len(ids) >= 48:
                    prompts.append(ids[:32])
                if len(prompts) == 64:
                    break
    else:
        # Held-out chat requests like the drafter's traffic (random token ids would understate its
        # acceptance, and so the break-even), through the default model's chat template.
        from namazu.assets import resolve_model_path
        from namazu.spec.training.traffic import build_requests
        from namazu.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(resolve_model_path(None))
        prompts = [tok.encode_chat(r["messages"], tools=r["tools"] or None)
                   for r in build_requests(64, split="valid", seed=1)]
    named = args.drafters or [f"shipped={default_model_path() / SHIPPED_DRAFTER_DIR}"]
    swept = [(f"{name}@{x:g}" if len(args.min_confidence) > 1 else name, (path, x))
             for name, path in (d.split("=", 1) for d in named) for x in args.min_confidence]
    drafters = [("off", None)] + swept + [("auto", "auto")]
    # A variant is a mode at a dtype; its setups are compared with its own "off".
    short = {"auto": "auto", "float32": "fp32", "bfloat16": "bf16"}
    variants = {(f"{mode}-{short[d]}" if len(args.dtype) > 1 else mode): (mode, d)
                for mode in args.modes for d in args.dtype}
    setups = [(f"{label}/{name}" if len(variants) > 1 else name, path, label)
              for label in variants for name, path in drafters]
    llms = {}
    for name, path, label in setups:
        mode, dtype = variants[label]
        if path is None:
            kw = dict(num_speculative_tokens=0)
        elif path == "auto":
            kw = dict(speculative_disable_batch_size=args.auto_threshold)
        else:       # a named drafter drafts at every batch size unless told otherwise
            kw = dict(speculative_model=path[0], num_speculative_tokens=args.k,   # None: its block size - 1
                      speculative_min_confidence=path[1])
        t0 = time.perf_counter()
        # An explicit KV budget: the setups share one process (and, on a GPU, its memory).
        tp = dict(executor=args.executor) if args.tp == 1 else dict(executor="mp", tensor_parallel_size=args.tp)
        llms[name] = LLM(None, threads=args.threads, dtype=dtype, **tp,
                         kv_cache_memory="256MiB", enforce_eager=mode == "eager", max_num_seqs=max(args.batch),
                         **kw)
        eng = llms[name].engine
        print(f"{name}: started in {time.perf_counter() - t0:.1f} s; {eng.num_speculative_tokens} draft tokens, "
              f"min confidence {eng.config.speculative_min_confidence or 0:g}, "
              f"disabled above batch {eng.scheduler.spec_disable_batch_size or 'never'}, "
              f"{eng.executor.infos()[0].dtype}")
    # At T > 0 the requests carry no seed, as users send them (a seeded row is verified by exact match,
    # which accepts fewer drafts): answers then differ across setups, in distribution only.
    schema = None
    if args.json_schema:
        import json

        with open(args.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=args.ignore_eos,
                            json_schema=schema)
    rows: dict[tuple[str, int], list[dict]] = {}
    # answers per round, batch and dtype (dtypes round differently: greedy answers differ across them)
    same_work: dict[tuple[int, int, str], set[int]] = collections.defaultdict(set)
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for r in range(-1, args.rounds):          # round -1: warm-up (graph compilation), not counted
        for bsz in args.batch:
            first = (r + 1) * bsz * args.groups
            batches = [[prompts[(first + g * bsz + i) % len(prompts)] for i in range(bsz)] for g in range(args.groups)]
            # Group by group, every setup in turn (its order rotating), so that a shared machine's load
            # drift within a round falls on all setups alike.
            before = {name: llms[name].engine.get_stats() for name, _, _ in setups}
            wall = dict.fromkeys(before, 0.0)
            cpu = dict.fromkeys(before, 0.0)
            tokens = dict.fromkeys(before, 0)
            decode_wall = dict.fromkeys(before, 0.0)
            decode_tokens = dict.fromkeys(before, 0)
            answers: dict[str, list] = {name: [] for name in before}
            for g, batch in enumerate(batches):
                for j in range(len(setups)):
                    name = setups[(g + j) % len(setups)][0]
                    t0, c0 = time.perf_counter(), time.process_time()
                    outs = llms[name].generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
                    took = time.perf_counter() - t0
                    wall[name] += took
                    cpu[name] += time.process_time() - c0
                    made = sum(len(o.outputs[0].token_ids) for o in outs)
                    tokens[name] += made
                    # The decode phase: from the batch's last first token to its end (its prefills are done;
                    # drafting speeds up only this part).
                    decode_wall[name] += took - max(o.metrics.get("time_to_first_token", 0.0) for o in outs)
                    decode_tokens[name] += made - len(outs)
                    answers[name] += [list(o.outputs[0].token_ids) for o in outs]
            for name, _, label in setups:
                s0, s1 = before[name], llms[name].engine.get_stats()
                same_work[(r, bsz, variants[label][1])].add(hash(str(answers[name])))
                steps = s1.num_steps - s0.num_steps
                hist = np.array(s1.acceptance_length_histogram or [0]) - np.array(s0.acceptance_length_histogram or [0])
                if r < 0:
                    continue
                verifies = int(hist.sum())
                blocks = s1.num_draft_blocks - s0.num_draft_blocks
                rows.setdefault((name, bsz), []).append({
                    "drafter_ms": 1e3 * (s1.drafter_seconds - s0.drafter_seconds) / max(1, steps),
                    "step_ms": 1e3 * wall[name] / max(1, steps), "tok_s": tokens[name] / wall[name],
                    "tok_step": tokens[name] / max(1, steps),
                    "cpu_ms": 1e3 * cpu[name] / max(1, steps), "tok_cpu_s": tokens[name] / cpu[name],
                    "dec_tok_s": decode_tokens[name] / max(1e-9, decode_wall[name]),
                    "tau": mean_acceptance_length(hist.tolist()),
                    "rows": 1 + (s1.num_draft_tokens - s0.num_draft_tokens) / verifies if verifies else 0.0,
                    "block": (s1.num_drafts_proposed - s0.num_drafts_proposed) / blocks if blocks else 0.0})
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    differ = sorted(k for k, v in same_work.items() if len(v) > 1)
    if args.temperature == 0:
        print("greedy answers identical across setups of a dtype: " + ("yes" if not differ else
              f"NO (round, batch, dtype): {differ}"))
    else:
        print(f"T = {args.temperature:g}, unseeded: answers differ across setups (same distribution)")
    print("| setup | batch | drafter ms/step | engine ms/step | CPU ms/step | output tok/s | vs off | vs off (CPU) "
          "| decode tok/s | decode vs off | tokens per step | mean acceptance length | verify rows per verify step "
          "| drafts per block |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for bsz in args.batch:
        for name, _, mode in setups:
            off_name = f"{mode}/off" if len(variants) > 1 else "off"
            off = statistics.median(x["tok_s"] for x in rows[(off_name, bsz)])
            off_cpu = statistics.median(x["tok_cpu_s"] for x in rows[(off_name, bsz)])
            off_dec = statistics.median(x["dec_tok_s"] for x in rows[(off_name, bsz)])
            xs = rows[(name, bsz)]

            def med(key: str, xs=xs) -> float:
                return statistics.median(x[key] for x in xs)
            spec = (f"{med('tau'):.2f} | {med('rows'):.2f} | {med('block'):.2f}" if name != off_name
                    else "- | - | -")
            print(f"| {name} | {bsz} | {med('drafter_ms'):.2f} | {med('step_ms'):.2f} | {med('cpu_ms'):.2f} | "
                  f"{med('tok_s'):.1f} | {med('tok_s') / off:.2f}x | {med('tok_cpu_s') / off_cpu:.2f}x | "
                  f"{med('dec_tok_s'):.1f} | {med('dec_tok_s') / off_dec:.2f}x | {med('tok_step'):.2f} | {spec} |")
    side_by_side(rows, setups, args.batch, list(variants))
    if len(args.dtype) > 1:
        across_dtypes(rows, setups, args.batch, variants)
    if args.breakdown:
        bsz = args.batch[0]
        batches = [[prompts[(g * bsz + i) % len(prompts)] for i in range(bsz)] for g in range(args.groups)]
        print(f"\nCPU ms per engine step by kind and part (batch {bsz}, {args.groups} generate calls per setup)")
        print("| setup | step kind | steps | step | target forward | logits | drafter context | drafter proposal "
              "| rest of the worker step | engine outside it |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, _, _ in setups:
            for kind, n, parts in step_breakdown(llms[name], batches, params):
                print(f"| {name} | {kind} | {n} | " + " | ".join(f"{1e3 * parts[p] / n:.2f}" for p in PARTS) + " |")
    for llm in llms.values():
        llm.close()
    return 0


PARTS = ("step", "target forward", "logits", "drafter context", "drafter proposal", "rest of the worker step",
         "engine outside it")


def step_breakdown(llm, batches: list, params) -> list[tuple[str, int, dict[str, float]]]:
    """Runs `batches` with the inline worker's parts timed (thread CPU time, wrappers on the instances,
    removed after); returns per step kind (plain decode, verify, other: prefill or mixed) the step count
    and CPU seconds per part. A step is attributed to the kind of the batch its worker executed."""
    eng = llm.engine
    runner = eng.executor.worker.runner
    model, proposer = runner.model, runner.proposer
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(PARTS, 0.0))
    counts: collections.Counter = collections.Counter()
    now = {"kind": "other", "parts": None}

    def timed(obj, attr: str, part: str) -> None:
        inner = getattr(obj, attr)

        def wrapper(*a, **kw):
            t0 = time.thread_time()
            try:
                return inner(*a, **kw)
            finally:
                if now["parts"] is not None:
                    now["parts"][part] += time.thread_time() - t0
        setattr(obj, attr, wrapper)

    def execute(b, inner=runner.execute):
        sq = b.seqs
        plain = bool(len(sq.seq_ids)) and bool((sq.num_new == 1).all())
        now["kind"] = ("verify" if int(sq.num_drafts.sum()) else "plain decode") if plain else "other"
        now["parts"] = parts = {p: 0.0 for p in PARTS}
        t0 = time.thread_time()
        try:
            return inner(b)
        finally:
            parts["step"] = time.thread_time() - t0
            named = sum(parts[p] for p in PARTS[1:5])
            parts["rest of the worker step"] = parts["step"] - named
            now["done"] = parts

    def step(inner=eng.step):
        now["done"] = None
        t0 = time.thread_time()
        out = inner()
        total = time.thread_time() - t0
        parts = now["done"]
        if parts is not None:
            parts["engine outside it"] = total - parts["step"]
            parts["step"] = total
            counts[now["kind"]] += 1
            for p in PARTS:
                totals[now["kind"]][p] += parts[p]
        now["parts"] = None
        return out

    timed(model, "forward", "target forward")
    timed(model, "compute_logits", "logits")
    if proposer is not None and hasattr(proposer, "extend_context"):
        timed(proposer, "extend_context", "drafter context")
    if proposer is not None:
        timed(proposer, "propose", "drafter proposal")
    runner.execute, eng.step = execute, step
    try:
        for batch in batches:
            llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
    finally:
        for obj, attrs in ((model, ("forward", "compute_logits")), (runner, ("execute",)), (eng, ("step",)),
                           (proposer, ("extend_context", "propose"))):
            for attr in attrs:
                if obj is not None:
                    obj.__dict__.pop(attr, None)
    return [(kind, counts[kind], totals[kind]) for kind in ("plain decode", "verify", "other") if counts[kind]]


def side_by_side(rows: dict, setups: list, batches: list[int], modes: list[str]) -> None:
    """Per mode and batch: output tok/s off, each named drafter (on) and auto, and their ratios to off; then
    the largest batch at which each drafter beat off (the break-even for --speculative-disable-batch-size)."""
    def tok_s(name: str, bsz: int) -> float:
        return statistics.median(x["tok_s"] for x in rows[(name, bsz)])

    for mode in modes:
        pre = f"{mode}/" if len(modes) > 1 else ""
        names = [n for n, _, m in setups if m == mode]
        on = [n for n in names if n not in (pre + "off", pre + "auto")]
        print(f"\n{mode}: output tok/s (ratio to off)")
        print("| batch | off | " + " | ".join(on) + " | auto |")
        print("|---:|---:|" + "---:|" * (len(on) + 1))
        for bsz in batches:
            off = tok_s(pre + "off", bsz)
            cells = [f"{tok_s(n, bsz):.1f} ({tok_s(n, bsz) / off:.2f}x)" for n in on + [pre + "auto"]]
            print(f"| {bsz} | {off:.1f} | " + " | ".join(cells) + " |")
        for n in on:
            paid = [b for b in batches if tok_s(n, b) > tok_s(pre + "off", b)]
            print(f"{n}: drafting paid at batch {paid or 'none'}; break-even (largest batch that paid, "
                  f"among {batches}): {max(paid) if paid else 0}")


def across_dtypes(rows: dict, setups: list, batches: list[int], variants: dict) -> None:
    """Per mode and batch: every setup's decode tok/s against the first dtype's speculation off in the same
    mode (what serving in another dtype buys, drafting or not)."""
    for mode in dict.fromkeys(m for m, _ in variants.values()):
        labels = [lb for lb, (m, _) in variants.items() if m == mode]
        names = [n for n, _, lb in setups if lb in labels]
        base = f"{labels[0]}/off"
        print(f"\n{mode}: decode tok/s against {base}")
        print("| batch | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for bsz in batches:
            ref = statistics.median(x["dec_tok_s"] for x in rows[(base, bsz)])
            cells = [statistics.median(x["dec_tok_s"] for x in rows[(n, bsz)]) for n in names]
            print(f"| {bsz} | " + " | ".join(f"{c:.1f} ({c / ref:.2f}x)" for c in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
