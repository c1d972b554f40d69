"""How long can a verify step's accepted run be at temperature T, for ANY drafter that drafts greedily?

    python bench/spec_ceiling.py --requests build/drafter/capture-heldout [--temperatures 0.7 1.0]
                                 [--k 4 6] [--limit 250]

A greedy draft (one token per position, verified as a deterministic draft) is accepted with the target's
probability of that token under the request's sampling distribution, so the best greedy drafter there is
proposes the target's own top token and is accepted with p_T(top), the top token's probability after
temperature, top-k, top-p and min-p (namazu's sampler's `process_logits`, the one definition). This
script runs the target over held-out captured prompts + outputs (teacher forcing on the captured tokens)
and gives, per temperature, the mean p_T(top) and the mean acceptance length of that oracle greedy drafter
with k drafts: 1 + sum_j prod_{i<=j} p_T(top at position a+i), averaged over the anchors a of the output.
(Along the captured tokens, not along the oracle's own accepted tokens: an estimate, not a bound proven
for every path.) Drafting from the drafter's own distribution q instead (namazu does at T > 0 with
`sample_drafts`) is accepted with sum_x min(p(x), q(x)) per position, which reaches 1 only when q = p.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def top_probs(logits: torch.Tensor, sampling: dict, temperature: float) -> torch.Tensor:
    """[T, V] raw logits -> [T] probability of the top token under the request's sampling distribution."""
    from namazu.spec.training.calibrate import target_probs

    return target_probs(logits, sampling, temperature).max(dim=-1).values


def oracle_acceptance(p_top: np.ndarray, k: int) -> float:
    """Mean over anchors of 1 + sum_j prod_{i<=j} p_top[a + i] (the k positions after the anchor)."""
    if len(p_top) < 2:
        return 1.0
    taus = []
    for a in range(len(p_top) - 1):
        run = p_top[a + 1:a + 1 + k]
        taus.append(1.0 + float(np.cumprod(run).sum()))
    return float(np.mean(taus))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="capture dirs or shard files")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 6])
    ap.add_argument("--limit", type=int, default=250)
    ap.add_argument("--model", default=None, help="target checkpoint (default: namazu-tiny)")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from namazu.assets import resolve_model_path
    from namazu.models.loader import load_model
    from namazu.spec.capture import read_records

    model = load_model(str(resolve_model_path(args.model)), dtype="float32", progress=False).eval()
    recs = [r for _, r in zip(range(args.limit), read_records(args.requests))]
    per_t: dict[float, dict] = {t: {"p": [], "tau": {k: [] for k in args.k}} for t in args.temperatures}
    with torch.no_grad():
        for rec in tqdm(recs, desc="held-out requests", unit="req"):
            out = rec.output_token_ids[0]
            if len(out) < 2:
                continue
            ids = torch.tensor([rec.prompt_token_ids + out])
            hidden, _ = model(ids)
            # Row i predicts token i + 1: the rows that predict output tokens 1.. (token 0 follows the prompt).
            logits = model.compute_logits(hidden[0, len(rec.prompt_token_ids) - 1:-1])
            for t in args.temperatures:
                p = top_probs(logits, rec.sampling, t).numpy()
                per_t[t]["p"].append(p)
                for k in args.k:
                    per_t[t]["tau"][k].append(oracle_acceptance(p, k))
    print(f"{len(recs)} held-out requests ({sum(len(r.output_token_ids[0]) for r in recs):,} output tokens); "
          "each request's own top-k/top-p/min-p, the temperature below")
    print("| temperature | mean p_T(top token) | " + " | ".join(f"oracle greedy drafter, k={k}" for k in args.k)
          + " |")
    print("|---:|---:|" + "---:|" * len(args.k))
    for t in args.temperatures:
        p = np.concatenate(per_t[t]["p"])
        taus = " | ".join(f"{np.mean(per_t[t]['tau'][k]):.2f}" for k in args.k)
        print(f"| {t} | {p.mean():.3f} | {taus} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
