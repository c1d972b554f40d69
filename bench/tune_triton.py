"""Offline tile search for the fused Triton MoE kernels (GPU only; never at run time).

    python bench/tune_triton.py [--buckets decode mid prefill] [--budget 120] [--out FILE]

For each format (BF16, NVFP4) and rows-per-expert bucket of triton_moe.TILE_CONFIGS, times candidate
tile configurations on the Kimi-K2 expert shape and prints the best next to the committed one, as the
line to paste into TILE_CONFIGS. Stops trying new candidates after --budget seconds (so `make gpu-check`
can give it whatever time is left) and always reports what it measured.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
from kernels import timeit_graph  # bench/kernels.py, beside this script

from namazu.kernels import moe_dispatch as md
from namazu.kernels import triton_moe as tm

# Representative token counts for the buckets on Kimi-K2 (384 experts, top-8): rows per expert 1.3, 10.7, 85.
BUCKETS = {"decode": (0, 64), "mid": (1, 512), "prefill": (2, 4096)}


def candidates(fmt: str, block_m: int) -> list[tm.TileConfig]:
    ks = (128, 256) if fmt == "nvfp4" else (64, 128)
    return [tm.TileConfig(block_m, bn, bk, nw, ns)
            for bn, bk, nw, ns in itertools.product((64, 128), ks, (4, 8), (3, 4))]


def bench(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (as decode runs; no launch overhead)."""
    return timeit_graph(fn) * 1e6


def run_config(fmt: str, cfg: tm.TileConfig, inputs: tuple, weights: tuple) -> torch.Tensor:
    (x, ids, tw), (w13, w2, fp4) = inputs, weights
    if fmt == "nvfp4":
        return tm.triton_moe_nvfp4(x, ids, tw, fp4, config=cfg)
    return tm.triton_moe_bf16(x, ids, tw, w13, w2, config=cfg)


def tune_one(fmt: str, bucket: str, index: int, inputs: tuple, weights: tuple, t_end: float) -> dict:
    """Times the committed config, then candidates until the budget ends; returns the measurements."""
    n = inputs[0].shape[0]
    committed = tm.TILE_CONFIGS[fmt][index][1]
    rows = []
    for cfg in [committed] + [c for c in candidates(fmt, committed.block_m) if c != committed]:
        if time.monotonic() > t_end and rows:
            break
        try:
            us = bench(lambda cfg=cfg: run_config(fmt, cfg, inputs, weights))
        except Exception as exc:  # a config that does not fit (shared memory, registers) is skipped
            print(f"  {fmt} {bucket} {cfg}: failed ({str(exc).splitlines()[0][:80]})", flush=True)
            continue
        rows.append((us, cfg))
        print(f"  {fmt} {bucket} n={n} {cfg}: {us:,.1f} us", flush=True)
    if not rows:
        return {"format": fmt, "bucket": bucket, "tokens": n, "error": "no configuration ran"}
    rows.sort(key=lambda r: r[0])
    best_us, best = rows[0]
    base_us = next((us for us, c in rows if c == committed), float("nan"))
    print(f"{fmt} {bucket}: best {best} {best_us:,.1f} us; committed {base_us:,.1f} us "
          f"({base_us / best_us:.2f}x)", flush=True)
    return {"format": fmt, "bucket": bucket, "tokens": n, "best": best.__dict__, "best_us": best_us,
            "committed": committed.__dict__, "committed_us": base_us,
            "measured": [{"config": c.__dict__, "us": us} for us, c in rows]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", nargs="+", default=list(BUCKETS), choices=list(BUCKETS))
    p.add_argument("--budget", type=float, default=300.0, help="seconds to spend on new candidates")
    p.add_argument("--out", help="write the measurements as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_triton: needs a CUDA device", file=sys.stderr)
        return 2
    t_end = time.monotonic() + args.budget
    e, h, i, k = 384, 7168, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=g, device="cuda", dtype=torch.bfloat16).mul_(h ** -0.5)
    w2 = torch.randn(e, h, i, generator=g, device="cuda", dtype=torch.bfloat16).mul_(i ** -0.5)
    fp4 = md.random_nvfp4_weights(e, h, i, device="cuda")
    results = []
    for bucket in args.buckets:
        index, n = BUCKETS[bucket]
        x = torch.randn(n, h, generator=g, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(n, e, generator=g, device="cuda").topk(k, dim=1).indices
        tw = torch.rand(n, k, generator=g, device="cuda")
        for fmt in ("nvfp4", "bf16"):
            results.append(tune_one(fmt, bucket, index, (x, ids, tw), (w13, w2, fp4), t_end))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
