"""Resident memory of NVFP4 routed experts, measured in the running process (RSS), and the proof that a
forward pass never materializes a BF16 copy of all experts.

    python bench/nvfp4_memory.py [--experts 64 --hidden 2048 --inter 768 --tokens 256 --topk 8]

Allocates one MoE layer of NVFP4 experts (random codes; values do not matter for memory), reads the
process RSS before and after, runs W4A16 forwards (the serving path) and W4A4 forwards (the emulation)
and reads the peak RSS. Prints bits per expert weight from RSS and from the tensors' storage.
"""
from __future__ import annotations

import argparse
import gc
import sys
import threading

import torch

from namazu.kernels.backends import resolve_moe_runtime
from namazu.quant.nvfp4_experts import NvFP4Experts

PAGE = 4096


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples the RSS every millisecond on a thread while the block runs; `.peak` is the highest seen."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    args = ap.parse_args(argv)
    e, h, i = args.experts, args.hidden, args.inter
    torch.manual_seed(0)
    x = torch.randn(args.tokens, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[: args.topk] for _ in range(args.tokens)])
    w = torch.rand(args.tokens, args.topk)
    gc.collect()
    r0 = rss()
    q = NvFP4Experts(e, h, i, mode="w4a16", runtime=resolve_moe_runtime("cpu"))   # the serving backend
    with torch.no_grad():
        for name in ("w13_packed", "w2_packed"):
            getattr(q, name).random_(0, 256)
        for name in ("w13_scale", "w2_scale"):
            buf = getattr(q, name)
            for k in range(e):  # per expert, so no large temporary inflates the RSS reading
                buf[k].copy_((torch.rand(buf.shape[1:]) * 4 + 0.5).to(torch.float8_e4m3fn))
        q.w13_gs.fill_(1e-3)
        q.w2_gs.fill_(1e-3)
        q.a13_scale.fill_(1e-3)
        q.a2_scale.fill_(1e-3)
    r1 = rss()
    n = q.num_weights()
    bf16_bytes = 2 * n
    rows = [("NVFP4 experts allocated (RSS delta)", r1 - r0, 8 * (r1 - r0) / n),
            ("NVFP4 experts (tensor storage)", q.resident_bytes(), 8 * q.resident_bytes() / n),
            ("BF16 experts would be", bf16_bytes, 16.0)]
    for mode in ("w4a16", "w4a4"):
        q.nvfp4_mode = mode
        gc.collect()
        before = rss()
        with PeakRSS() as p, torch.no_grad():
            for _ in range(2):
                q(x, ids, w)
        rows.append((f"{mode} forward: peak RSS above the resident state (sampled every 1 ms)",
                     p.peak - before, None))
    print(f"layer: {e} experts, hidden {h}, moe_intermediate {i}: {n / 1e6:.1f}M expert weights; "
          f"{args.tokens} tokens, top-{args.topk}")
    print("| measurement | bytes | MiB | bits / weight |")
    print("|---|---:|---:|---:|")
    for label, b, bits in rows:
        print(f"| {label} | {b} | {b / 2**20:.1f} | {'' if bits is None else f'{bits:.3f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
