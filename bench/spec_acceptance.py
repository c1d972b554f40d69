"""Mean acceptance length of several drafters through the engine, on held-out captured requests.

    python bench/spec_acceptance.py --requests build/drafter/capture-heldout --drafters shipped=DIR ngram \
        [--temperature 0.7] [--limit 200] [--k 6] [--greedy-drafts] [--min-confidence 0 0.25]
        [--captured-temperature 0.7] [--request-seeds]

Each captured request is generated again with its own top-p and top-k at --temperature (each answer
at most as long as the captured one), in one inline engine per drafter, 16 sequences at a time, drafting at
every batch size (no disable threshold). The engine's own acceptance histogram gives the mean acceptance
length (drafts accepted + 1 per verify step). A DFlash drafter draws its drafts from the selector's q at
T > 0 (the default, verified with the lossless rule); --greedy-drafts makes it draft its top tokens
instead; --min-confidence runs each DFlash drafter once per threshold (`--speculative-min-confidence`:
blocks end where its running confidence falls below it), reporting drafts verified per verify step beside
the acceptance length. `ngram` is the n-gram drafter. Acceptance does not depend on the machine's load.
The requests' seeds are the engine's (reproducible: the engine's --seed), so drafts from q go through the
ratio rule, as for unseeded traffic; --request-seeds replays the captured seeds, whose rows are verified
by exact match against the target's seeded samples (docs/engine.md), as a seeded request's are.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def acceptance(drafter: str, records: list, temperature: float, k: int, greedy_drafts: bool,
               min_confidence: float = 0.0, request_seeds: bool = False) -> tuple[float, int, float]:
    import torch

    from namazu import LLM, SamplingParams
    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.dflash_proposer import DFlashProposer

    torch.set_num_threads(1)
    model = str(resolve_model_path(None))
    cfg = ModelConfig.from_pretrained(model)
    if drafter == "ngram":
        prop, extra = None, dict(speculative_method="ngram")
    else:
        prop = DFlashProposer(drafter, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers,
                              sample_drafts=not greedy_drafts, min_confidence=min_confidence)
        extra = {}
    params = [SamplingParams(temperature=temperature, top_p=r.sampling.get("top_p") or 1.0,
                             top_k=r.sampling.get("top_k") or 0,
                             seed=r.sampling.get("seed") if request_seeds else None,
                             max_tokens=max(1, len(r.output_token_ids[0])), **r.structured) for r in records]
    with LLM(model, dtype="float32", executor="inline", drafter=prop, num_speculative_tokens=k, max_num_seqs=16,
             speculative_disable_batch_size=0, **extra) as llm:
        llm.generate(prompt_token_ids=[r.prompt_token_ids for r in records], sampling_params=params,
                     use_tqdm=False)
        stats = llm.engine.get_stats()
    verifies = sum(stats.acceptance_length_histogram)
    return stats.mean_acceptance_length, verifies, stats.num_draft_tokens / verifies if verifies else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="capture dirs or shard files")
    ap.add_argument("--drafters", nargs="+", required=True, metavar="NAME=DIR|ngram")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--captured-temperature", type=float, default=None, metavar="T",
                    help="only the requests captured at temperature T (the ones whose captured answers are "
                         "samples of what --temperature T replays: `namazu.spec.training.calibrate`'s estimate "
                         "uses those)")
    ap.add_argument("--k", type=int, default=6, help="draft tokens per step")
    ap.add_argument("--greedy-drafts", action="store_true", help="DFlash drafts its top tokens at T > 0")
    ap.add_argument("--min-confidence", type=float, nargs="+", default=[0.0], metavar="X",
                    help="block-ending thresholds of the DFlash drafters, one run per value (0: full blocks)")
    ap.add_argument("--request-seeds", action="store_true",
                    help="replay the captured seeds (seeded rows: exact match) instead of engine-drawn ones")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from namazu.spec.capture import read_records

    wanted = (r for r in read_records(args.requests) if args.captured_temperature is None
              or abs((r.sampling.get("temperature") or 0.0) - args.captured_temperature) < 1e-6)
    records = [r for _, r in zip(range(args.limit), wanted)]
    rows = []
    runs = [(spec, x) for spec in args.drafters for x in (args.min_confidence if "=" in spec else [0.0])]
    for spec, x in tqdm(runs, desc="drafters", unit="drafter"):
        name, _, path = spec.partition("=")
        name = f"{name}@{x:g}" if len(args.min_confidence) > 1 and path else name
        rows.append((name, *acceptance(path or name, records, args.temperature, args.k, args.greedy_drafts, x,
                                       args.request_seeds)))
    drafts = "greedy drafts" if args.greedy_drafts else "drafts from q"
    print(f"{len(records)} held-out requests, T={args.temperature:g}, k={args.k}, {drafts} (DFlash)")
    print("| drafter | mean acceptance length | verify steps | drafts verified per verify step |")
    print("|---|---:|---:|---:|")
    for name, tau, steps, drafts in rows:
        print(f"| {name} | {tau:.2f} | {steps} | {drafts:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
