"""Where the drafter's sampled drafts lose acceptance at T > 0: the overlap of its q with the target's p_T.

    python bench/q_calibration.py --requests build/drafter/capture-heldout \
        [--drafter namazu/assets/namazu-tiny/drafter] [--temperatures 0.7 1.0] [--candidates 8 16 32] [--limit 250]

Offline, on held-out captured requests (the target run over each prompt + captured output, the drafter
over a block at every output anchor, both along the captured continuation: `namazu.spec.training.calibrate`'s
estimate, and the engine's, both defined in that module's docstring). Per temperature it prints, per
draft position j:
E[sum_x min(p_T(x), q(x))] with today's q (scale 1) and with the drafter config's `q_temperature_scale`;
how much of p_T the selector's top-K candidates hold (the most any q over them can overlap); and the
expected acceptance length 1 + sum_j prod_{i<=j} alpha_i of each, beside the greedy oracle's
(`bench/spec_ceiling.py`). Then the levers: one scale for every position, scales fitted on this very set
(in-sample: how much of the fit survives on held-out data), more candidates when sampling, and a
re-weighted selector term in q.

Both estimates average over every anchor of an output; a decode visits only the anchors where its verify
steps end, and those lie more often where drafts fail (a step that accepts little moves on little). The
column "the anchors a decode visits" replays that: per output, a chain of verify steps from its first
anchor, each accepting draft j with the overlap alpha_j of its anchor along the capture, moving on by what
it accepted plus one; tokens over steps is what the engine would measure if its path followed the capture (the
engine's own measure, `bench/spec_acceptance.py`, is tokens over verify steps too).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lengths(pos, t: float, scales, k_cand: int) -> str:
    """'along the capture | engine estimate' expected acceptance lengths of q at these scales."""
    from namazu.spec.training import calibrate as cal

    sc = np.asarray(scales, dtype=float)
    along = cal.expected_length(cal.overlap(pos, t, sc, k_cand), pos.valid)
    return f"{along:.3f} | {cal.engine_length(*cal.chain_factors(pos, t, sc, k_cand)):.3f}"


def visited_length(alpha: np.ndarray, valid: np.ndarray, rounds: int = 10, seed: int = 0) -> float:
    """Tokens per verify step of decodes that visit only the anchors their own steps end at (module
    docstring): alpha [A, k] per anchor, the outputs concatenated (an output's last anchor is the one
    with a single position inside it)."""
    rng = np.random.default_rng(seed)
    a = np.where(valid, alpha, 0.0)
    ends = np.flatnonzero(valid.sum(1) == 1)
    tokens = steps = 0
    for _ in range(rounds):
        start = 0
        for end in ends:
            i = start
            while i <= end:
                run = np.cumprod(rng.random(a.shape[1]) < a[i]).sum()     # drafts accepted in a row
                i += int(run) + 1
                steps += 1
            tokens += end + 1 - start
            start = end + 1
    return tokens / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="held-out capture dirs or shard files")
    ap.add_argument("--drafter", default="namazu/assets/namazu-tiny/drafter")
    ap.add_argument("--model", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--candidates", type=int, nargs="+", default=[8, 16, 32],
                    help="candidate counts K to report (the first is taken as the drafter's; the others "
                         "as what sampling over more candidates would give)")
    ap.add_argument("--limit", type=int, default=250)
    args = ap.parse_args(argv)

    import torch

    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.capture import read_records
    from namazu.spec.dflash import DFlashDrafter
    from namazu.spec.training import calibrate as cal
    from namazu.spec.training.train import Target

    torch.set_num_threads(1)
    target_path = str(resolve_model_path(args.model))
    tc = ModelConfig.from_pretrained(target_path)
    drafter = DFlashDrafter.load(args.drafter, tc.vocab_size, tc.hidden_size, tc.num_hidden_layers)
    k_own = drafter.cfg.selector_k
    cands = sorted({k_own, *args.candidates})
    records = [r for _, r in zip(range(args.limit), read_records(args.requests))]
    pos = cal.collect(drafter, Target(target_path, drafter.cfg.target_layers), records, args.temperatures,
                      drafter.cfg.num_draft_tokens, max(cands))
    k = pos.k
    shipped = drafter.cfg.q_temperature_scale or [1.0] * k
    v = pos.valid
    print(f"{len(records)} held-out requests, {int(v.sum()):,} draft positions along the captured outputs; "
          f"drafter {args.drafter}: selector_k={k_own}, q_temperature_scale={shipped}")
    mean = lambda x: " | ".join(f"{x[v[:, j], j].mean():.3f}" for j in range(k))  # noqa: E731
    head = " | ".join(f"j={j + 1}" for j in range(k))
    for t in args.temperatures:
        print(f"\n### T={t:g} (each request's own top-k/top-p/min-p)\n")
        print(f"| measure | {head} | expected acceptance length: every anchor | the anchors a decode visits |")
        print("|---|" + "---:|" * (k + 2))
        rows = [(f"overlap, today's q (scale 1, K={k_own})", cal.overlap(pos, t, 1.0, k_own)),
                (f"overlap, config's scales (K={k_own})", cal.overlap(pos, t, np.asarray(shipped), k_own))]
        rows += [(f"top-{kc} candidates' share of p_T (cap on any q over them)",
                  pos.p[t][:, :, :kc].sum(-1)) for kc in cands]
        rows.append(("greedy oracle: p_T of the target's top token", pos.p_top[t]))
        for name, a in rows:
            print(f"| {name} | {mean(a)} | {cal.expected_length(a, v):.3f} | {visited_length(a, v):.3f} |")

        print(f"\nLevers at T={t:g} (scales multiply T). Expected acceptance length along the captured outputs "
              f"(all requests), and the engine's estimate (`calibrate.engine_length`, over the "
              f"{int(np.isclose(pos.cap_temperature, t).sum()):,} anchors of requests captured at T={t:g}):\n")
        print("| lever | scales | along the capture | engine estimate |")
        print("|---|---|---:|---:|")

        for c in (0.75, 1.0, 1.3, 1.6, 2.0):
            print(f"| one scale, K={k_own} | {c:g} | {lengths(pos, t, c, k_own)} |")
        print(f"| the config's scales, K={k_own} | {shipped} | {lengths(pos, t, shipped, k_own)} |")
        for kc in cands:
            if np.isclose(pos.cap_temperature, t).any():
                fit = cal.fit_scales(pos, [t], kc)
                print(f"| per-position scales fitted in-sample, K={kc} | {[round(c, 2) for c in fit]} | "
                      f"{lengths(pos, t, fit, kc)} |")
        s, u, p = pos.scores[:, :, :k_own], pos.logits[:, :, :k_own], pos.p[t][:, :, :k_own]
        for beta in (0.0, 0.5, 1.0):
            best = max((cal.expected_length(np.minimum(p, cal.softmax((u + beta * (s - u)) / (t * c))).sum(-1), v), c)
                       for c in cal.DEFAULT_GRID)
            print(f"| selector term weighted {beta:g} in q, best one scale, K={k_own} | {best[1]:g} | "
                  f"{best[0]:.3f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
