"""Which module classes tolerate NVFP4: quantize one class at a time and measure the damage.

`python -m namazu.quant.sensitivity --model PATH --calib FILE... --data ja=FILE en=FILE`

Calibrates once (every class covered, expert forcing on), then for each module class (routed experts,
shared experts, attention projections, router, lm_head; dense MLPs on request) loads a fresh copy of the
model, quantizes only that class and reports mean KL(BF16 || quantized) and top-1 agreement against the
BF16 model on each data label (e.g. Japanese and English), with bootstrap intervals, plus the share of
the model's linear weights the class holds.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from namazu.eval.data import load_tokenizer, parse_labelled, token_windows
from namazu.eval.metrics import Comparison, compare, score
from namazu.quant.calibrate import calibrate, finalize
from namazu.quant.quantize import quantize_model
from namazu.quant.selective import MODULE_CLASSES, QuantPolicy, module_class

logger = logging.getLogger(__name__)
DEFAULT_CLASSES = ("routed_experts", "shared_experts", "attention", "router", "lm_head")


def class_weights(model: torch.nn.Module) -> dict[str, int]:
    """Linear weights per module class (routed experts counted per expert)."""
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        cls = module_class(name)
        if cls is None or (cls == "routed_experts" and name.count(".") > 4):
            continue
        if cls == "routed_experts":
            n = 3 * mod.num_experts * mod.hidden_size * mod.intermediate_size
        else:
            n = mod.weight.numel()
        out[cls] = out.get(cls, 0) + n
    return out


def format_table(rows: list[tuple[str, int, float, list[Comparison]]], labels: list[str]) -> str:
    head = "| quantized class | modules | share of linear weights | " + " | ".join(
        f"{lb} mean KL [95% CI] | {lb} top-1 [95% CI] | {lb} ppl change %" for lb in labels) + " |"
    lines = [head, "|" + "---|" * (3 + 3 * len(labels))]
    for cls, count, share, comps in rows:
        cells = " | ".join(f"{c.mean_kl.fmt(4)} | {c.top1_agreement.fmt(4)} | {c.ppl_change_pct.value:+.2f}"
                           for c in comps)
        lines.append(f"| {cls} | {count} | {100 * share:.1f}% | {cells} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m namazu.quant.sensitivity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="BF16 or block-FP8 checkpoint directory")
    ap.add_argument("--calib", nargs="+", required=True, metavar="FILE", help="calibration text or JSONL chats")
    ap.add_argument("--data", nargs="+", required=True, metavar="[LABEL=]FILE",
                    help="evaluation text per label (default label: parent directory name, e.g. ja / en)")
    ap.add_argument("--classes", default=",".join(DEFAULT_CLASSES),
                    help=f"comma list from {','.join(MODULE_CLASSES)}")
    ap.add_argument("--mode", default="w4a4", choices=("w4a4", "w4a16"))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens per label")
    ap.add_argument("--bootstrap", type=int, default=500)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from namazu.models.loader import load_model

    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    QuantPolicy.from_classes(classes)  # validates the names
    tok = load_tokenizer(args.tokenizer or args.model)
    ref = load_model(args.model, dtype=args.dtype, progress=False)
    if ref.config.tie_word_embeddings and "lm_head" in classes:
        # Quantizing a tied lm_head would quantize the embeddings too (or untie them): not a lm_head row.
        if args.classes != ",".join(DEFAULT_CLASSES):
            raise SystemExit(f"{args.model}: lm_head is tied to the embeddings and cannot be quantized on its own")
        logger.warning("lm_head is tied to the embeddings: left out of the sweep")
        classes.remove("lm_head")
    calib = token_windows(args.calib, tok, args.seq_len, args.calib_tokens, "calibration").windows
    everything = QuantPolicy.from_classes(classes)
    cov, linears, total = calibrate(ref, calib, everything, force=True)
    stats, _ = finalize(cov, linears, total, 32, True, impute_missing=False)
    data = {label: token_windows(paths, tok, args.seq_len, args.max_tokens, label)
            for label, paths in parse_labelled(args.data).items()}
    weights = class_weights(ref)
    all_weights = sum(weights.values())
    rows = []
    for cls in classes:
        cand = load_model(args.model, dtype=args.dtype, progress=False)
        counts = quantize_model(cand, QuantPolicy.from_classes([cls]), stats, mode=args.mode)
        comps = [compare(score(ref, cand, d.windows, desc=f"{cls} / {label}"), label, args.bootstrap)
                 for label, d in data.items()]
        rows.append((cls, counts.get(cls, 0), weights.get(cls, 0) / all_weights, comps))
        del cand
    print(format_table(rows, list(data)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"class": c, "modules": n, "weight_share": s, "results": [x.as_dict() for x in comps]}
                       for c, n, s, comps in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
