"""Async vs synchronous scheduling, side by side: should `--async-scheduling` be the default?

    python bench/async_sched.py [--batch 1 32] [--threads 1 2] [--rounds 3] [--output-len 48]

For each thread count, two engines (worker processes, `--executor mp`) are started, one per scheduling
mode, and greedy generation (EOS ignored) of the same prompts alternates between them `--rounds` times
per batch size, so both see the same machine load; the table gives median tokens/s and async / sync.
Async overlaps the engine's planning and output processing (the gap between steps) with the worker's
forward; that needs a core the worker's threads leave free, so the ratio is shown per thread count.
The load average is printed before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import pick_model  # noqa: E402


def main() -> None:
    from namazu import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    args = p.parse_args()
    model, desc = pick_model(args.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(20, 256, args.prompt_len).tolist() for _ in range(max(args.batch))]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    load0 = os.getloadavg()[0]
    rows = []
    for threads in args.threads:
        engines = {mode: LLM(model, dtype="float32", threads=threads, max_num_seqs=max(args.batch),
                             async_scheduling=mode == "async", kv_cache_memory="512MiB")
                   for mode in ("sync", "async")}
        try:
            for llm in engines.values():
                llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2),
                             use_tqdm=False)
            for b in args.batch:
                rate: dict[str, list[float]] = {"sync": [], "async": []}
                outs = {}
                for _ in range(args.rounds):
                    for mode, llm in engines.items():
                        t = time.perf_counter()
                        res = llm.generate(prompt_token_ids=prompts[:b], sampling_params=params, use_tqdm=False)
                        rate[mode].append(b * args.output_len / (time.perf_counter() - t))
                        outs[mode] = [o.outputs[0].token_ids for o in res]
                s, a = statistics.median(rate["sync"]), statistics.median(rate["async"])
                same = outs["sync"] == outs["async"]
                rows.append(f"| {threads} | {b} | {s:,.1f} | {a:,.1f} | {a / s:.2f} | {same} |")
                print(rows[-1], flush=True)
        finally:
            for llm in engines.values():
                llm.close()
    print(f"\nmodel: {desc}; float32; mp executor; {args.rounds} alternated rounds; load average before "
          f"{load0:.2f}, after {os.getloadavg()[0]:.2f} (1 min)\n")
    print("| threads | batch | sync tok/s | async tok/s | async / sync | same tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
