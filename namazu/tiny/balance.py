"""Routing-bias calibration on corpus text: the auxiliary-loss-free balancing rule without weight updates.

    python -m namazu.tiny.balance --model namazu/assets/namazu-tiny

Training balances the experts on the training mix, where chat and tool-call rows are a large share; on
plain text some experts then run cold. This runs DeepSeek-V3's bias update (bias += rate * sign(mean load
- load)) over forward passes of train-split text only, with a rate decaying linearly to a tenth, and
writes the checkpoint back. Weights other than the correction biases are untouched.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from namazu.models.checkpoint import save_checkpoint
from namazu.models.loader import load_model
from namazu.models.training import load_imbalance, update_routing_biases
from namazu.tiny.corpus import default_corpus_dir, read_documents
from namazu.tiny.dataset import encode_documents
from namazu.tiny.tokenizer import load_tokenizer
from namazu.tiny.train import prepare_for_training

log = logging.getLogger(__name__)


@torch.no_grad()
def _min_share(load: torch.Tensor) -> float:
    return float((load / load.sum(-1, keepdim=True).clamp_min(1)).min())


def calibrate_routing(model, streams: dict[str, torch.Tensor], shares: dict[str, float], steps: int, rate: float,
                      batch_size: int, seq_len: int, seed: int) -> dict[str, Any]:
    """Bias-only balancing steps over random text windows; returns the load statistics before and after."""
    gen = torch.Generator().manual_seed(seed)
    langs = list(shares)
    probs = torch.tensor([shares[k] for k in langs], dtype=torch.float64)
    model.train()
    history = []
    for step in tqdm(range(steps), desc="routing calibration", mininterval=5):
        picks = torch.multinomial(probs, batch_size, replacement=True, generator=gen).tolist()
        rows = []
        for p in picks:
            s = streams[langs[p]]
            start = int(torch.randint(0, len(s) - seq_len, (1,), generator=gen))
            rows.append(s[start:start + seq_len].long())
        # Autograd on (no backward): TorchExperts' grouped path, far faster than its per-token decode path.
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.stack(rows))
        r = rate * (1 - 0.9 * step / max(1, steps - 1))
        load = update_routing_biases(model, r)
        history.append({"step": step, "rate": r, "imbalance": load_imbalance(load), "min_share": _min_share(load)})
    model.eval()
    return {"steps": steps, "rate": rate, "batch_size": batch_size, "seq_len": seq_len, "seed": seed,
            "shares": shares, "first": history[0], "last": history[-1]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Calibrate namazu-tiny's routing biases on corpus text.")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    corpus = args.corpus or default_corpus_dir()
    tok = load_tokenizer(args.model)
    streams = {lang: encode_documents(tok, read_documents(corpus, lang, "train")) for lang in ("ja", "en")}
    model = prepare_for_training(load_model(args.model, dtype=torch.float32, progress=False))
    # Text shares as in training (ja 0.55 : en 0.15 of the text rows).
    res = calibrate_routing(model, streams, {"ja": 0.8, "en": 0.2}, args.steps, args.rate, args.batch_size,
                            args.seq_len, args.seed)
    save_checkpoint(model, args.model, dtype=torch.bfloat16)
    log_path = args.model / "train_log.json"
    if log_path.exists():
        train_log = json.loads(log_path.read_text())
        train_log["routing_calibration"] = res
        log_path.write_text(json.dumps(train_log, indent=1) + "\n")
    print(f"routing calibration: {args.steps} steps; imbalance {res['first']['imbalance']:.2f} -> "
          f"{res['last']['imbalance']:.2f}, lowest expert share {res['first']['min_share']:.4f} -> "
          f"{res['last']['min_share']:.4f}")


if __name__ == "__main__":
    main()
