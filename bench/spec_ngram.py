"""Speculative decoding with the n-gram (prompt lookup) drafter vs plain decoding, on chat requests.

    python bench/spec_ngram.py [--model DIR] [--k 2 4] [--max-tokens 96] [--write]

Tool-call chats (a tool schema in the prompt, answers that quote it) are where prompt lookup can pay:
the answer repeats names and JSON from the prompt. Reports engine steps, draft acceptance rate, tokens
per sequence step (the mean acceptance length: accepted drafts + 1) and wall-clock tokens/s, and checks
that greedy outputs are identical with and without drafts (the verify step is lossless).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`
from throughput import RESULTS  # bench/ is on sys.path when run as `python bench/spec_ngram.py`

BEGIN, END = "<!-- spec-ngram:begin -->", "<!-- spec-ngram:end -->"

CITIES = ["東京", "大阪", "札幌", "福岡", "名古屋", "仙台", "広島", "那覇", "京都", "神戸", "横浜", "金沢"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "指定した都市の現在の天気を取得する",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]


def run(model: str | None, k: int, max_tokens: int):
    from namazu import LLM, SamplingParams

    convs = [[{"role": "user", "content": f"{c}の天気を摂氏で調べてください"}] for c in CITIES]
    args = dict(speculative_method="ngram", num_speculative_tokens=k) if k else dict(num_speculative_tokens=0)
    with LLM(model, dtype="float32", **args) as llm:
        llm.generate(prompt_token_ids=[[100, 101, 102]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        before = llm.engine.get_stats()
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=max_tokens), tools=TOOLS, use_tqdm=False)
        dt = time.perf_counter() - t0
        st = llm.engine.get_stats()
    steps = st.num_steps - before.num_steps
    gen = st.num_generated_tokens - before.num_generated_tokens
    drafted = st.num_draft_tokens - before.num_draft_tokens
    accepted = st.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    return [o.outputs[0].token_ids for o in outs], steps, gen, drafted, accepted, dt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded namazu-tiny)")
    p.add_argument("--k", type=int, nargs="+", default=[2, 4], help="draft tokens per verify step")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--write", action="store_true")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    rows = ["| drafts k | engine steps | generated tokens | drafts accepted | tokens per sequence step | tok/s "
            "| outputs identical |",
            "|---:|---:|---:|---:|---:|---:|---|"]
    base = None
    for k in [0, *args.k]:
        outs, steps, gen, drafted, accepted, dt = run(args.model, k, args.max_tokens)
        base = base or outs
        rate = f"{accepted / drafted:.0%} of {drafted}" if drafted else "-"
        # Each sequence step emits its accepted drafts plus one token.
        rows.append(f"| {k or 'none'} | {steps} | {gen} | {rate} | {gen / (gen - accepted):.2f} | {gen / dt:,.1f} "
                    f"| {'yes' if outs == base else 'NO'} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.write:
        command = "python bench/spec_ngram.py " + " ".join(sys.argv[1:])
        section = (f"## Speculative decoding: n-gram drafter (CPU)\n\n`{command.strip()}` -- "
                   f"{len(CITIES)} tool-call chats, greedy, max {args.max_tokens} tokens, {args.threads} "
                   f"thread(s).\n\n{table}")
        write_section(BEGIN, END, section)
        print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
