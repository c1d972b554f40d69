"""Quality gate: `python -m namazu.eval.compare --ref A --cand B --data ja=FILE en=FILE ...`.

Scores both models on the same token windows and reports, per data label (language): perplexity of each,
the perplexity change in percent, mean KL(ref || cand) per token and top-1 agreement, each with a paired
bootstrap confidence interval. Thresholds turn it into a gate: exit status 1 if any label fails
(the interval's pessimistic end is not what is gated; the point estimate is, and the table shows both).

Either model may be a BF16/FP8 checkpoint or an NVFP4 ModelOpt checkpoint (served in `--mode`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from namazu.eval.data import load_tokenizer, parse_labelled, token_windows
from namazu.eval.metrics import Comparison, compare, score

logger = logging.getLogger(__name__)


def format_table(rows: list[Comparison], name: str = "") -> str:
    head = ("| data | tokens | ppl ref | ppl cand | ppl change % [95% CI] | mean KL (nats) [95% CI] "
            "| top-1 agreement [95% CI] |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {name + ' ' if name else ''}{r.label} | {r.tokens} | {r.ppl_ref.value:.3f} | "
                     f"{r.ppl_cand.value:.3f} | {r.ppl_change_pct.fmt(2)} | {r.mean_kl.fmt(4)} | "
                     f"{r.top1_agreement.fmt(4)} |")
    return "\n".join(lines)


def gate(rows: list[Comparison], max_ppl_increase: float | None, max_kl: float | None,
         min_top1: float | None) -> list[str]:
    """Human-readable failures (empty list = pass)."""
    fails = []
    for r in rows:
        if max_ppl_increase is not None and r.ppl_change_pct.value > max_ppl_increase:
            fails.append(f"{r.label}: perplexity +{r.ppl_change_pct.value:.2f}% > {max_ppl_increase}%")
        if max_kl is not None and r.mean_kl.value > max_kl:
            fails.append(f"{r.label}: mean KL {r.mean_kl.value:.4f} > {max_kl}")
        if min_top1 is not None and r.top1_agreement.value < min_top1:
            fails.append(f"{r.label}: top-1 agreement {r.top1_agreement.value:.4f} < {min_top1}")
    return fails


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m namazu.eval.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="reference checkpoint directory (e.g. the BF16 model)")
    ap.add_argument("--cand", required=True, help="candidate checkpoint directory (e.g. its NVFP4 version)")
    ap.add_argument("--data", nargs="+", required=True, metavar="[LABEL=]FILE",
                    help="text (.txt[.gz], corpus format) or chats (.jsonl); label defaults to the parent "
                         "directory name (corpus/ja/test.txt -> ja)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --ref)")
    ap.add_argument("--mode", default="w4a4", choices=("w4a4", "w4a16"),
                    help="how NVFP4 modules run: w4a4 = Blackwell numerics emulated, w4a16 = weight-only")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32768, help="per data label")
    ap.add_argument("--dtype", default="auto", help="dtype both models are loaded in")
    ap.add_argument("--ref-dtype", default=None, help="the reference's dtype if not --dtype (with --cand the same "
                                                       "checkpoint: what serving in another dtype costs)")
    ap.add_argument("--cand-dtype", default=None, help="the candidate's dtype if not --dtype")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--max-ppl-increase", type=float, default=2.0, help="percent; gate fails above")
    ap.add_argument("--max-kl", type=float, default=None, help="nats per token; gate fails above")
    ap.add_argument("--min-top1", type=float, default=None, help="fraction; gate fails below")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from namazu.quant.modelopt_checkpoint import load_any

    torch.manual_seed(0)
    tok = load_tokenizer(args.tokenizer or args.ref)
    data = {label: token_windows(paths, tok, args.seq_len, args.max_tokens, label)
            for label, paths in parse_labelled(args.data).items()}
    ref = load_any(args.ref, dtype=args.ref_dtype or args.dtype, progress=False)
    cand = load_any(args.cand, mode=args.mode, dtype=args.cand_dtype or args.dtype, progress=False)
    rows = [compare(score(ref, cand, d.windows, desc=f"scoring {label}"), label, args.bootstrap)
            for label, d in data.items()]
    print(format_table(rows))
    fails = gate(rows, args.max_ppl_increase, args.max_kl, args.min_top1)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"ref": args.ref, "cand": args.cand, "mode": args.mode,
                       "ref_dtype": args.ref_dtype or args.dtype, "cand_dtype": args.cand_dtype or args.dtype,
                       "rows": [r.as_dict() for r in rows], "failures": fails}, f, indent=2)
    for msg in fails:
        print(f"FAIL {msg}")
    print("gate: " + ("FAIL" if fails else "PASS"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
