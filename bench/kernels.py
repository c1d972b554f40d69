"""MoE layer microbenchmark: every routed-experts backend, BF16 and NVFP4 side by side, against a roofline
measured in the same run.

    python bench/kernels.py [--device cpu|cuda] [--shapes tiny k2] [--tokens 1 16 ...] [--write]
                            [--jsonl FILE] [--plot FILE]          (make bench-kernels)

One row per (shape, tokens, format, backend): time of the whole layer (sort, gate_up, SiLU-and-mul,
down, weighted sum; on GPU the kernel backends are replayed from a CUDA graph, as the engine's decode
steps run, and the host-synced baselines are timed eagerly; on CPU the median of eager calls, or with
`--clock cpu` the least thread CPU time, for one thread on a shared machine where other processes take
time slices), achieved bytes/s and FLOP/s, and two percentages measured against this run's own
roofline: `% copy` = (bytes / copy bandwidth) / time, how close a row is to streaming its weights once,
and `% roofline` = max(bytes / copy bandwidth, FLOPs / matmul rate) / time. The matmul rate is the
faster of a bf16 and an fp32 matmul (a CPU without AVX512_BF16 runs bf16 matmuls at a small fraction
of its fp32 rate, which would make every compute floor meaningless).

CPU NVFP4 rows: `cpp` is what the cpp backend serves for W4A16 (the decode layout, prepacked before
timing, as at start-up), `cpp-modelopt` the previous kernel on ModelOpt's layout, timed in the same
run for the A/B.
Bytes count the weights of the experts the batch actually touches (plus activations in and out);
FLOPs are 2 * tokens * top_k * 3 * hidden * inter. `rel err` is each output against the torch reference
of its format on the same inputs (a broken kernel shows here, not only in the tests).

Shapes: `k2` is Kimi-K2's expert shape (hidden 7168, inter 2048, 384 experts, top-8); on CPU the expert
count is scaled down to 16 (same matrices, less memory) and fewer token counts run. `tiny` is namazu-tiny
(read from its config). Backends that cannot run here (no GPU, extension not built) are listed, not timed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

from namazu.kernels import backends
from namazu.kernels import moe_dispatch as md

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


def tiny_shape() -> Shape:
    """namazu-tiny's MoE shape: the shipped checkpoint's config if present, else its training config."""
    for path, key in ((REPO / "namazu/assets/namazu-tiny/config.json", None),
                      (REPO / "namazu/tiny/configs/namazu-tiny.json", "model")):
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg = cfg[key] if key else cfg
            return Shape("namazu-tiny", cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
                         cfg["num_experts_per_tok"])
    return Shape("namazu-tiny", 256, 128, 12, 2)


def shapes_for(names: list[str], device: str) -> list[Shape]:
    out = []
    for name in names:
        if name == "tiny":
            out.append(tiny_shape())
        elif name == "k2":
            experts = 384 if device == "cuda" else 16
            out.append(Shape("kimi-k2" if experts == 384 else f"kimi-k2 (E={experts})", 7168, 2048, experts, 8))
        else:
            raise SystemExit(f"unknown shape '{name}': choose from tiny, k2")
    return out


DEFAULT_TOKENS = {
    ("cuda", "kimi-k2"): [1, 4, 16, 64, 256, 1024, 4096],
    ("cuda", "namazu-tiny"): [1, 16, 256, 4096],
    ("cpu", "kimi-k2"): [1, 4, 16],
    ("cpu", "namazu-tiny"): [1, 16, 256],
}


# ---- timing and the roofline ------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


CLOCK = {"wall": True}   # set by main: False = thread CPU time (--clock cpu)


def timeit(fn: Callable[[], object], device: str, min_time: float = 0.2, max_reps: int = 50) -> float:
    """Median wall seconds per call after a warm-up call (which also compiles Triton kernels); with
    `--clock cpu`, the least thread CPU time of at least 5 calls (the calling thread does all the work
    when torch runs one thread)."""
    fn()
    sync(device)
    times: list[float] = []
    clock = time.perf_counter if CLOCK["wall"] else time.thread_time
    least = 3 if CLOCK["wall"] else 5
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < least or time.perf_counter() - start < min_time):
        t0 = clock()
        fn()
        sync(device)
        times.append(clock() - t0)
    return statistics.median(times) if CLOCK["wall"] else min(times)


def timeit_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph: the GPU time of the layer as the engine runs it
    (decode steps are graph-captured), without the per-launch host overhead that would otherwise hide
    microsecond kernels. Only for code with no host sync (the kernel backends)."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


@dataclass
class Roofline:
    copy_bytes_per_s: float
    matmul_flops: float


def measure_roofline(device: str) -> Roofline:
    n_bytes = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device)
    copy_bw = 2 * n_bytes / t  # read + write
    n = 8192 if device == "cuda" else 1024
    best = 0.0
    for dtype in (torch.bfloat16,) if device == "cuda" else (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        best = max(best, 2 * n ** 3 / timeit(lambda: a @ b, device))  # noqa: B023
    return Roofline(copy_bw, best)


# ---- baselines and candidates ----------------------------------------------------------------------

def loop_moe(x, topk_ids, topk_weights, w13, w2):
    """Baseline: one dense matmul pair per touched expert, in the weights' dtype (host-synced loop)."""
    d = md.dispatch(topk_ids, w13.shape[0])
    xs = md.permute(x, d)
    h = md.silu_and_mul(md.grouped_gemm(xs, lambda e: w13[e], d.counts))
    ys = md.grouped_gemm(h, lambda e: w2[e], d.counts)
    return md.unpermute(ys, d, topk_weights, x.shape[0]).to(x.dtype) if ys.numel() else torch.zeros_like(x)


def grouped_mm_moe(x, topk_ids, topk_weights, w13_t, w2_t):
    """Baseline: torch's grouped matmul (w13_t [E, H, 2I], w2_t [E, I, H] column-major views)."""
    d = md.dispatch(topk_ids, w13_t.shape[0])
    offs = d.offsets[1:].to(torch.int32)
    h = md.silu_and_mul(F.grouped_mm(md.permute(x, d), w13_t, offs=offs))
    ys = F.grouped_mm(h, w2_t, offs=offs)
    return md.unpermute(ys, d, topk_weights, x.shape[0]).to(x.dtype)


@dataclass
class Candidate:
    fmt: str       # bf16 | nvfp4
    backend: str
    fn: Callable | None
    why_not: str = ""
    sync_free: bool = False  # no host sync: timed from a CUDA graph on GPU


def candidates(device: str) -> list[Candidate]:
    out = [Candidate("bf16", "loop", loop_moe)]
    if hasattr(F, "grouped_mm"):
        out.append(Candidate("bf16", "grouped_mm", grouped_mm_moe))
    else:
        out.append(Candidate("bf16", "grouped_mm", None, "torch has no grouped_mm"))
    for name in ("triton", "cuda", "cpp", "torch"):
        if name in ("triton", "cuda") and device == "cpu":
            continue
        if name == "cpp" and device == "cuda":
            continue
        ok, why = backends.availability(name, device)
        b = backends.build_backend(name, device) if ok else None
        kernel = name in ("triton", "cuda")
        if name == "triton":
            out.append(Candidate("bf16", "triton", b.bf16 if b else None, why, sync_free=True))
        out.append(Candidate("nvfp4", name if name != "torch" else "torch-ref", b.nvfp4 if b else None, why,
                             sync_free=kernel))
        if name == "cpp":
            out.append(Candidate("nvfp4", "cpp-modelopt", backends._cpp_nvfp4 if b else None, why))
        if name == "cuda":
            # `cuda` runs what the device's selection table picks (the note says which); this row is the
            # default it falls back to, the 16-row grouped GEMM, for the A/B.
            from namazu.kernels.cuda_moe import cuda_moe_nvfp4
            out.append(Candidate("nvfp4", "cuda-gemm16", cuda_moe_nvfp4 if b else None, why, sync_free=True))
    return out


# ---- one shape ---------------------------------------------------------------------------------------

@dataclass
class Row:
    shape: str
    tokens: int
    fmt: str
    backend: str
    time_us: float | None
    gbytes_per_s: float | None
    gflops: float | None
    pct_roofline: float | None
    rel_err: float | None
    note: str = ""
    pct_copy: float | None = None


def run_shape(shape: Shape, tokens_list: list[int], device: str, roof: Roofline, seed: int,
              emit: Callable[[Row], None], skip: tuple[str, ...] = ()) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i, k = shape.experts, shape.hidden, shape.inter, shape.top_k
    print(f"[{shape.name}] allocating BF16 and NVFP4 experts ({e} x 3 x {h} x {i})", file=sys.stderr, flush=True)
    # Drawn in bf16 and scaled in place: no fp32 copy of 34 GB of Kimi-K2 experts on the GPU.
    w13 = torch.randn(e, 2 * i, h, generator=g, device=device, dtype=torch.bfloat16).mul_(h ** -0.5)
    w2 = torch.randn(e, h, i, generator=g, device=device, dtype=torch.bfloat16).mul_(i ** -0.5)
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    fp4 = md.random_nvfp4_weights(e, h, i, device=device, seed=seed)
    bytes_per_expert = {"bf16": 3 * h * i * 2, "nvfp4": fp4.packed_bytes_per_expert()}
    cands = [c for c in candidates(device) if c.backend not in skip]
    for c in cands:
        if c.backend == "cpp" and c.fn is not None:
            c.fn.__self__.prepare_nvfp4(fp4)   # the decode layout, built once as at start-up, not timed
    rows = []
    for n in tokens_list:
        x = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
        ids = torch.rand(n, e, generator=g, device=device).topk(k, dim=1).indices
        tw = torch.rand(n, k, generator=g, device=device)
        touched = int(torch.unique(ids).numel())
        flops = 2 * n * k * 3 * h * i
        refs = {"bf16": md.torch_moe_bf16(x, ids, tw, w13, w2), "nvfp4": md.torch_moe_nvfp4(x, ids, tw, fp4)}
        for c in cands:
            if c.fn is None:
                row = Row(shape.name, n, c.fmt, c.backend, None, None, None, None, None, c.why_not)
            else:
                if c.fmt == "bf16":
                    args = (x, ids, tw, w13_t, w2_t) if c.backend == "grouped_mm" else (x, ids, tw, w13, w2)
                else:
                    args = (x, ids, tw, fp4)
                try:
                    out = c.fn(*args)
                    err = md_rel_err(out, refs[c.fmt])
                    t, note = None, ""
                    if device == "cuda" and c.sync_free:
                        try:
                            t = timeit_graph(lambda: c.fn(*args))  # noqa: B023
                        except RuntimeError as exc:  # not capturable after all: time it eagerly, say so
                            torch.cuda.synchronize()
                            note = f"eager (graph capture failed: {str(exc).splitlines()[0][:60]})"
                    if t is None:
                        t = timeit(lambda: c.fn(*args), device)  # noqa: B023
                    if c.backend == "cuda":
                        from namazu.kernels.cuda_decode import select_decode
                        v = select_decode(x, fp4)
                        note = ((note + "; ") if note else "") + f"table: {v.name if v else 'default'}"
                except (RuntimeError, ValueError, NotImplementedError) as exc:
                    row = Row(shape.name, n, c.fmt, c.backend, None, None, None, None, None,
                              f"failed: {str(exc).splitlines()[0][:120]}")
                else:
                    n_bytes = touched * bytes_per_expert[c.fmt] + 2 * n * h * 2
                    floor = max(n_bytes / roof.copy_bytes_per_s, flops / roof.matmul_flops)
                    row = Row(shape.name, n, c.fmt, c.backend, t * 1e6, n_bytes / t / 1e9, flops / t / 1e9,
                              100 * floor / t, err, note, 100 * n_bytes / roof.copy_bytes_per_s / t)
            rows.append(row)
            emit(row)
        del refs
    return rows


def md_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


# ---- report ------------------------------------------------------------------------------------------

def fmt_num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[Row]) -> str:
    best_bf16: dict[tuple[str, int], float] = {}
    for r in rows:
        if r.fmt == "bf16" and r.time_us is not None:
            key = (r.shape, r.tokens)
            best_bf16[key] = min(best_bf16.get(key, float("inf")), r.time_us)
    lines = ["| shape | tokens | format | backend | time (us) | GB/s | GFLOP/s | % copy | % roofline | rel err "
             "| vs best BF16 |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.time_us is None:
            lines.append(f"| {r.shape} | {r.tokens} | {r.fmt} | {r.backend} | - | - | - | - | - | - | {r.note} |")
            continue
        speed = best_bf16.get((r.shape, r.tokens))
        ratio = (f"{speed / r.time_us:.2f}x" if speed else "-") + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.shape} | {r.tokens} | {r.fmt} | {r.backend} | {r.time_us:,.0f} | "
                     f"{fmt_num(r.gbytes_per_s, '.1f')} | {fmt_num(r.gflops, ',.0f')} | "
                     f"{fmt_num(r.pct_copy, '.1f')} | {fmt_num(r.pct_roofline, '.1f')} | "
                     f"{fmt_num(r.rel_err, '.1e')} | {ratio} |")
    return "\n".join(lines)


def summary(rows: list[Row], device: str) -> list[str]:
    """The acceptance ratios: C++ vs the torch reference on CPU; NVFP4 vs the best BF16 on GPU."""
    by = {(r.shape, r.tokens, r.fmt, r.backend): r for r in rows if r.time_us is not None}
    out = []
    for (shape, n, fmt, backend), r in sorted(by.items()):
        if device == "cpu" and fmt == "nvfp4" and backend == "cpp":
            bf16 = [v.time_us for (s, t, f, _), v in by.items() if s == shape and t == n and f == "bf16"]
            old = by.get((shape, n, "nvfp4", "cpp-modelopt"))
            ref = by.get((shape, n, "nvfp4", "torch-ref"))
            out.append(f"{shape}, {n} tokens: cpp NVFP4 (decode layout) {r.pct_copy:.0f}% of the copy roofline"
                       + (f", {min(bf16) / r.time_us:.2f}x the best BF16" if bf16 else "")
                       + (f", {old.time_us / r.time_us:.2f}x the ModelOpt-layout kernel" if old else "")
                       + (f", {ref.time_us / r.time_us:.1f}x the torch reference" if ref else ""))
        if device == "cuda" and fmt == "nvfp4" and backend in ("triton", "cuda"):
            bf16 = [v.time_us for (s, t, f, _), v in by.items() if s == shape and t == n and f == "bf16"]
            if bf16:
                out.append(f"{shape}, {n} tokens: {backend} NVFP4 {min(bf16) / r.time_us:.2f}x the best BF16, "
                           f"{r.pct_roofline:.0f}% of roofline")
    return out


def write_results(text: str, device: str) -> None:
    begin, end = f"<!-- kernels-{device}:begin -->", f"<!-- kernels-{device}:end -->"
    write_section(begin, end, text)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r.shape == shape and r.time_us is not None:
                series.setdefault(f"{r.fmt}/{r.backend}", []).append((r.tokens, r.time_us))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linestyle="-" if label.startswith("nvfp4") else "--")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="time per MoE layer (us)", title=shape)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=["tiny", "k2"])
    p.add_argument("--tokens", nargs="+", type=int, help="token counts (default: per shape and device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="+", default=[], metavar="BACKEND",
                   help="backends not to time, e.g. torch-ref (seconds per call at Kimi-K2 shapes on CPU)")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's, i.e. OMP_NUM_THREADS)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: least thread CPU time per call (CPU, one thread: a shared machine's time slices "
                        "given to other processes do not count)")
    p.add_argument("--write", action="store_true", help="update this device's section of bench/RESULTS.md")
    p.add_argument("--jsonl", help="append every row to this file as it is measured (partial results)")
    p.add_argument("--plot", help="write a time-vs-tokens plot (png)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.device != "cpu" or torch.get_num_threads() != 1:
            raise SystemExit("--clock cpu times one CPU thread: use it with --device cpu --threads 1")
        CLOCK["wall"] = False

    roof = measure_roofline(args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    head = (f"{where}; roofline measured in this run: copy {roof.copy_bytes_per_s / 1e9:.1f} GB/s, "
            f"matmul {roof.matmul_flops / 1e9:,.0f} GFLOP/s; {args.clock} clock")
    print(head, flush=True)
    jsonl = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115

    def emit(row: Row) -> None:
        print(f"  {row.shape} n={row.tokens} {row.fmt}/{row.backend}: "
              + (f"{row.time_us:,.0f} us, {row.pct_copy:.1f}% copy, {row.pct_roofline:.1f}% roofline, "
                 f"err {row.rel_err:.1e}"
                 if row.time_us is not None else row.note), flush=True)
        if jsonl:
            jsonl.write(json.dumps(asdict(row)) + "\n")
            jsonl.flush()

    rows: list[Row] = []
    for shape in shapes_for(args.shapes, args.device):
        tokens = args.tokens or DEFAULT_TOKENS[(args.device, shape.name.split(" ")[0])]
        rows += run_shape(shape, tokens, args.device, roof, args.seed, emit, tuple(args.skip))
    text = table(rows)
    notes = summary(rows, args.device)
    print("\n" + text + "\n" + "\n".join(notes))
    if args.write:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        cmd = "python bench/kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_results(f"### MoE kernels, {args.device} ({stamp})\n\n`{cmd.strip()}`\n\n{head}\n\n{text}\n\n"
                      + "\n".join(f"- {n}" for n in notes), args.device)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
