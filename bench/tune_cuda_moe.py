"""Device tuning of the CUDA NVFP4 decode kernels (GPU only; `make gpu-check` runs it in its tune stage).

    python bench/tune_cuda_moe.py [--tokens 1 8 32 64 1024 4096] [--budget 100] [--no-bf16] [--out FILE]

1. check: every compiled variant (cuda_decode.VARIANTS: split-K decode; PREFILL_VARIANTS: large-batch)
   against torch_moe_nvfp4 on the device; a variant over CHECK_TOL, non-finite, or failing to launch is
   recorded as failed and never chosen.
2. time: at Kimi-K2 expert shapes (384 experts, top-8, H 7168, I 2048), for each token count, the checked
   variants of that range (decode up to 64 tokens, large-batch above) and the default (the 16-row grouped
   GEMM of cuda_moe.py), replayed from a CUDA graph; weight bytes per call over the time as GB/s; the
   Triton BF16 kernel beside them as the ratio the issue asks for (not selectable here).
3. record: the selection table (the fastest per token bucket, `default` where the grouped GEMM wins; the
   last bucket covers every larger batch) as JSON for namazu/kernels/tables/<device>.json or
   NAMAZU_CUDA_MOE_TABLE (docs/kernels.md).
Stops timing new variants after --budget seconds and records what it measured; the check always runs.
On a compute capability 10.x (Blackwell) device: the sm_100a W4A4 kernel (kernels/cuda_sm100.py) instead,
checked the same way and recorded as the table's `w4a4` entry when it passed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from kernels import timeit_graph  # bench/kernels.py, beside this script
from tqdm import tqdm

from namazu.kernels import cuda_decode as cd
from namazu.kernels import moe_dispatch as md


def weight_bytes(ids: torch.Tensor, h: int, i: int) -> int:
    """NVFP4 bytes of the experts a call touches: 4.5 bits per weight (nibble + one E4M3 per 16)."""
    touched = int(torch.unique(ids).numel())
    return touched * (2 * i * h + h * i) * 9 // 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 64, 1024, 4096])
    p.add_argument("--no-bf16", action="store_true", help="skip the Triton BF16 reference rows")
    p.add_argument("--budget", type=float, default=100.0, help="seconds to spend timing")
    p.add_argument("--out", help="write the selection table (JSON) here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_cuda_moe: needs a CUDA device", file=sys.stderr)
        return 2
    tokens = sorted(set(args.tokens))
    device, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    if cap[0] == cd.SM100_MAJOR:
        return tune_blackwell(device, tuple(cap), tokens, args)
    if tuple(cap) != (9, 0):
        # The cubins are arch-specific sm_90a (and sm_100a) code: they do not load on other GPUs.
        print(f"tune_cuda_moe: {device} is sm_{cap[0]}{cap[1]}; these kernels are sm_90a / sm_100a only: no table")
        return 0
    decode, prefill = cd.CubinDecode(), cd.CubinPrefill()

    def kernels_of(v):
        return prefill if isinstance(v, cd.PrefillVariant) else decode

    checked: dict[str, bool] = {}
    for v in tqdm(cd.VARIANTS + cd.PREFILL_VARIANTS, desc="check variants", file=sys.stdout):
        try:
            err = cd.check_variant(kernels_of(v), v)
            torch.cuda.synchronize()
        except Exception as exc:   # a launch error is a failed check, recorded, not a crash of the tuner
            print(f"  {v.name}: failed to run ({str(exc).splitlines()[0][:100]})", flush=True)
            checked[v.name] = False
            continue
        checked[v.name] = err < cd.CHECK_TOL
        print(f"  {v.name}: rel err {err:.2e} {'ok' if checked[v.name] else 'FAILED'}", flush=True)

    from namazu.kernels.cuda_moe import cuda_moe_nvfp4
    e, h, i, k = 384, 7168, 2048, 8
    w = md.random_nvfp4_weights(e, h, i, device="cuda")
    dw = cd.DecodeWeights(cd.prepack(w.w13_packed, w.w13_scale), cd.prepack(w.w2_packed, w.w2_scale))
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = None
    if not args.no_bf16:
        try:
            from namazu.kernels import triton_moe
            bf16 = (triton_moe, torch.randn(e, 2 * i, h, generator=g, device="cuda", dtype=torch.bfloat16),
                    torch.randn(e, h, i, generator=g, device="cuda", dtype=torch.bfloat16))
        except (ImportError, torch.OutOfMemoryError) as exc:
            print(f"no BF16 reference rows ({exc})")
    t_end = time.monotonic() + args.budget
    measured: dict[str, dict[str, float]] = {}
    buckets = []
    print("| tokens | variant | us | GB/s | vs default |\n|---|---|---|---|---|", flush=True)
    for n in tokens:
        x = torch.randn(n, h, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(n, e, generator=g, device="cuda").topk(k, dim=1).indices
        tw = torch.rand(n, k, generator=g, device="cuda")
        nbytes = weight_bytes(ids, h, i)
        row = measured.setdefault(str(n), {})
        row[cd.DEFAULT] = timeit_graph(lambda a=(x, ids, tw): cuda_moe_nvfp4(*a, w)) * 1e6
        candidates = cd.VARIANTS if n <= cd.MAX_DECODE_TOKENS else cd.PREFILL_VARIANTS
        for v in candidates:
            if not checked[v.name] or (time.monotonic() > t_end and len(row) > 1):
                continue
            if isinstance(v, cd.PrefillVariant):
                row[v.name] = timeit_graph(lambda v=v, a=(x, ids, tw): prefill.moe(*a, w, v)) * 1e6
            else:
                row[v.name] = timeit_graph(lambda v=v, a=(x, ids, tw): decode.moe(*a, w, dw, v)) * 1e6
        best = min(row, key=row.get)
        buckets.append((n, best))
        bf16_us = float("nan")
        if bf16 is not None:
            bf16_us = timeit_graph(lambda a=(x, ids, tw), b=bf16: b[0].triton_moe_bf16(*a, b[1], b[2])) * 1e6
            measured.setdefault("bf16_triton", {})[str(n)] = bf16_us
        for name, us in sorted(row.items(), key=lambda kv: kv[1]):
            print(f"| {n} | {name} | {us:,.1f} | {nbytes / us / 1e3:,.0f} | {row[cd.DEFAULT] / us:.2f}x |", flush=True)
        print(f"| {n} | bf16 triton (reference) | {bf16_us:,.1f} | - | - |", flush=True)
        print(f"cuda decode {n} tokens: best {best} {row[best]:,.1f} us, default {row[cd.DEFAULT]:,.1f} us "
              f"({row[cd.DEFAULT] / row[best]:.2f}x), {nbytes / row[best] / 1e3:,.0f} GB/s, "
              f"{bf16_us / row[best]:.2f}x BF16", flush=True)
    if buckets:   # the largest measured batch's choice holds for every larger one
        buckets[-1] = (cd.NO_LIMIT, buckets[-1][1])
    table = cd.table_dict(device, cap, checked, buckets, measured)
    cd.SelectionTable(table)   # what the runtime will parse: fail here, not at serving time
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cuda_moe_table": table}, f, indent=1)
        print(f"selection table written to {args.out}")
    failed = [name for name, ok in checked.items() if not ok]
    print(f"variants checked: {len(checked) - len(failed)} of {len(checked)} passed"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def tune_blackwell(device: str, cap: tuple[int, int], tokens: list[int], args) -> int:
    """On a 10.x device: each sm_100a W4A4 variant (the two scale arrangements in tensor memory) checked
    against the W4A4 reference (quantizer byte-exact, layer within CHECK_TOL), the passing ones timed at
    Kimi-K2 shapes, the fastest recorded as the table's `w4a4` entry (the Hopper variants do not load here:
    no W4A16 buckets). Exactly one arrangement is what the MMA reads, so one failing is expected; none
    passing fails the stage."""
    from namazu.kernels import cuda_sm100 as bw

    checked: dict[str, bool] = {}
    kernels = None
    try:
        kernels = bw.CubinSm100()
    except Exception as exc:   # a load error fails every variant, recorded
        print(f"  sm_100a cubin: failed to load ({str(exc).splitlines()[0][:100]})", flush=True)
    for v in cd.SM100_VARIANTS:
        err = float("inf")
        if kernels is not None:
            try:
                err = bw.check_sm100(kernels, v)
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"  {v.name}: failed to run ({str(exc).splitlines()[0][:100]})", flush=True)
        checked[v.name] = err < cd.CHECK_TOL
        print(f"  {v.name}: rel err {err:.2e} {'ok' if checked[v.name] else 'FAILED'}", flush=True)
        if kernels is not None:   # per-GEMM errors, random and uniform scales: what a failure points at
            try:
                diag = {u: bw.gemm_errors(kernels, v, uniform=u) for u in (False, True)}
                print(f"    {v.name} per GEMM: " + ", ".join(f"{g} {e:.1e}{' (uniform scales)' if u else ''}"
                                                          for u, d in diag.items() for g, e in d.items()), flush=True)
            except Exception as exc:
                print(f"    {v.name} per GEMM: failed ({str(exc).splitlines()[0][:100]})", flush=True)
    passing = [v for v in cd.SM100_VARIANTS if checked[v.name]]
    measured: dict[str, dict[str, float]] = {}
    if passing:
        e, h, i, k = 384, 7168, 2048, 8
        g = torch.Generator(device="cuda").manual_seed(0)
        w = bw.w4a4_weights(md.random_nvfp4_weights(e, h, i, device="cuda"), g)
        t_end = time.monotonic() + args.budget
        print("| tokens | variant | us | GB/s |\n|---|---|---|---|", flush=True)
        for n in tokens:
            if time.monotonic() > t_end:
                break
            x = torch.randn(n, h, generator=g, device="cuda").to(torch.bfloat16)
            ids = torch.rand(n, e, generator=g, device="cuda").topk(k, dim=1).indices
            tw = torch.rand(n, k, generator=g, device="cuda")
            for v in passing:
                us = timeit_graph(lambda a=(x, ids, tw), v=v: kernels.moe(*a, w, v)) * 1e6
                measured.setdefault(str(n), {})[v.name] = us
                print(f"| {n} | {v.name} | {us:,.1f} | {weight_bytes(ids, h, i) / us / 1e3:,.0f} |", flush=True)
    best = min(passing, key=lambda v: sum(m.get(v.name, 0.0) for m in measured.values())) if passing else None
    table = cd.table_dict(device, cap, checked, [], measured, w4a4=best.name if best else cd.DEFAULT)
    cd.SelectionTable(table)   # what the runtime will parse: fail here, not at serving time
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cuda_moe_table": table}, f, indent=1)
        print(f"selection table written to {args.out}")
    print(f"sm_100a variants checked: {len(passing)} of {len(checked)} passed; w4a4 = "
          f"{best.name if best else 'the torch reference (none passed)'}")
    return 0 if passing else 1


if __name__ == "__main__":
    sys.exit(main())
