"""Structured output: constrained vs unconstrained decoding in one run, with speculation on and off.

    python bench/structured.py [--model DIR] [--batch 16] [--max-tokens 64] [--k 3] [--write] [--plot FILE]
    python bench/structured.py --instances bench/data/jsonschemabench [--subsets A,B] [--limit N] [--write]

The same prompts (JSON answers in Japanese business phrasing) run unconstrained and under their JSON
schemas from namazu/eval/json_schemas.py, at the same sampling settings, with the n-gram drafter off
and on. Reports decode tokens/s, mean acceptance length (accepted drafts + 1 per verify), the host time
spent filling grammar bitmasks per step and per row, the share of constrained outputs that validate,
and the compile time per schema cold (first compile) and cached.

With --instances DIR it runs no model: JSONSchemaBench's test instances go token by token through
namazu's, xgrammar's and llguidance's compiled grammars (bench/structured_instances.py says how).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`
from tqdm import tqdm

BEGIN, END = "<!-- structured:begin -->", "<!-- structured:end -->"
INST_BEGIN, INST_END = "<!-- structured-instances:begin -->", "<!-- structured-instances:end -->"


# A schema no output completes within the benchmark's max_tokens: constrained and free requests then run
# the same number of steps at the same batch size, so the tokens/s ratio is the grammar's cost alone.
LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 200,
                                                   "items": {"type": "string", "maxLength": 12}}},
        "required": ["items"], "additionalProperties": False}


def run(llm, prompts, schemas, constrained: bool, max_tokens: int, temperature: float):
    from namazu import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=not constrained,
                             json_schema=s if constrained else None) for i, s in enumerate(schemas)]
    before = llm.engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    st = llm.engine.get_stats()
    gen = st.num_generated_tokens - before.num_generated_tokens
    acc = st.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    steps = st.num_steps - before.num_steps
    rows = st.grammar_mask_rows - before.grammar_mask_rows
    mask_s = st.grammar_mask_seconds - before.grammar_mask_seconds
    valid = None
    if constrained:
        import jsonschema

        fc = jsonschema.FormatChecker()
        done = [(o.outputs[0], s) for o, s in zip(outs, schemas) if o.outputs[0].finish_reason == "stop"]
        ok = 0
        for c, s in done:
            try:
                jsonschema.validate(json.loads(c.text), s, format_checker=fc)
                ok += 1
            except Exception:
                pass
        valid = (ok, len(done))
    running = (gen - acc) / max(steps, 1)      # sequences per step (each sequence step emits 1 + accepted)
    return dict(tok_s=gen / dt, per_seq=gen / dt / max(running, 1e-9), running=running,
                tau=gen / max(gen - acc, 1), steps=steps, mask_ms_step=1e3 * mask_s / max(steps, 1),
                mask_us_row=1e6 * mask_s / max(rows, 1), valid=valid, gen=gen)


def compile_times(llm, schemas) -> tuple[float, float]:
    from namazu import SamplingParams

    structured = llm.engine.structured
    cold = cached = 0.0
    for s in schemas:
        p = SamplingParams(json_schema={**s, "description": f"cold {time.time_ns()}"})   # a new cache key
        t0 = time.perf_counter()
        structured.compile(p)
        cold += time.perf_counter() - t0
        t0 = time.perf_counter()
        structured.compile(p)
        cached += time.perf_counter() - t0
    return 1e3 * cold / len(schemas), 1e3 * cached / len(schemas)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded namazu-tiny)")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests (one schema each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--k", type=int, default=3, help="n-gram draft tokens in the speculative runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", action="store_true")
    p.add_argument("--plot", default=None, help="write a bar chart of tokens/s to this PNG")
    p.add_argument("--instances", default=None, metavar="DIR",
                   help="run JSONSchemaBench test instances from DIR (<Subset>.jsonl files) instead; no model")
    p.add_argument("--subsets", default=None, help="with --instances: comma-separated subset names")
    p.add_argument("--limit", type=int, default=None, help="with --instances: at most N schemas per subset")
    p.add_argument("--outcomes", default=None, metavar="FILE",
                   help="with --instances: write every schema's outcome and every wrong instance as JSON lines")
    args = p.parse_args(argv)
    if args.instances:
        return instances(args, argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from namazu import LLM, SamplingParams
    from namazu.eval.json_schemas import json_schemas

    schemas = json_schemas(args.batch)
    prompts = ["次のスキーマに従うJSONで答えてください: " + json.dumps(s, ensure_ascii=False)[:160] for s in schemas]
    results = {}
    for spec in (False, True):
        kw = dict(speculative_method="ngram", num_speculative_tokens=args.k) if spec else dict(num_speculative_tokens=0)
        with LLM(args.model, dtype="float32", executor="inline", max_num_seqs=max(args.batch, 8), **kw) as llm:
            llm.generate(["warm-up"], SamplingParams(max_tokens=4, json_schema=schemas[0]), use_tqdm=False)
            for constrained in tqdm((False, True, "long"), desc=f"speculation {'on' if spec else 'off'}"):
                results[(spec, constrained)] = run(llm, prompts, [LONG] * len(schemas) if constrained == "long"
                                                   else schemas, bool(constrained), args.max_tokens,
                                                   args.temperature)
            if not spec:
                cold_ms, cached_ms = compile_times(llm, json_schemas(50))
    rows = ["| speculation | output | decode tok/s | mean running seqs | tok/s per running seq | vs unconstrained "
            "| mean acceptance length | mask ms/step | mask us/row | stop outputs valid |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for spec in (False, True):
        base = results[(spec, False)]["tok_s"]
        for constrained in (False, True, "long"):
            r = results[(spec, constrained)]
            valid = f"{r['valid'][0]}/{r['valid'][1]}" if r["valid"] else "-"
            mode = f"n-gram k={args.k}" if spec else "off"
            kind = {False: "free", True: "json_schema (50-set)", "long": "json_schema (never complete)"}[constrained]
            rows.append(f"| {mode} | {kind} | {r['tok_s']:,.1f} | {r['running']:.1f} | {r['per_seq']:.1f} "
                        f"| {r['tok_s'] / base:.2f}x | {r['tau']:.2f} "
                        f"| {r['mask_ms_step']:.2f} | {r['mask_us_row']:.1f} | {valid} |")
    table = "\n".join(rows)
    load = os.getloadavg()[0]
    summary = (f"{table}\n\n'vs unconstrained' is the ratio of decode tokens/s. The 50-set's outputs end when their "
               "JSON is complete, so fewer sequences run per step towards the end; the 'never complete' schema "
               "keeps every constrained sequence running all max_tokens, the same steps and batch as the free "
               "run: its ratio is the grammar's cost alone.\n\n"
               f"Compile time per schema (50 schemas): cold {cold_ms:.1f} ms, cached {cached_ms:.3f} ms. "
               f"Load average at the end: {load:.1f} (2 cores, shared).")
    print(summary)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pairs = [(s, c) for s in (False, True) for c in (False, True)]
        labels = [f"{'spec' if s else 'plain'}\n{'json' if c else 'free'}" for s, c in pairs]
        plt.figure(figsize=(6, 3.5))
        plt.bar(labels, [results[pair]["tok_s"] for pair in pairs])
        plt.ylabel("decode tokens/s")
        plt.title(f"namazu structured output, batch {args.batch}")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
    if args.write:
        command = "python bench/structured.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_section(BEGIN, END, f"## Structured output (CPU)\n\n`{command.strip()}` -- {args.batch} concurrent "
                                  f"requests, one JSON schema each, T={args.temperature}, max {args.max_tokens} "
                                  f"tokens, {args.threads} thread(s).\n\n{summary}")


def instances(args, argv) -> None:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from structured_instances import run as run_instances

    t0 = time.perf_counter()
    table, results = run_instances(args.instances, args.subsets.split(",") if args.subsets else None, args.limit,
                                   args.model)
    took = time.perf_counter() - t0
    if args.outcomes:
        with open(args.outcomes, "w", encoding="utf-8") as f:
            for tallies in results.values():
                for engine, tally in tallies.items():
                    for o in tally.outcomes:
                        f.write(json.dumps({"engine": engine, **o}, ensure_ascii=False) + "\n")
    summary = (f"{table}\n\nCoverage: the schema compiled and every one of its test instances came out right "
               "(valid ones accepted to the end token, invalid ones refused before it). Over-constrained: "
               "valid instances refused; under-constrained: invalid instances accepted. Each compiler as its "
               "library ships it: xgrammar's `compile_json_schema` defaults, llguidance's "
               "`grammar_from_json_schema` defaults; namazu's is the path a request takes (strict). "
               f"{took:.0f} s on {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}.")
    print(summary)
    if args.write:
        given = list(sys.argv[1:] if argv is None else argv)
        if "--outcomes" in given:            # a local file: not part of the command that makes the table
            del given[given.index("--outcomes"):given.index("--outcomes") + 2]
        command = "python bench/structured.py " + " ".join(given)
        write_section(INST_BEGIN, INST_END, f"## Structured output: JSONSchemaBench test instances\n\n"
                                            f"`{command.strip()}`\n\n{summary}")


if __name__ == "__main__":
    main()
