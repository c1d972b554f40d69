"""Per-rank resident memory under tensor parallelism: `python bench/tp_memory.py [--model DIR] [--tp 4]`.

Starts the engine at TP=1 and at the given TP (worker processes, fp32 weights on CPU unless --dtype)
and prints, per rank, the bytes of its weights, of its KV cache and its resident set size, plus what a
rank should hold: the replicated weights (norms, q_a / kv_a down-projections, router) whole and a 1/TP
share of the rest.
"""
from __future__ import annotations

import argparse

from namazu import LLM
from namazu.worker.rank import Worker


def _replicated_bytes(model) -> int:
    named = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in named
               if "norm" in n or "q_a_proj" in n or "kv_a_proj" in n or ".gate." in n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: namazu-tiny)")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-memory", default="64MiB")
    args = p.parse_args()
    mib = 2 ** 20
    with LLM(args.model, executor="inline", dtype=args.dtype, kv_cache_memory=args.kv_cache_memory) as llm:
        model = llm.engine.executor.worker.runner.model
        full = llm.engine.collective_rpc(Worker.resident_memory)[0]["weight_bytes"]
        replicated = _replicated_bytes(model)
    expected = replicated + (full - replicated) / args.tp
    print(f"weights at TP=1: {full / mib:.2f} MiB ({replicated / mib:.2f} MiB replicated under TP)")
    print(f"expected per rank at TP={args.tp}: {expected / mib:.2f} MiB")
    for tp in (1, args.tp):
        with LLM(args.model, tensor_parallel_size=tp, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory) as llm:
            for r in llm.engine.collective_rpc(Worker.resident_memory):
                print(f"TP={tp} rank {r['rank']}: weights {r['weight_bytes'] / mib:.2f} MiB, "
                      f"KV cache {r['kv_cache_bytes'] / mib:.2f} MiB, RSS {r['rss_bytes'] / mib:.1f} MiB")


if __name__ == "__main__":
    main()
