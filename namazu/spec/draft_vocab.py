"""The drafter's draft vocabulary: the output tokens it may propose, most frequent first.

The drafter scores its block against the target's frozen lm_head; at batch 1 that product (every row of a
V x H matrix read for a few drafted positions) is most of a draft step. Outputs use a small part of the
vocabulary, so scoring only the N most frequent output tokens of the training data costs N/V of it; a
token outside the shortlist can only be missed, never drafted wrongly (verification is unchanged).

    python -m namazu.spec.draft_vocab --drafter DIR --data CAPTURE... --size N [--out DIR]

sets (or, with --size 0, removes) the shortlist of an existing drafter checkpoint from the same counts
`namazu.spec.training.train --draft-vocab N` uses.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable

import torch


def frequent_tokens(outputs: Iterable[list[int]], size: int) -> torch.Tensor:
    """The `size` most frequent ids over the given output token sequences (ties: the smaller id first),
    sorted by id. Fewer when the outputs use fewer distinct ids."""
    counts: Counter[int] = Counter()
    for ids in outputs:
        counts.update(ids)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return torch.tensor(sorted(t for t, _ in top), dtype=torch.long)


def extend_vocab(base: torch.Tensor | None, outputs: Iterable[list[int]], extra: int) -> torch.Tensor | None:
    """`base` (sorted ids) and the `extra` most frequent ids of `outputs` outside it, sorted by id; None (the
    whole vocabulary) stays None."""
    if base is None:
        return None
    keep = set(base.tolist())
    counts: Counter[int] = Counter(t for ids in outputs for t in ids if t not in keep)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:extra]
    return torch.tensor(sorted(keep | {t for t, _ in top}), dtype=torch.long)


def coverage(vocab: torch.Tensor, outputs: Iterable[list[int]]) -> float:
    """Share of the output tokens that lie inside the draft vocabulary."""
    keep = set(vocab.tolist())
    inside = total = 0
    for ids in outputs:
        inside += sum(t in keep for t in ids)
        total += len(ids)
    return inside / max(1, total)


def main(argv: list[str] | None = None) -> int:
    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.capture import read_records
    from namazu.spec.dflash import DFlashDrafter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    ap.add_argument("--data", nargs="+", required=True, help="the captures it was trained on")
    ap.add_argument("--size", type=int, required=True, help="draft vocabulary size (0: the whole vocabulary)")
    ap.add_argument("--heldout", nargs="*", default=None, help="captures to report the coverage on")
    ap.add_argument("--target", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--out", default=None, help="where to write the result (default: over --drafter)")
    args = ap.parse_args(argv)
    tcfg = ModelConfig.from_pretrained(str(resolve_model_path(args.target)))
    drafter = DFlashDrafter.load(args.drafter, tcfg.vocab_size, tcfg.hidden_size, tcfg.num_hidden_layers)
    outputs = [ids for rec in read_records(args.data) for ids in rec.output_token_ids]
    drafter.set_draft_vocab(frequent_tokens(outputs, args.size) if args.size else None)
    drafter.save(args.out or args.drafter)
    report = {"draft_vocab_size": drafter.cfg.draft_vocab_size}
    if args.heldout and drafter.draft_vocab is not None:
        held = [ids for rec in read_records(args.heldout) for ids in rec.output_token_ids]
        report["heldout_coverage"] = round(coverage(drafter.draft_vocab, held), 4)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
