"""Fit the temperature of the drafter's sampling distribution q per draft position (issue 13).

    python -m namazu.spec.training.calibrate --drafter DIR --data CAPTURE [--target PATH] [--temperatures 0.7]
                                    [--limit N] [--dry-run]

At T > 0 the selector's walk draws draft j from q_j = softmax(s_j / (T * c_j)) over its top-K candidates
(s: the selector's scores, c_j: the drafter config's `q_temperature_scale`), and the verify step accepts
it with probability sum_x min(p_T(x), q_j(x)), p_T the target's distribution after temperature, top-k,
top-p and min-p. The drafter is trained against the target's T=1 distribution from a context it only
partly sees, so its scores are not the target's logits: dividing them by T alone need not give the q that
overlaps p_T most, and how far off it is changes along the block. This command measures the overlap on
captured requests and picks the scales c_j that maximise the expected acceptance length, then writes them
into the drafter's config.json (the weights are untouched).

Two estimates, both from captured requests (the target run over prompt + captured output, the drafter
over a block at every output anchor):
- along the captured continuation (teacher forcing): alpha_j = sum_x min(p_T(x), q_j(x)) with the
  captured tokens as the prefix, and 1 + sum_j prod_{i<=j} alpha_i per anchor. It says where overlap is
  lost, but it is not what the engine gets: there the prefix of draft j is the drafts accepted before it,
  distributed as min(p, q) / alpha, not as p, and a flatter q accepts less likely tokens after which the
  block's later drafts fit worse. Fitted on this estimate the scales came out flatter than the engine's
  best (bench/q_calibration.py).
- the engine's: on requests captured at the temperature T itself (same top-k/top-p/min-p: the captured
  token c_j is a sample of p_T), reweighting the captured path to the path of accepted drafts gives
  E[acceptance length] = 1 + E[sum_j alpha_j * prod_{m<j} min(1, q_m(c_m) / p_T(c_m))]
  (importance weight min(p, q)(c) / (alpha p(c)) per accepted position, times the chance alpha to get
  there), unbiased for the engine's chain from each anchor. The fit maximises this one.
Blocks cut by the end of an output count only the positions inside it. Both average over every anchor of
the output, not over the anchors a decode visits (those lie more often where drafts fail, and the engine
answers anew): the level reads higher than the engine's (2.21 against 1.95 on the same 110 held-out
requests at T=0.7), the differences between scales agree (+0.016 against +0.01). That visiting bias is
all of the gap: `bench/q_calibration.py` replays decodes that visit only the anchors their own steps end
at, and on 250 held-out requests at T=0.7 the 2.55 over every anchor becomes 2.18, against the engine's
2.16 (round 7's drafter).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_config import CONFIG_FILE, DFlashConfig

# Scales tried per position (coordinate ascent picks one per position from these).
DEFAULT_GRID = tuple(round(x, 3) for x in np.exp(np.linspace(math.log(0.25), math.log(4.0), 41)))


def target_probs(logits: torch.Tensor, sampling: dict, temperature: float) -> torch.Tensor:
    """Raw logits [N, V] -> the request's sampling distribution [N, V] at `temperature` with its own top-k,
    top-p and min-p (the sampler's `process_logits`, the one definition)."""
    from namazu.layers.sampler import SamplingTensors, process_logits

    n, v = logits.shape
    full = lambda x, dt=torch.float32: torch.full((n,), x, dtype=dt)  # noqa: E731
    top_k = int(sampling.get("top_k") or 0) or v
    top_p = float(sampling.get("top_p") or 1.0)
    min_p = float(sampling.get("min_p") or 0.0)
    t = SamplingTensors(temperature=full(temperature), top_k=full(top_k, torch.long), top_p=full(top_p),
                        min_p=full(min_p), presence_penalty=full(0.0), frequency_penalty=full(0.0),
                        repetition_penalty=full(1.0), seeds=full(0, torch.long), counters=full(0, torch.long),
                        any_top_k_top_p=top_k < v or top_p < 1.0, any_min_p=min_p > 0)
    return torch.softmax(process_logits(logits.float(), t), dim=-1)


@dataclass
class Positions:
    """Every (anchor, draft position) of some captured outputs, along the captured continuation."""

    scores: np.ndarray                 # [A, k, Kmax] selector scores of the drafter's top-Kmax candidates
    logits: np.ndarray                 # [A, k, Kmax] the drafter's logits of them (scores less the selector's term)
    valid: np.ndarray                  # [A, k] the position lies inside the output
    p: dict[float, np.ndarray] = field(default_factory=dict)     # T -> [A, k, Kmax] p_T at the candidates
    p_top: dict[float, np.ndarray] = field(default_factory=dict)  # T -> [A, k] p_T of the target's top token
    cap_index: np.ndarray | None = None    # [A, k] the captured token's index among the candidates, or -1
    p_cap: dict[float, np.ndarray] = field(default_factory=dict)  # T -> [A, k] p_T of the captured token
    cap_temperature: np.ndarray | None = None   # [A] the temperature its request was captured at

    @property
    def k(self) -> int:
        return self.valid.shape[1]


@torch.no_grad()
def collect(drafter: DFlashDrafter, target, records: list, temperatures: list[float], k: int, k_max: int,
            progress: bool = True) -> Positions:
    """Runs the target over each record's prompt + output and the drafter over a block at every output
    anchor; keeps the selector's scores of the top-`k_max` candidates of each draft position and the
    target's tempered probability of each of them. `target` is `namazu.spec.training.train.Target`."""
    from tqdm import tqdm

    from namazu.spec.training.train import context_kv, draft_hidden

    k = min(k, drafter.cfg.num_draft_tokens)
    vocab = drafter.draft_vocab
    head = drafter.draft_head(target.lm_head)
    if k_max > head.shape[0]:
        raise ValueError(f"--k-max {k_max} exceeds the draft vocabulary's {head.shape[0]} tokens")
    scores, cand_u, valid, cap_index, cap_t = [], [], [], [], []
    p_cap: dict[float, list] = {t: [] for t in temperatures}
    p: dict[float, list] = {t: [] for t in temperatures}
    p_top: dict[float, list] = {t: [] for t in temperatures}
    for rec in tqdm(records, desc="captured requests", unit="req", disable=not progress):
        for out in rec.output_token_ids:
            if len(out) < 2:
                continue
            seq = rec.prompt_token_ids + out
            ids, n, start = torch.tensor(seq), len(seq), len(rec.prompt_token_ids)
            final, captured = target.model(ids.unsqueeze(0), capture_layers=target.layers)
            hidden = [captured[i][0] for i in target.layers]
            logits = target.model.compute_logits(final[0])           # row i predicts token i + 1
            anchors = torch.arange(start, n - 1)                        # each output token but the last
            h = draft_hidden(drafter, target.embed, ids, context_kv(drafter, hidden), anchors)[:, :k]
            cand_logits, cand = (h @ head.T).float().topk(k_max, dim=-1)    # [A, k, Kmax]
            if vocab is not None:
                cand = vocab[cand]
            at = anchors.unsqueeze(1) + torch.arange(k)                 # the predecessor of each position
            inside = at + 1 < n
            prev = ids[at.clamp(max=n - 1)]
            scores.append(drafter.selector.scores(prev, cand, cand_logits, h).numpy())
            cand_u.append(cand_logits.numpy())
            valid.append(inside.numpy())
            tok = ids[(at + 1).clamp(max=n - 1)]                        # the captured token of each position
            hit = cand == tok.unsqueeze(-1)
            cap_index.append(torch.where(hit.any(-1), hit.float().argmax(-1), -1).numpy())
            cap_t.append(np.full(len(anchors), float(rec.sampling.get("temperature") or 0.0)))
            # The target row predicting token at + 1, among the output's rows only (the tempered, filtered
            # distribution of every prompt row would be most of the work).
            row = at.clamp(max=n - 2) - start
            for t in temperatures:
                pt = target_probs(logits[start:n - 1], rec.sampling, t)
                p[t].append(pt[row.unsqueeze(-1), cand].numpy())
                p_top[t].append(pt.max(-1).values[row].numpy())
                p_cap[t].append(pt[row, tok].numpy())
    if not scores:
        raise ValueError("no captured output of at least 2 tokens")
    return Positions(np.concatenate(scores), np.concatenate(cand_u), np.concatenate(valid),
                     {t: np.concatenate(v) for t, v in p.items()}, {t: np.concatenate(v) for t, v in p_top.items()},
                     np.concatenate(cap_index), {t: np.concatenate(v) for t, v in p_cap.items()}, np.concatenate(cap_t))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def overlap(pos: Positions, temperature: float, scale: float | np.ndarray, k_cand: int,
            j: int | None = None) -> np.ndarray:
    """alpha = sum_x min(p_T(x), q(x)) with q = softmax(s / (T * scale)) over the top-`k_cand` candidates:
    [A, k] (scale per position [k] or one), or [A] of position j with one scale."""
    s = pos.scores[:, :, :k_cand] if j is None else pos.scores[:, j, :k_cand]
    p = pos.p[temperature][:, :, :k_cand] if j is None else pos.p[temperature][:, j, :k_cand]
    sc = np.asarray(scale, dtype=np.float64)
    if j is None and sc.ndim:
        sc = sc[None, :, None]
    q = softmax(s / (temperature * sc))
    return np.minimum(p, q).sum(-1)


def expected_length(alpha: np.ndarray, valid: np.ndarray) -> float:
    """Mean over anchors of 1 + sum_j prod_{i<=j} alpha_i, positions outside the output ending the chain."""
    return float(1.0 + np.cumprod(np.where(valid, alpha, 0.0), axis=1).sum(1).mean())


def chain_factors(pos: Positions, temperature: float, scale: float | np.ndarray, k_cand: int,
                  j: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha, beta, valid) [A', k] (or [A'] of position j alone) over the anchors of requests captured at
    `temperature`: alpha_j the overlap of q_j with p_T, beta_j = min(1, q_j(c_j) / p_T(c_j)) the weight
    that moves the captured path to the path of accepted drafts (0 where the captured token is not a
    candidate: no accepted draft is that token)."""
    rows = np.isclose(pos.cap_temperature, temperature)
    cols = slice(None) if j is None else j
    sc = np.asarray(scale, dtype=np.float64)
    if j is not None and sc.ndim:
        sc = sc[j]
    elif sc.ndim:
        sc = sc[None, :, None]
    q = softmax(pos.scores[rows][:, cols, :k_cand] / (temperature * sc))
    alpha = np.minimum(pos.p[temperature][rows][:, cols, :k_cand], q).sum(-1)
    idx = pos.cap_index[rows][:, cols]
    inside = (idx >= 0) & (idx < k_cand)
    q_c = np.take_along_axis(q, np.clip(idx, 0, k_cand - 1)[..., None], -1)[..., 0] * inside
    p_c = pos.p_cap[temperature][rows][:, cols]
    beta = np.where(p_c > 0, np.minimum(1.0, q_c / np.maximum(p_c, 1e-30)), 0.0)
    return alpha, beta, pos.valid[rows]


def engine_length(alpha: np.ndarray, beta: np.ndarray, valid: np.ndarray) -> float:
    """1 + mean over anchors of sum_j alpha_j prod_{m<j} beta_m (module docstring)."""
    if not len(alpha):
        return float("nan")
    a, b = np.where(valid, alpha, 0.0), np.where(valid, beta, 0.0)
    reach = np.cumprod(np.concatenate([np.ones((len(b), 1)), b[:, :-1]], 1), 1)
    return float(1.0 + (a * reach).sum(1).mean())


def fit_scales(pos: Positions, temperatures: list[float], k_cand: int, grid: tuple[float, ...] = DEFAULT_GRID,
               sweeps: int = 3) -> list[float]:
    """Per-position scales from `grid` that maximise the engine's expected acceptance length (`engine_length`)
    averaged over `temperatures`, by coordinate ascent from 1: position j's scale moves alpha_j and beta_j,
    and the length is B_j (alpha_j + beta_j R_j) + terms without them, B_j = prod_{m<j} beta_m (how often j
    is reached) and R_j = sum_{i>j} alpha_i prod_{j<m<i} beta_m (what reaching j + 1 is worth)."""
    k = pos.k
    scales = np.ones(k)
    temps = [t for t in temperatures if np.isclose(pos.cap_temperature, t).any()]
    if not temps:
        raise ValueError(f"no captured request was sampled at any of the temperatures {temperatures}")
    for _ in range(sweeps):
        changed = False
        for j in range(k):
            total = np.zeros(len(grid))
            for t in temps:
                alpha, beta, valid = chain_factors(pos, t, scales, k_cand)
                a, b = np.where(valid, alpha, 0.0), np.where(valid, beta, 0.0)
                before = np.prod(b[:, :j], axis=1)
                after = (a[:, j + 1:] * np.cumprod(np.concatenate([np.ones((len(b), 1)), b[:, j + 1:-1]], 1), 1)
                         ).sum(1) if j + 1 < k else np.zeros(len(a))
                for g, c in enumerate(grid):
                    aj, bj, _ = chain_factors(pos, t, c, k_cand, j)
                    total[g] += float((before * np.where(valid[:, j], aj + bj * after, 0.0)).mean())
            best = float(grid[int(np.argmax(total))])
            if best != scales[j]:
                scales[j], changed = best, True
        if not changed:
            break
    return [float(c) for c in scales]


def summary(pos: Positions, temperature: float, scales: list[float], k_cand: int) -> dict:
    """With and without `scales`: the engine's expected acceptance length (over the requests captured at
    `temperature`), and along the captured continuation (every request) the overlap per position, the
    candidates' share of p_T and the expected length each gives."""
    v = pos.valid
    before = overlap(pos, temperature, 1.0, k_cand)
    after = overlap(pos, temperature, np.asarray(scales), k_cand)
    cover = pos.p[temperature][:, :, :k_cand].sum(-1)
    mean = lambda x: [round(float(x[v[:, j], j].mean()), 4) for j in range(pos.k)]  # noqa: E731
    rows = int(np.isclose(pos.cap_temperature, temperature).sum())
    engine = lambda sc: round(engine_length(*chain_factors(pos, temperature, sc, k_cand)), 4)  # noqa: E731
    return {"temperature": temperature, "candidates": k_cand, "anchors_captured_at_temperature": rows,
            "engine_length_before": engine(1.0), "engine_length_after": engine(np.asarray(scales)),
            "overlap_before": mean(before), "overlap_after": mean(after), "coverage": mean(cover),
            "along_capture_length_before": round(expected_length(before, v), 4),
            "along_capture_length_after": round(expected_length(after, v), 4),
            "along_capture_coverage_cap": round(expected_length(cover, v), 4),
            "oracle_greedy_length": round(expected_length(pos.p_top[temperature], v), 4)}


def write_scales(drafter_dir: str | Path, scales: list[float]) -> None:
    """Sets `q_temperature_scale` in a drafter's config.json, every other field as it was (validated by
    loading it back through DFlashConfig)."""
    file = Path(drafter_dir) / CONFIG_FILE
    d = json.loads(file.read_text())
    d["q_temperature_scale"] = [round(float(c), 4) for c in scales]
    DFlashConfig.from_dict(d)
    file.write_text(json.dumps(d, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m namazu.spec.training.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="drafter checkpoint directory (its config.json is updated)")
    ap.add_argument("--data", nargs="+", required=True, help="capture dirs or shard files to fit on")
    ap.add_argument("--target", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0],
                    help="temperatures the fit maximises the mean expected acceptance length over (the "
                         "scales multiply each request's own temperature, so one set serves them all)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many captured requests (0: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the fit, leave config.json as it is")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.capture import read_records
    from namazu.spec.training.train import Target

    if any(not (t > 0 and math.isfinite(t)) for t in args.temperatures):
        raise SystemExit(f"--temperatures must be positive, got {args.temperatures}")
    target_path = str(resolve_model_path(args.target))
    tc = ModelConfig.from_pretrained(target_path)
    drafter = DFlashDrafter.load(args.drafter, tc.vocab_size, tc.hidden_size, tc.num_hidden_layers)
    target = Target(target_path, drafter.cfg.target_layers)
    records = list(read_records(args.data))
    if args.limit:
        records = records[:args.limit]
    k_cand = drafter.cfg.selector_k
    pos = collect(drafter, target, records, args.temperatures, drafter.cfg.num_draft_tokens, k_cand)
    scales = fit_scales(pos, args.temperatures, k_cand)
    print(f"{len(records)} captured requests, {int(pos.valid.sum()):,} draft positions; "
          f"q_temperature_scale = {[round(c, 3) for c in scales]}")
    for t in args.temperatures:
        print(json.dumps(summary(pos, t, scales, k_cand)))
    if not args.dry_run:
        write_scales(args.drafter, scales)
        print(f"wrote q_temperature_scale to {Path(args.drafter) / CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
