"""Per-step profile of decode steps, eager vs graph mode, side by side in one run.

    python bench/step_profile.py [--batch 1 32] [--output-len 48] [--threads 2] [--executor inline mp]
                                 [--spec ngram] [--modes eager graph]

For every (mode, executor, batch): greedy decoding of --output-len tokens (EOS ignored) from the same random
prompts, with the runner recording each step (ModelRunner.profile). Per decode step (median over the run):
  host prep   the worker's host work before the device: pending inputs, corrections, buffers
  compute     forward + sampling + acceptance up to the one host read (on GPU, also CUDA-event device time);
              (compiled forward) the graph's own share of it, inline executor only
  host post   unpacking, histories, host drafter
  gap         from the end of one step on the worker to the arrival of the next (the engine's planning,
              output processing and the hand-off between processes)
  step        arrival to next arrival; per token = step / batch (batch-1: the decode latency)
  device idle 1 - device time / step (GPU: the share of a decode step the GPU waits for the host)
  cpu         inline executor: this process's CPU time per step (arrival to next arrival), which other
              processes' load barely moves with --threads 1; "x eager (cpu)" is the ratio of these
Also: start-up seconds (graph mode: compile / capture time included), and whether the greedy tokens of
every mode equal eager's. The machine may be shared: the load average is printed before and after, and
the ratio graph/eager within one run is the number to compare. With --executor mp the worker is another
process; its step records come back through the executor (`profile`).
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


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def _make_llm(model: str, mode: str, executor: str, batches: list[int], threads: int, spec: str | None):
    from namazu import LLM

    kw = {"speculative_method": spec, "num_speculative_tokens": 3} if spec else {"num_speculative_tokens": 0}
    return LLM(model, dtype="float32", executor=executor, enforce_eager=mode == "eager", threads=threads,
               max_num_seqs=max(batches), max_num_batched_tokens=4096, kv_cache_memory="512MiB", **kw)


def _one(llm, b: int, prompts: list[list[int]], output_len: int) -> tuple[dict, list]:
    from namazu import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # In-process graph mode: the compiled forward's own time, the rest of "compute" being sampling, the
    # acceptance rule, the result pack and the host read.
    runner = getattr(getattr(llm.engine.executor, "worker", None), "runner", None)
    graphs = getattr(runner, "graphs", None)
    forward: list[float] = []
    # Inline executor: this process's CPU time at each step's arrival. Per step it is what the step cost
    # the machine, nearly independent of other processes' load (with 1 thread; more threads add their
    # OpenMP spinning), where the wall-clock columns swing with it.
    cpu_marks: list[float] = []
    if runner is not None:
        real_execute = runner.execute

        def execute(b):
            cpu_marks.append(time.process_time())
            return real_execute(b)
        runner.execute = execute
    if graphs is not None:
        real = graphs.launch

        def timed(e, width):
            t0 = time.perf_counter()
            out = real(e, width)
            forward.append(time.perf_counter() - t0)
            return out
        graphs.launch = timed
    llm.engine.start_profile()
    t = time.perf_counter()
    try:
        outs = llm.generate(prompt_token_ids=prompts[:b], sampling_params=params, use_tqdm=False)
    finally:
        if graphs is not None:
            del graphs.launch            # the class's method again
        if runner is not None:
            del runner.execute
    wall = time.perf_counter() - t
    steps = llm.engine.stop_profile()
    # Decode / verify steps only (every sequence computes its last token and drafts).
    dec = [i for i, s in enumerate(steps) if s.num_tokens % b == 0 and s.num_tokens <= b * 4 and i > 0]
    cyc = [steps[i + 1].arrive - steps[i].arrive for i in dec if i + 1 < len(steps)]
    row = {
        "batch": b, "steps": len(dec), "graph_steps": sum(steps[i].graph for i in dec),
        "prep": _median_ms([steps[i].prepared - steps[i].arrive for i in dec]),
        "compute": _median_ms([steps[i].computed - steps[i].prepared for i in dec]),
        "forward": _median_ms(forward),
        "device": _median_ms([steps[i].device_s for i in dec if steps[i].device_s is not None]),
        "post": _median_ms([steps[i].end - steps[i].computed for i in dec]),
        "gap": _median_ms([steps[i + 1].arrive - steps[i].end for i in dec if i + 1 < len(steps)]),
        "step": _median_ms(cyc), "tok_s": b * output_len / wall,
        "cpu": _median_ms([cpu_marks[i + 1] - cpu_marks[i] for i in dec if i + 1 < len(cpu_marks)]),
    }
    return row, [o.outputs[0].token_ids for o in outs]


def profile_run(model: str, mode: str, executor: str, batches: list[int], prompts: list[list[int]],
                output_len: int, threads: int, spec: str | None) -> tuple[float, list[dict], dict]:
    from namazu import SamplingParams

    t0 = time.perf_counter()
    llm = _make_llm(model, mode, executor, batches, threads, spec)
    startup = time.perf_counter() - t0
    rows, tokens = [], {}
    with llm:
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        for b in batches:
            row, tokens[b] = _one(llm, b, prompts, output_len)
            rows.append(row)
    return startup, rows, tokens


def interleaved_run(model: str, batches: list[int], prompts: list[list[int]], output_len: int, threads: int,
                    spec: str | None, rounds: int) -> list[tuple]:
    """One graph-mode engine in this process; each round runs every batch eagerly (graphs switched off in
    the runner) and as graphs, back to back, so both modes see the same machine load. Medians over rounds."""
    from namazu import SamplingParams

    t0 = time.perf_counter()
    llm = _make_llm(model, "graph", "inline", batches, threads, spec)
    startup = time.perf_counter() - t0
    runner = llm.engine.executor.worker.runner
    graphs = runner.graphs
    got: dict[tuple[str, int], list[dict]] = {}
    tokens: dict[tuple[str, int], list] = {}
    with llm:
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        for _ in range(rounds):
            for b in batches:
                for mode in ("eager", "graph"):
                    runner.graphs = graphs if mode == "graph" else None
                    row, tokens[mode, b] = _one(llm, b, prompts, output_len)
                    got.setdefault((mode, b), []).append(row)
        runner.graphs = graphs
    out = []
    for mode in ("eager", "graph"):
        rows = [{k: statistics.median(r[k] for r in got[mode, b]) for k in got[mode, b][0]} for b in batches]
        same = all(tokens[mode, b] == tokens["eager", b] for b in batches)
        out.append((mode, f"inline, interleaved x{rounds}", startup if mode == "graph" else 0.0, rows, same))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    p.add_argument("--executor", nargs="+", default=["inline"], choices=["inline", "mp"])
    p.add_argument("--spec", choices=["ngram"], help="speculative decoding (verify steps are profiled)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="instead: one graph-mode engine, eager and graph steps alternated ROUNDS times "
                        "(fair under a changing machine load)")
    args = p.parse_args()
    model, desc = pick_model(args.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(20, 256, args.prompt_len).tolist() for _ in range(max(args.batch))]
    load0 = os.getloadavg()
    results, ref = [], None
    if args.interleave:
        results = interleaved_run(model, args.batch, prompts, args.output_len, args.threads, args.spec,
                                  args.interleave)
        for mode, ex, startup, _, same in results:
            print(f"{mode}/{ex}: start-up {startup:.1f} s, tokens equal to eager: {same}", flush=True)
    for executor in args.executor if not args.interleave else []:
        for mode in args.modes:
            startup, rows, tokens = profile_run(model, mode, executor, args.batch, prompts, args.output_len,
                                                args.threads, args.spec)
            if ref is None:
                ref = tokens
            same = all(tokens[b] == ref[b] for b in args.batch)
            results.append((mode, executor, startup, rows, same))
            print(f"{mode}/{executor}: start-up {startup:.1f} s, tokens equal to the first run: {same}", flush=True)
    load1 = os.getloadavg()
    print(f"\nmodel: {desc}; float32; {args.threads} thread(s); spec: {args.spec or 'off'}; "
          f"load average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min)\n")
    print("| mode | executor | batch | steps (graph) | host prep ms | compute ms | (compiled forward ms) "
          "| device ms | device idle % | host post ms | gap ms | step ms | ms/token | tok/s | x eager "
          "| cpu ms/step | x eager (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {(ex, r["batch"]): r["step"] for m, ex, _, rows, _ in results if m == "eager" for r in rows}
    base_cpu = {(ex, r["batch"]): r["cpu"] for m, ex, _, rows, _ in results if m == "eager" for r in rows}
    for mode, executor, _, rows, _ in results:
        for r in rows:
            speed = base.get((executor, r["batch"]), float("nan")) / r["step"]
            speed_cpu = base_cpu.get((executor, r["batch"]), float("nan")) / r["cpu"]
            idle = 100 * (1 - r["device"] / r["step"])    # NaN on CPU (no device timer)
            print(f"| {mode} | {executor} | {r['batch']} | {r['steps']} ({r['graph_steps']}) | {r['prep']:.2f} | "
                  f"{r['compute']:.2f} | {r['forward']:.2f} | {r['device']:.2f} | {idle:.1f} | {r['post']:.2f} | "
                  f"{r['gap']:.2f} | "
                  f"{r['step']:.2f} | "
                  f"{r['step'] / r['batch']:.3f} | {r['tok_s']:.1f} | {speed:.2f} | {r['cpu']:.2f} | {speed_cpu:.2f} |")


if __name__ == "__main__":
    main()
