"""Two versions of namazu on the same offline generation work, alternated in one run: is B faster than A?

    python bench/ab_trees.py --a REF --b REF [--batch 1 32] [--rounds 3] [--threads 1]
                             [--scheduling async sync] [--graph] [--llm-args JSON] [--plot FILE] [--write]

REF is a git commit, branch or tag of this repository, or WORKTREE for the files as they are now
(uncommitted changes included). Each REF other than WORKTREE is exported with `git archive` into a
temporary folder, with this checkout's built extensions (namazu/*.so, ignored by git) copied in.

Every measurement is a fresh child process (`python bench/ab_trees.py --child ...` with PYTHONPATH set to
that tree), so nothing is shared between the two versions but the machine. A child starts an `LLM` on the
default model (namazu-tiny), warms it up, then times `--repeats` greedy `generate` calls of exactly
--output-len tokens per prompt (EOS ignored) and reports the best. Rounds alternate the order (A B, B A,
...) so that a drift of the machine's load falls on both. The table gives every round, the medians and
B / A; "tokens equal" says whether both versions produced the same greedy tokens (a speed comparison of
two versions that compute different things means little).

Why this exists: on a shared 2-core machine two runs minutes apart differ by 10%, so a before/after claim
needs both versions in one run, alternated, several rounds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- ab_trees:begin -->", "<!-- ab_trees:end -->"


# ---------------------------------------------------------------- child: one measurement in one tree

def child(spec: dict) -> dict:
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import numpy as np
    import torch

    torch.set_num_threads(spec["threads"])
    from namazu import LLM, SamplingParams
    from namazu.assets import default_model_path
    from namazu.config import ModelConfig
    from namazu.tokenizer import Tokenizer

    model = str(default_model_path())
    vocab = ModelConfig.from_pretrained(model).vocab_size
    special = Tokenizer.from_pretrained(model).special_ids
    ordinary = np.asarray([i for i in range(vocab) if i not in special])
    batch = spec["batch"]
    prompts = np.random.default_rng(spec["seed"]).choice(ordinary, (batch, spec["prompt_len"])).tolist()
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)
    kwargs = dict(dtype="float32", max_num_seqs=batch, max_num_batched_tokens=4096, kv_cache_memory="512MiB",
                  async_scheduling=spec["scheduling"] == "async", enforce_eager=not spec["graph"])
    kwargs.update(spec["llm_args"])
    times, digest = [], None
    t_start = time.perf_counter()
    with LLM(model, **kwargs) as llm:
        startup = time.perf_counter() - t_start
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            h = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
            if digest not in (None, h):
                raise RuntimeError("greedy outputs differ between repeats of the same tree")
            digest = h
    import namazu

    return {"tok_s": batch * spec["output_len"] / min(times), "digest": digest, "startup_s": startup,
            "namazu": namazu.__file__}


# ---------------------------------------------------------------- parent: export trees, alternate, report

def export_tree(ref: str, into: Path) -> Path:
    if ref == "WORKTREE":
        return ROOT
    dest = into / ref.replace("/", "_")
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for so in (ROOT / "namazu").glob("*.so"):
        shutil.copy2(so, dest / "namazu" / so.name)
    return dest


def measure(tree: Path, spec: dict, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          env=env, cwd=str(tree), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"child in {tree.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(out["namazu"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the child imported {out['namazu']}, not the tree under test {tree}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--a", help="baseline: a git ref, or WORKTREE")
    p.add_argument("--b", default="WORKTREE", help="candidate: a git ref, or WORKTREE (default)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--scheduling", nargs="+", default=["async"], choices=["async", "sync"])
    p.add_argument("--graph", action="store_true", help="graph mode (compiled steps) instead of eager")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per child (best counts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llm-args", type=json.loads, default={}, metavar="JSON",
                   help='more LLM keywords for both sides, e.g. \'{"num_speculative_tokens": 0}\'')
    p.add_argument("--timeout", type=float, default=900, help="seconds per child before it counts as failed")
    p.add_argument("--plot", help="write a plot of every round (PNG)")
    p.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if not args.a:
        p.error("--a is required")
    from tqdm import tqdm

    configs = [(b, s) for b in args.batch for s in args.scheduling]
    results: dict[tuple, dict[str, list[dict]]] = {c: {"A": [], "B": []} for c in configs}
    with tempfile.TemporaryDirectory(prefix="namazu-ab-") as tmp:
        trees = {"A": export_tree(args.a, Path(tmp) / "a"), "B": export_tree(args.b, Path(tmp) / "b")}
        with tqdm(total=args.rounds * len(configs) * 2, desc="A/B runs", unit="run") as bar:
            for r in range(args.rounds):
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                for batch, sched in configs:
                    spec = dict(batch=batch, scheduling=sched, graph=args.graph, threads=args.threads,
                                prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed,
                                repeats=args.repeats, llm_args=args.llm_args)
                    for side in order:
                        results[(batch, sched)][side].append(measure(trees[side], spec, args.timeout))
                        bar.update()
    table = render(args, configs, results)
    print(table)
    if args.plot:
        plot(args, configs, results)
    if args.write:
        cmd = "python bench/ab_trees.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(BEGIN, END, "## A/B of two versions (bench/ab_trees.py)\n\n"
                      f"`{cmd}`; load average {os.getloadavg()[0]:.1f} when written; "
                      f"{os.cpu_count()} cores.\n\n{table}")


def render(args, configs, results) -> str:
    mode = "graph" if args.graph else "eager"
    extra = f", LLM keywords `{json.dumps(args.llm_args)}`" if args.llm_args else ""
    rows = [f"A = `{args.a}`, B = `{args.b}`; {mode}{extra}, {args.threads} thread(s), prompt {args.prompt_len}, "
            f"output {args.output_len} tokens, best of {args.repeats} per run, {args.rounds} alternated rounds.",
            "",
            "| batch | scheduling | A tok/s (rounds) | B tok/s (rounds) | median A | median B | B / A | tokens equal |",
            "|---:|---|---|---|---:|---:|---:|---|"]
    for batch, sched in configs:
        a = [x["tok_s"] for x in results[(batch, sched)]["A"]]
        b = [x["tok_s"] for x in results[(batch, sched)]["B"]]
        digests = {x["digest"] for side in ("A", "B") for x in results[(batch, sched)][side]}
        ma, mb = statistics.median(a), statistics.median(b)
        rows.append(f"| {batch} | {sched} | {', '.join(f'{v:,.1f}' for v in a)} | "
                    f"{', '.join(f'{v:,.1f}' for v in b)} | {ma:,.1f} | {mb:,.1f} | {mb / ma:.3f} | "
                    f"{'yes' if len(digests) == 1 else 'NO'} |")
    return "\n".join(rows)


def plot(args, configs, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3.2), squeeze=False)
    for ax, (batch, sched) in zip(axes[0], configs):
        for side, color in (("A", "tab:gray"), ("B", "tab:blue")):
            ys = [x["tok_s"] for x in results[(batch, sched)][side]]
            ax.plot(range(1, len(ys) + 1), ys, "o-", color=color, label=f"{side}: {getattr(args, side.lower())}")
        ax.set_title(f"batch {batch}, {sched}")
        ax.set_xlabel("round")
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
