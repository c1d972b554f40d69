"""What a seed costs a request with a sampling drafter: acceptance of seeded rows (exact match against the
target's seeded samples) beside unseeded ones (the ratio rule with the drafter's q), in one run.

    python bench/seeded_acceptance.py [--prompts 8] [--max-tokens 48] [--temperature 0.8] [--k 6]

The default model with its shipped drafter (drafts drawn from q at T > 0), drafting at every batch size.
Each prompt is run twice, once per kind, in two engines (one all seeded, one all unseeded: the engine's
counters are per engine); the table gives each kind's mean acceptance length (drafts accepted + 1 per
verify step) and accepted drafts per drafted token, and the ratio. Acceptance does not depend on the
machine's load; the wall time printed beside it does.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["Tell me a story about a fox and a crow.", "Hello, who are you?", "Write a JSON object with a name.",
           "東京について教えて", "Explain what a prefix cache is.", "List three colours and a number.",
           "Write a haiku about the sea.", "What is the capital of France, and why?",
           "Describe a cat in two sentences.", "Give me a recipe for pancakes."]


def run(prompts: list[str], seeded: bool, args: argparse.Namespace) -> tuple[float, float, float]:
    from namazu import LLM, SamplingParams

    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                             seed=1000 + i if seeded else None) for i in range(len(prompts))]
    with LLM(executor="inline", num_speculative_tokens=args.k, speculative_disable_batch_size=0,
             speculative_min_confidence=0, max_num_seqs=16) as llm:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        stats = llm.engine.get_stats()
    per_draft = stats.num_accepted_draft_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
    return stats.mean_acceptance_length, per_draft, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=6, help="draft tokens per step")
    args = ap.parse_args(argv)
    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    rows = {kind: run(prompts, kind == "seeded", args) for kind in tqdm(("unseeded", "seeded"), unit="run")}
    print(f"{len(prompts)} prompts, T={args.temperature:g}, k={args.k}, {args.max_tokens} tokens each, "
          "shipped drafter (drafts from q), full blocks")
    print("| rows | rule | mean acceptance length | accepted per drafted token | wall s |")
    print("|---|---|---:|---:|---:|")
    for kind, rule in (("unseeded", "min(1, p/q)"), ("seeded", "exact match")):
        tau, per, wall = rows[kind]
        print(f"| {kind} | {rule} | {tau:.2f} | {per:.3f} | {wall:.1f} |")
    print(f"seeded / unseeded acceptance length: {rows['seeded'][0] / rows['unseeded'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
