"""How well the DFlash drafter's own confidence predicts which of its drafts the target accepts.

    python bench/draft_confidence.py --requests CAPTURE_DIR [--limit 60] [--output-len 128] [--k 6]

Greedy (T=0), one held-out captured prompt at a time through an inline engine that drafts k tokens per
block at every step (no early end, synchronous scheduling, so each block is verified by the very next
step). Per drafted position j of every verified block the script keeps two signals, both known to the
drafter before verification:

- `selector`: the running product over positions 0..j of the selector walk's probability of its pick
  (the signal `--speculative-min-confidence` ends a block on, `dflash.draft_counts`);
- `lm_head`: the same running product of the drafter's own lm_head softmax probability of the drafted token
  (over its draft vocabulary; 0 where the selector picked a token outside it);

and whether drafts 0..j were all accepted. Prints, per signal, a calibration table (signal bucket ->
number of positions, empirical probability that the prefix is accepted) and the area under the ROC curve;
then, per signal, the verify rows and accepted drafts per block that each threshold would give (drafts
kept: the prefix whose signal clears the threshold, at least one, or at least none), which is what a block
ending at that threshold saves and loses.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="capture dirs or shard files")
    ap.add_argument("--limit", type=int, default=60, help="prompts")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=6, help="drafts per block")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5])
    args = ap.parse_args(argv)

    import torch

    from namazu import LLM, SamplingParams
    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.capture import read_records
    from namazu.spec.dflash_proposer import DFlashProposer
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    torch.set_num_threads(1)
    model = resolve_model_path(None)
    cfg = ModelConfig.from_pretrained(model)

    class Recording(DFlashProposer):
        """Keeps each block's signals; the next block's `accepted` says how its predecessor fared."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.pending: np.ndarray | None = None        # [2, k] signals of the block awaiting its verify
            self.rows: list[tuple[np.ndarray, int]] = []  # (signals [2, k], drafts accepted)

        def propose(self, inp, k):
            if self.pending is not None:
                self.rows.append((self.pending, int(inp.accepted[0])))
            anchor, _, h, logits = self.draft_block(inp, k)
            walk = self.model.walk(anchor, h, logits, k)
            lm = logits[:, :k].float().softmax(-1)                           # [1, k, N] over the draft vocab
            vocab = self.model.draft_vocab
            if vocab is None:
                p_lm = lm.gather(-1, walk.ids.unsqueeze(-1)).squeeze(-1)
            else:
                where = torch.searchsorted(vocab, walk.ids).clamp(max=len(vocab) - 1)
                p_lm = lm.gather(-1, where.unsqueeze(-1)).squeeze(-1) * (vocab[where] == walk.ids)
            self.pending = np.stack([walk.confidence[0].cpu().numpy(), p_lm[0].cpu().numpy()])
            return super().propose(inp, k)

    prop = Recording(str(model / SHIPPED_DRAFTER_DIR), cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers)
    records = [r for _, r in zip(range(args.limit), read_records(args.requests))]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    with LLM(str(model), dtype="float32", executor="inline", drafter=prop, num_speculative_tokens=args.k,
             speculative_disable_batch_size=0, async_scheduling=False, threads=1) as llm:
        for r in records:
            prop.pending = None          # a new sequence: the last block of the previous one was never verified
            llm.generate(prompt_token_ids=[r.prompt_token_ids], sampling_params=params, use_tqdm=False)
    blocks = len(prop.rows)
    sig = np.stack([s for s, _ in prop.rows])                      # [blocks, 2, k]
    acc = np.array([a for _, a in prop.rows])                      # [blocks]
    run = np.cumprod(sig, axis=-1)                                 # running products
    ok = np.arange(args.k)[None, :] < acc[:, None]                 # [blocks, k]: prefix 0..j accepted
    print(f"{len(records)} prompts, {blocks} verified blocks of {args.k} drafts, T=0, mean acceptance length "
          f"{acc.mean() + 1:.2f}")
    edges = [0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
    for i, name in enumerate(("selector", "lm_head")):
        x, y = run[:, i].ravel(), ok.ravel()
        print(f"\n{name}: running confidence -> P(drafts 0..j all accepted); AUC {auc(x, y):.3f}")
        print("| bucket | positions | accepted |")
        print("|---|---:|---:|")
        for lo, hi in zip(edges[:-1], edges[1:]):
            m = (x >= lo) & (x < hi)
            if m.any():
                print(f"| [{lo:g}, {min(hi, 1):g}) | {int(m.sum())} | {y[m].mean():.3f} |")
    print("\nthreshold -> per block: verify rows (1 + drafts kept), drafts accepted, mean acceptance length; "
          "drafts kept: the prefix whose running signal clears the threshold, at least `min` of them")
    print("| signal | min | threshold | verify rows | accepted drafts | acceptance length |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, name in enumerate(("selector", "lm_head")):
        for least in (1, 0):
            for t in args.thresholds:
                keep = np.maximum((run[:, i] >= t).sum(-1), least) if t > 0 else np.full(blocks, args.k)
                got = np.minimum(acc, keep)
                print(f"| {name} | {least} | {t:g} | {1 + keep.mean():.2f} | {got.mean():.2f} | {1 + got.mean():.2f} |")
    return 0


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    order = np.argsort(score, kind="mergesort")
    s, y = score[order], label[order].astype(bool)
    ranks = np.empty(len(s))
    # Average ranks over ties.
    uniq, start, counts = np.unique(s, return_index=True, return_counts=True)
    for st, c in zip(start, counts):
        ranks[st:st + c] = st + (c + 1) / 2
    pos = y.sum()
    neg = len(y) - pos
    if not pos or not neg:
        return float("nan")
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


if __name__ == "__main__":
    raise SystemExit(main())
