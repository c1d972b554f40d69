"""bf16 products of a few rows on the CPU, side by side: torch's own (oneDNN), `namazu::small_bmm_bf16` (the
dot-product block) and `namazu::packed_linear_bf16` (the lm_head's packed weight), at namazu-tiny's lm_head
(12288 x 256) and the drafter's draft-vocabulary head (2048 x 256), for the row counts of decode and verify
steps. Each setup is timed in turn within every round (medians over rounds), hot cache, and once more
after streaming 64 MiB through the cache (what a step's other layers leave of it).

    python bench/small_gemm.py [--rows 1 2 4 7 8] [--threads 1] [--rounds 5] [--plot FILE]

Prints a table (microseconds per call, and each kernel's speed-up over the dot-product block)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from namazu.kernels import small_gemm  # noqa: E402

SHAPES = {"lm_head": (12288, 256), "draft head": (2048, 256)}


def _time(fn, reps: int, flush: torch.Tensor | None) -> float:
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush.add_(1.0)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _setups(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, n: int) -> dict:
    return {"oneDNN": lambda: torch.nn.functional.linear(x, w),
            "dot-product block": lambda: torch.ops.namazu.small_bmm_bf16(x.unsqueeze(0), w.unsqueeze(0)),
            "packed": lambda: torch.ops.namazu.packed_linear_bf16(x, packed, n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 7, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50, help="calls per setup and round")
    ap.add_argument("--plot", default=None, help="write a plot of the lm_head's times (png)")
    args = ap.parse_args(argv)
    if not small_gemm.ENABLED:
        raise SystemExit("this CPU has no AVX512_BF16 (or the extension is not built): nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    flush = torch.ones(16 * 1024 * 1024)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = small_gemm.pack(w)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            setups = _setups(x, w, packed, n)
            for fn in setups.values():
                fn()
            times = {(s, c): [] for s in setups for c in ("hot", "cold")}
            for _ in range(args.rounds):
                for s, fn in setups.items():
                    times[(s, "hot")].append(_time(fn, args.reps, None))
                    times[(s, "cold")].append(_time(fn, max(5, args.reps // 5), flush))
            med = {key: statistics.median(v) for key, v in times.items()}
            rows_out.append((name, m, med))
    print(f"one product, {args.threads} thread(s), medians of {args.rounds} rounds; cold: after 64 MiB through "
          "the cache\n")
    print("| product | rows | oneDNN us hot / cold | dot-product block us hot / cold | packed us hot / cold "
          "| packed vs block hot / cold |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m, med in rows_out:
        cells = [f"{med[(s, 'hot')]:.1f} / {med[(s, 'cold')]:.1f}" for s in ("oneDNN", "dot-product block", "packed")]
        ratio = (f"{med[('dot-product block', 'hot')] / med[('packed', 'hot')]:.2f}x / "
                 f"{med[('dot-product block', 'cold')] / med[('packed', 'cold')]:.2f}x")
        print(f"| {name} | {m} | " + " | ".join(cells) + f" | {ratio} |")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in ("oneDNN", "dot-product block", "packed"):
            pts = [(m, med[(s, "hot")]) for name, m, med in rows_out if name == "lm_head"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xlabel("rows")
        ax.set_ylabel("us per call (hot)")
        ax.set_title("lm_head 12288 x 256, bf16, CPU")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
