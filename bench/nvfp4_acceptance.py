"""NVFP4 acceptance table: quality of experts-only W4A4 NVFP4 vs BF16, and the variants that explain it.

    python bench/nvfp4_acceptance.py --model namazu/assets/namazu-tiny [--out-md FILE]

Rows (each calibrated, written as a ModelOpt checkpoint, reloaded from disk, scored against BF16):
  main      routed experts only, W4A4, calibrated on Japanese (valid split)
  (a)       the same calibrated on English only
  (b)       every linear of the blocks (routed + shared experts, dense MLPs, attention), Japanese calibration
  (c)       a calibration set so small that some experts stay cold: forcing off -> refused (listed);
            forcing off + --impute-missing (listed); forcing on
  w4a16     the main checkpoint run weight-only (the Hopper serving path)
  mse       the main row with least-squares weight block scales (--weight-scale-search)
Evaluation on the Japanese and English test splits: perplexity change, mean KL and top-1 agreement with
95% paired-bootstrap intervals. Also the measured resident bytes of the quantized experts (live modules
and process RSS) and the one-class-at-a-time sensitivity sweep.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import results_md  # bench/ is on sys.path when run as `python bench/X.py`
import torch

from namazu.eval.data import load_tokenizer, token_windows
from namazu.eval.metrics import compare, score
from namazu.models.loader import load_model
from namazu.quant.calibrate import MissingScalesError, calibrate, finalize
from namazu.quant.modelopt_checkpoint import load_quantized, save_quantized
from namazu.quant.quantize import experts_resident_bytes, quantize_model
from namazu.quant.selective import QuantPolicy
from namazu.tiny.corpus import default_corpus_dir, split_path


def run_row(args, ref, tok, name, calib_windows, policy_name, force, impute, eval_sets, mode="w4a4",
            workdir=".", scale_search=False):
    model = load_model(args.model, progress=False)
    policy = QuantPolicy.preset(policy_name)
    cov, linears, total = calibrate(model, calib_windows, policy, args.min_tokens, force, progress=False)
    try:
        stats, report = finalize(cov, linears, total, args.min_tokens, force, impute)
    except MissingScalesError:
        cold = [f"L{c}/E{x}" for c, v in cov.items() for x in (v.tokens == 0).nonzero().flatten().tolist()]
        return {"name": name, "tokens": total,
                "status": f"**refused**: {len(cold)} experts without a scale ({_short(cold)})"}
    quantize_model(model, policy, stats, mode="w4a4", scale_search=scale_search)
    out = os.path.join(workdir, name.replace(" ", "_").replace("/", "-"))
    save_quantized(model, out, policy, source_dir=args.model)
    del model
    cand = load_quantized(out, mode=mode, progress=False)
    nbytes, nweights = experts_resident_bytes(cand)
    status = []
    for src in ("forced", "imputed", "low"):
        items = report.by_source(src)
        if items:
            status.append(f"{src} {len(items)}: " + _short([f"L{s.layer}/E{s.expert}" for s in items]))
    comps = {label: compare(score(ref, cand, w, desc=f"{name} {label}"), label, args.bootstrap)
             for label, w in eval_sets.items()}
    return {"name": name, "tokens": total, "status": "; ".join(status) or "all experts from routed tokens",
            "comps": comps, "bits": nbytes * 8 / max(nweights, 1), "expert_bytes": nbytes}


def _short(names: list[str], keep: int = 12) -> str:
    return ", ".join(names) if len(names) <= keep else ", ".join(names[:keep]) + f", ... ({len(names)} in all)"


def memory_table() -> str:
    """bench/nvfp4_memory.py in its own process, so its RSS readings see nothing of this one."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvfp4_memory.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True).stdout
    return out.strip()


def sensitivity_table(args, corpus) -> str:
    """`python -m namazu.quant.sensitivity` with this run's data, in its own process; its table only."""
    cmd = [sys.executable, "-m", "namazu.quant.sensitivity", "--model", args.model,
           "--calib", str(split_path(corpus, "ja", "valid")),
           "--data", str(split_path(corpus, "ja", "test")), str(split_path(corpus, "en", "test")),
           "--calib-tokens", str(args.calib_tokens), "--max-tokens", str(args.eval_tokens),
           "--seq-len", str(args.seq_len), "--bootstrap", str(args.bootstrap)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if line.startswith("|"))


def write_section(path: str, body: str) -> None:
    """Replaces the NVFP4 section of bench/RESULTS.md (between its markers) or appends it."""
    begin, end = "<!-- nvfp4-acceptance:begin -->", "<!-- nvfp4-acceptance:end -->"
    results_md.write_section(begin, end, body, path)


def fmt_rows(rows, labels) -> str:
    lines = ["| configuration | calib tokens | expert scales | " + " | ".join(
        f"{lb} ppl BF16 -> NVFP4 (change % [95% CI]) | {lb} mean KL [95% CI] | {lb} top-1 [95% CI]"
        for lb in labels) + " |", "|" + "---|" * (3 + 3 * len(labels))]
    for r in rows:
        if "comps" not in r:
            lines.append(f"| {r['name']} | {r['tokens']} | {r['status']} |" + " — |" * (3 * len(labels)))
            continue
        cells = []
        for lb in labels:
            c = r["comps"][lb]
            cells.append(f"{c.ppl_ref.value:.3f} -> {c.ppl_cand.value:.3f} ({c.ppl_change_pct.fmt(2)}) | "
                         f"{c.mean_kl.fmt(4)} | {c.top1_agreement.fmt(4)}")
        lines.append(f"| {r['name']} | {r['tokens']} | {r['status']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="namazu/assets/namazu-tiny")
    ap.add_argument("--corpus", default=None, help="corpus directory (default: the project's)")
    ap.add_argument("--calib-tokens", type=int, default=32768)
    ap.add_argument("--small-calib-tokens", type=int, default=64, help="the cold-experts row's calibration size")
    ap.add_argument("--eval-tokens", type=int, default=32768, help="per language")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    corpus = args.corpus or default_corpus_dir()
    # Every row reloads the model: work on a private copy so a checkpoint rewritten meanwhile cannot mix in.
    snapshot = tempfile.mkdtemp(prefix="nvfp4-acceptance-")
    shown_model = args.model
    args.model = shutil.copytree(args.model, os.path.join(snapshot, "model"))
    with open(os.path.join(args.model, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    tok = load_tokenizer(args.model)
    path = lambda lang, split: [str(split_path(corpus, lang, split))]  # noqa: E731
    calib_ja = token_windows(path("ja", "valid"), tok, args.seq_len, args.calib_tokens, "ja").windows
    calib_en = token_windows(path("en", "valid"), tok, args.seq_len, args.calib_tokens, "en").windows
    small = token_windows(path("ja", "valid"), tok, args.small_calib_tokens, args.small_calib_tokens, "ja").windows
    evals = {lang: token_windows(path(lang, "test"), tok, args.seq_len, args.eval_tokens, lang).windows
             for lang in ("ja", "en")}
    ref = load_model(args.model, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        common = dict(eval_sets=evals, workdir=work)
        rows.append(run_row(args, ref, tok, "experts-only W4A4, ja calibration", calib_ja, "experts", True, False,
                            **common))
        rows.append(run_row(args, ref, tok, "(a) experts-only W4A4, en calibration", calib_en, "experts", True,
                            False, **common))
        rows.append(run_row(args, ref, tok, "(b) all linears W4A4, ja calibration", calib_ja, "all-linear", True,
                            False, **common))
        for label, force, impute in (("(c) small set, forcing off", False, False),
                                     ("(c) small set, forcing off, imputed", False, True),
                                     ("(c) small set, forcing on", True, False)):
            rows.append(run_row(args, ref, tok, label, small, "experts", force, impute, **common))
        rows.append(run_row(args, ref, tok, "experts-only W4A16 (Hopper path), ja calibration", calib_ja,
                            "experts", True, False, mode="w4a16", **common))
        rows.append(run_row(args, ref, tok, "experts-only W4A4, ja calibration, MSE block scales", calib_ja,
                            "experts", True, False, scale_search=True, **common))
    table = fmt_rows(rows, list(evals))
    bits = rows[0].get("bits")
    mem = (f"Resident bytes of the NVFP4 routed experts of the loaded checkpoint, measured on the live modules: "
           f"{rows[0]['expert_bytes']} bytes = {bits:.3f} bits per expert weight (BF16: 16).") if bits else ""
    rss = memory_table()
    sens = sensitivity_table(args, corpus)
    print(table, mem, rss, sens, f"({time.time() - t0:.0f} s)", sep="\n\n")
    if args.write:
        argv_s = " ".join(argv if argv is not None else sys.argv[1:])
        body = (f"## NVFP4 routed experts: quality and memory ({datetime.date.today()})\n\n"
                f"`python bench/nvfp4_acceptance.py {argv_s}` on `{shown_model}` (model.safetensors sha256 "
                f"{digest}...), CPU, {time.time() - t0:.0f} s. "
                f"Each row is calibrated with `namazu.quant.calibrate`'s code, written as a ModelOpt NVFP4 "
                f"checkpoint, loaded back from disk and scored against BF16 on {args.eval_tokens} tokens per "
                f"language of the corpus test splits (windows of {args.seq_len}; 95% paired-bootstrap intervals "
                f"over windows, {args.bootstrap} resamples). Calibration: the valid splits, {args.calib_tokens} "
                f"tokens; the cold-experts rows use {args.small_calib_tokens} tokens; --min-tokens "
                f"{args.min_tokens}.\n\n{table}\n\n{mem}\n\nRSS of a synthetic MoE layer "
                f"(`python bench/nvfp4_memory.py`):\n\n{rss}\n\n"
                f"Sensitivity, one module class quantized at a time (W4A4, Japanese calibration; same data; "
                f"`python -m namazu.quant.sensitivity`):\n\n{sens}\n")
        write_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), body)
    shutil.rmtree(snapshot, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
