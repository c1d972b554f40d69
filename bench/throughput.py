"""Offline generation throughput: namazu's engine vs transformers' generate(), same checkpoint, same prompts.

    python bench/throughput.py [--model DIR] [--batch 1 32] [--prompt-len 128] [--output-len 128] [--graph] [--write]

namazu runs twice, with synchronous and with async scheduling (step N+1 planned while step N runs);
with --graph a third time in graph mode (synchronous; its wall time excludes start-up's compilation).
Both engines run greedy decoding of exactly --output-len tokens (EOS ignored) from the same random prompts of
--prompt-len tokens, in float32 on CPU, with the same number of torch threads. Throughput is generated
tokens per second of wall time for the whole batch (prefill included). The greedy outputs of the two are
compared too (fraction of identical tokens) as a sanity check that both computed the same thing.
Default model: the embedded namazu-tiny if installed, else a deterministic random checkpoint (`bench`
size from namazu.assets.random_model) written to a cache directory.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- throughput:begin -->", "<!-- throughput:end -->"


def pick_model(arg: str | None) -> tuple[str, str]:
    from namazu.assets import default_model_path

    if arg:
        return arg, Path(arg).name
    default = default_model_path()
    if (default / "config.json").is_file():
        return str(default), "namazu-tiny"
    from namazu.assets.random_model import write_random_checkpoint

    cache = Path(tempfile.gettempdir()) / "namazu-bench-random-seed0"
    if not (cache / "model.safetensors").is_file():
        write_random_checkpoint(cache, size="bench", seed=0)
    return str(cache), "random `bench`-size checkpoint (seed 0)"


def run_namazu(model: str, prompts: list[list[int]], output_len: int, batch: int,
               async_scheduling: bool, enforce_eager: bool = True) -> tuple[float, list[list[int]]]:
    from namazu import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with LLM(model, dtype="float32", max_num_seqs=max(batch, 1), max_num_batched_tokens=4096,
             kv_cache_memory="512MiB", async_scheduling=async_scheduling, enforce_eager=enforce_eager) as llm:
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        dt = time.perf_counter() - t0
    return dt, [o.outputs[0].token_ids for o in outs]


def run_transformers(model: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    # No EOS at all (not min_new_tokens, which masks EOS and so changes greedy picks): like ignore_eos.
    hf.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        dt = time.perf_counter() - t0
    return dt, out[:, ids.shape[1]:].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of rows' tokens equal up to the first divergence (greedy drifts after a near-tie)."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same += n
        total += len(x)
    return same / total if total else 1.0


def write_results(table: str, command: str, model_desc: str, threads: int) -> None:
    load = os.getloadavg()[0]
    section = ("## Engine throughput vs transformers (CPU)\n\n"
               f"`{command}` -- model: {model_desc}; float32; {threads} torch thread(s); greedy, EOS ignored. "
               f"Machine: {os.cpu_count()} cores, load average {load:.1f} when written (shared machine: "
               f"absolute numbers are noisy; the two engines run back to back).\n\n"
               f"{table}")
    write_section(BEGIN, END, section)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: namazu-tiny or a random one)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", action="store_true", help=f"record the table in {RESULTS.name}")
    p.add_argument("--graph", action="store_true",
                   help="also run namazu in graph mode (compiled decode steps; start-up compiles the ladder)")
    args = p.parse_args(argv)

    os.environ["OMP_NUM_THREADS"] = str(args.threads)   # the namazu worker process inherits it
    import torch
    torch.set_num_threads(args.threads)
    model, desc = pick_model(args.model)
    from namazu.config import ModelConfig
    from namazu.tokenizer import Tokenizer

    vocab = ModelConfig.from_pretrained(model).vocab_size
    special = Tokenizer.from_pretrained(model).special_ids
    ordinary = np.asarray([i for i in range(vocab) if i not in special])
    rng = np.random.default_rng(args.seed)
    rows = ["| batch | namazu tok/s | namazu --async-scheduling tok/s | transformers tok/s "
            "| namazu (best) / transformers | greedy agreement |",
            "|---:|---:|---:|---:|---:|---:|"]
    if args.graph:
        rows[0] += " namazu graph mode tok/s | graph / eager | graph tokens = eager |"
        rows[1] += "---:|---:|---|"
    for batch in args.batch:
        prompts = rng.choice(ordinary, (batch, args.prompt_len)).tolist()   # no special tokens
        tokens = batch * args.output_len
        t_nz, out_nz = run_namazu(model, prompts, args.output_len, batch, async_scheduling=False)
        t_as, out_as = run_namazu(model, prompts, args.output_len, batch, async_scheduling=True)
        t_hf, out_hf = run_transformers(model, prompts, args.output_len)
        r_nz, r_as, r_hf = tokens / t_nz, tokens / t_as, tokens / t_hf
        agree = min(agreement(out_nz, out_hf), agreement(out_as, out_hf))
        rows.append(f"| {batch} | {r_nz:,.1f} | {r_as:,.1f} | {r_hf:,.1f} | {max(r_nz, r_as) / r_hf:.2f}x "
                    f"| {agree:.3f} |")
        if args.graph:
            t_g, out_g = run_namazu(model, prompts, args.output_len, batch, async_scheduling=False,
                                    enforce_eager=False)
            rows[-1] += f" {tokens / t_g:,.1f} | {t_nz / t_g:.2f}x | {out_g == out_nz} |"
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(f"\nmodel: {desc}; prompt {args.prompt_len}, output {args.output_len}, {args.threads} thread(s)\n")
    print(table)
    if args.write:
        command = "python bench/throughput.py " + " ".join(sys.argv[1:])
        write_results(table, command.strip(), desc, args.threads)
        print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
