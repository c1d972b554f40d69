"""Tokens per verify step of draft trees against the chain, offline, on held-out captured requests.

    python bench/tree_acceptance.py --requests build/drafter/capture-heldout \
        [--drafter namazu/assets/namazu-tiny/drafter] [--limit 250] [--budgets 6 12 24] [--widths 2 4]

The target is run over each captured prompt + output and the shipped drafter over a block at every output
anchor (`namazu.spec.training.calibrate.collect`, the offline pass `bench/q_calibration.py` uses): per
anchor and draft position, the selector's 32 candidates after the captured previous token, their scores
(so q of the node on the captured path, with the config's `q_temperature_scale`), and the target's p_T
there with the request's own top-k/top-p/min-p.

Why this is the engine's number and not an estimate of a different one: the tree rule is lossless, so the
tokens a decode emits are distributed as the captured ones (plain sampling at the request's settings), and
given those tokens the verify steps' acceptance pattern has a law we can compute along the capture. At a
node on the captured path whose next captured token is c, the chance that the r-th child is accepted and
is c is E[1{x_r = c} a_r prod_{i<r} (1 - a_i)] over the children's draws without replacement from q (a_i
the rule's acceptance probability min(1, p_i(x_i) / q_i(x_i)) with the residuals of `spec/tree_verify.py`),
and divided by p(c) it is the chance of "accepted at rank r" given that the output is c. It is estimated
by averaging that product over --draws draws of the children (exact per draw; rank 0 in closed form:
min(1, q(c) / p(c)), the chain's weight). At T = 0 (greedy captures) a child is accepted exactly when it
is the captured token (the target's argmax), so its rank is known.

Per output a decode is replayed from its first anchor: each verify step walks the tree along the capture,
accepting rank r with those chances, and moves on by what it accepted plus one (the column "tokens per
verify step"; `bench/q_calibration.py`'s "anchors a decode visits" for the chain). Each temperature uses
the requests captured at it (the held-out set mixes T = 0, 0.7 with top-p 0.9, and 1.0). A tree's shape
for a budget is `TreeTopology.build` from the chances per (depth, rank) measured here on the same requests
(printed): in-sample, but a shape is a few integers.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_chances(q: np.ndarray, p: np.ndarray, c: np.ndarray, draws: int, seed: int = 0,
                 chunk: int = 256, later_order: np.ndarray | None = None) -> np.ndarray:
    """[N, W]: P(accepted at rank r | output c) at N nodes whose r-th child is drawn from q[r] [W, N, K]
    without the earlier children (one q for all ranks: plain draws without replacement), p [N, K] the
    target's mass on the same candidates (the rest lies outside them) and c [N] the captured token's
    candidate index (>= 0). `later_order` [N, K] (candidates by score): the children after the first are
    not drawn but taken, each the best-scored candidate not yet drafted, as one-hot drafts (the rule then
    accepts one with its residual's p at it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    width = q.shape[0]
    out = np.zeros((q.shape[1], width))
    for a in range(0, q.shape[1], chunk):
        qr = torch.as_tensor(q[:, a:a + chunk], dtype=torch.float64)                # [W, n, K]
        pt = torch.as_tensor(p[a:a + chunk], dtype=torch.float64)
        ct = torch.as_tensor(c[a:a + chunk])
        n, k = pt.shape
        # p over the candidates plus one bucket for everything else (q is zero there).
        pi = torch.cat([pt, (1 - pt.sum(-1, keepdim=True)).clamp_min(0)], -1).unsqueeze(1).repeat(1, draws, 1)
        p_c = pt.gather(1, ct.unsqueeze(-1))                                          # [n, 1]
        drawn = torch.zeros(n, draws, k + 1, dtype=torch.bool)
        drawn[..., k] = True                                                          # never drafted
        still = torch.ones(n, draws, dtype=torch.float64)                            # prod of (1 - a_i) so far
        if later_order is not None:
            place = torch.full((n, k + 1), k + 1, dtype=torch.long)        # each candidate's place by score
            order = torch.as_tensor(later_order[a:a + chunk])
            place[:, :k].scatter_(1, order, torch.arange(k).expand(n, k).contiguous())
        for r in range(width):
            if r and later_order is not None:
                x = place.unsqueeze(1).expand(n, draws, k + 1).masked_fill(drawn, k + 2).argmin(-1, keepdim=True)
                qi = torch.zeros(n, draws, k + 1, dtype=torch.float64).scatter_(2, x, 1.0)
            else:
                qk = torch.cat([qr[r], torch.zeros(n, 1, dtype=torch.float64)], -1).unsqueeze(1).expand(n, draws, k + 1)
                qi = qk.masked_fill(drawn, 0.0)
                qi = qi / qi.sum(-1, keepdim=True).clamp_min(1e-300)
                u = torch.rand(n, draws, k + 1, generator=g, dtype=torch.float64).clamp_min(1e-300)
                x = (qi.clamp_min(1e-300).log().masked_fill(drawn, -np.inf) - (-u.log()).log()).argmax(-1, keepdim=True)
            p_x, q_x = pi.gather(2, x).squeeze(-1), qi.gather(2, x).squeeze(-1)
            acc = torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-300)).clamp(max=1.0), torch.zeros_like(q_x))
            hit = (x.squeeze(-1) == ct.unsqueeze(-1)).double()
            out[a:a + n, r] = ((hit * acc * still).mean(1, keepdim=True) / p_c.clamp_min(1e-300)).squeeze(-1).numpy()
            still = still * (1 - acc)
            res = (pi - qi).clamp_min(0)
            pi = res / res.sum(-1, keepdim=True).clamp_min(1e-300)
            drawn = drawn.scatter(2, x, True)
    # Rank 0 in closed form (the chain's weight); a sum over ranks above 1 is draw noise.
    idx = np.arange(q.shape[1])
    out[:, 0] = np.minimum(1.0, q[0, idx, c] / np.maximum(p[idx, c], 1e-300))
    total = out.sum(1, keepdims=True)
    return np.where(total > 1, out / np.maximum(total, 1.0), out)


def top_p_cut(q: np.ndarray, top_p: float) -> np.ndarray:
    """q [..., K] restricted to its own nucleus (the fewest most likely candidates holding top_p), renormalised."""
    order = np.argsort(-q, -1, kind="stable")
    qs = np.take_along_axis(q, order, -1)
    keep = np.zeros(q.shape, dtype=bool)
    np.put_along_axis(keep, order, np.cumsum(qs, -1) - qs < top_p, -1)
    out = np.where(keep, q, 0.0)
    return out / out.sum(-1, keepdims=True)


def chances(pos, t: float, scales: list[float], width: int, draws: int, top_drafts: bool = False,
            sibling_scales: list[float] | None = None, later_one_hot: bool = False,
            q_top_p: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(g [A, k, width] P(accepted at rank r | the captured token) per anchor and position, valid [A, k])
    over the anchors of requests captured at t; `top_drafts`: the children are the top-W candidates by
    score rather than draws from q; `sibling_scales[r]`: the r-th child drawn at temperature T * scale (the
    last repeats; None: every child from the same q); `later_one_hot`: the first child drawn from q, the
    later ones the best-scored candidates left (`rank_chances`); `q_top_p`: q cut to its own nucleus (the
    requests' top-p), for the chain and every child."""
    from namazu.spec.training.calibrate import softmax

    rows = np.isclose(pos.cap_temperature, t)
    s, idx, valid = pos.scores[rows], pos.cap_index[rows], pos.valid[rows]
    a, k, kc = s.shape
    g = np.zeros((a, k, width))
    inside = valid & (idx >= 0)
    if t == 0 or top_drafts:
        # Greedy, or drafts that are the top candidates by score at T > 0 (q one-hot per sibling: the rule
        # accepts the r-th with p_r(x_r), p less the earlier siblings, so P(accepted at r, output c) is
        # p(c) where x_r = c): the captured token's rank among the children decides.
        order = np.argsort(-s, -1, kind="stable")
        rank = np.argmax(order == np.maximum(idx, 0)[..., None], -1)
        for r in range(width):
            g[..., r] = inside & (rank == r)
        return g, valid
    sib = list(sibling_scales or [1.0]) + [sibling_scales[-1] if sibling_scales else 1.0] * width
    q = np.stack([softmax(s / (t * sib[r] * np.asarray(scales)[None, :, None])).reshape(-1, kc) for r in range(width)])
    if q_top_p is not None:
        q = top_p_cut(q, q_top_p)
    p = pos.p[t][rows]
    flat = np.flatnonzero(inside.reshape(-1))
    order = np.argsort(-s.reshape(-1, kc)[flat], -1, kind="stable") if later_one_hot else None
    got = rank_chances(q[:, flat], p.reshape(-1, kc)[flat], idx.reshape(-1)[flat], draws, later_order=order)
    g.reshape(-1, width)[flat] = got
    return g, valid


def replay(topo, g: np.ndarray, valid: np.ndarray, rounds: int = 10, seed: int = 0) -> tuple[float, float]:
    """(tokens per verify step of decodes replayed along the captures, expected accepted + 1 per step over
    every anchor) for one topology (module docstring)."""
    rng = np.random.default_rng(seed)
    children = [[-1] * topo.width for _ in topo.parents]
    for i, p in enumerate(topo.parents):
        if p >= 0:
            children[p][topo.ranks[i]] = i
    depth = min(topo.depth, g.shape[1])
    gv = np.where(valid[..., None], g, 0.0)
    # Every anchor: 1 + the sum over nodes of the chance that the node lies on the accepted path.
    reach = np.zeros((len(g), len(topo.parents)))
    reach[:, 0] = 1.0
    for i, p in enumerate(topo.parents):
        if p >= 0 and topo.depths[i] <= depth:
            reach[:, i] = reach[:, p] * gv[:, topo.depths[i] - 1, topo.ranks[i]]
    every = float(reach.sum(1).mean())
    ends = np.flatnonzero(valid.sum(1) == 1)
    tokens = steps = 0
    for _ in range(rounds):
        start = 0
        for end in ends:
            i = start
            while i <= end:
                node, m = 0, 0
                for d in range(depth):
                    u, acc = rng.random(), 0.0
                    nxt = -1
                    for r, child in enumerate(children[node]):
                        if child < 0:
                            continue
                        acc += gv[i, d, r]
                        if u < acc:
                            nxt = child
                            break
                    if nxt < 0:
                        break
                    node, m = nxt, m + 1
                i += m + 1
                steps += 1
            tokens += end + 1 - start
            start = end + 1
    return tokens / max(steps, 1), every


def _rates(g: np.ndarray, valid: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """Mean chance per (depth, rank) over the positions inside their outputs: what `TreeTopology.build`
    shapes a tree from."""
    return tuple(tuple(float(g[:, d, r][valid[:, d]].mean()) for r in range(g.shape[2])) for d in range(g.shape[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", nargs="+", required=True, help="held-out capture dirs or shard files")
    ap.add_argument("--drafter", default="namazu/assets/namazu-tiny/drafter")
    ap.add_argument("--model", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--limit", type=int, default=250)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[6, 12, 24], help="draft nodes per tree")
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--draws", type=int, default=512, help="draws of the children per node (the estimate)")
    ap.add_argument("--sibling-scales", type=float, nargs="+", default=None,
                    help="also trees whose r-th child is drawn at T * scale[r] (the last repeats)")
    ap.add_argument("--later-one-hot", action="store_true",
                    help="also trees whose children after the first are the best-scored candidates left, one-hot")
    ap.add_argument("--q-top-p", type=float, default=None, metavar="P",
                    help="also the chain and trees with q cut to its own top-P nucleus (P: the requests' top-p)")
    ap.add_argument("--candidates", type=int, default=None,
                    help="candidates per position q spans, for every setup (default: the drafter's selector_k; "
                         "more is a lever the drafter was not trained for)")
    ap.add_argument("--positions-cache", default=None,
                    help="keep the offline target/drafter pass in this file and reuse it (same requests only)")
    args = ap.parse_args(argv)

    import torch

    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.spec.capture import read_records
    from namazu.spec.dflash import DFlashDrafter
    from namazu.spec.training import calibrate as cal
    from namazu.spec.training.train import Target
    from namazu.spec.tree import TreeTopology

    torch.set_num_threads(1)
    target_path = str(resolve_model_path(args.model))
    tc = ModelConfig.from_pretrained(target_path)
    drafter = DFlashDrafter.load(args.drafter, tc.vocab_size, tc.hidden_size, tc.num_hidden_layers)
    k = drafter.cfg.num_draft_tokens
    scales = drafter.cfg.q_temperature_scale or [1.0] * k
    records = [r for _, r in zip(range(args.limit), read_records(args.requests))]
    sampled = sorted({t for t in args.temperatures if t > 0})
    kc = args.candidates or drafter.cfg.selector_k
    if args.positions_cache and os.path.exists(args.positions_cache):
        with open(args.positions_cache, "rb") as f:
            pos = pickle.load(f)
    else:
        pos = cal.collect(drafter, Target(target_path, drafter.cfg.target_layers), records, sampled, k, kc)
        if args.positions_cache:
            with open(args.positions_cache, "wb") as f:
                pickle.dump(pos, f)
    if pos.scores.shape[2] < kc:
        raise SystemExit(f"--positions-cache {args.positions_cache} holds {pos.scores.shape[2]} candidates, not {kc}")
    # Every setup, the chain included, draws over the top-kc candidates (the drafter's own K unless told).
    pos.scores, pos.logits = pos.scores[:, :, :kc], pos.logits[:, :, :kc]
    pos.p = {t: x[:, :, :kc] for t, x in pos.p.items()}
    pos.cap_index = np.where(pos.cap_index < kc, pos.cap_index, -1)
    wmax = max(args.widths)
    counts = {t: sum(np.isclose(float(r.sampling.get("temperature") or 0.0), t) for r in records)
              for t in args.temperatures}
    print(f"{len(records)} held-out requests ({', '.join(f'{n} at T={t:g}' for t, n in counts.items())}), "
          f"drafter {args.drafter}: {k} draft positions, selector_k={drafter.cfg.selector_k}, drafts over the top "
          f"{kc} candidates, "
          f"q_temperature_scale={scales}, {args.draws} draws per node\n")
    setups = [("chain", 1, k)] + [(f"tree W={w}", w, b) for w in args.widths for b in args.budgets]
    setups += [(f"tree W={w}, top-W drafts (q one-hot)", w, b) for w in args.widths for b in args.budgets]
    if args.sibling_scales:
        setups += [(f"tree W={w}, siblings at T x {args.sibling_scales}", w, b) for w in args.widths
                   for b in args.budgets]
    if args.later_one_hot:
        setups += [(f"tree W={w}, later siblings one-hot", w, b) for w in args.widths for b in args.budgets]
    if args.q_top_p is not None:
        setups += [(f"chain, q cut to top-p {args.q_top_p:g}", 1, k)]
        setups += [(f"tree W={w}, q cut to top-p {args.q_top_p:g}", w, b) for w in args.widths for b in args.budgets]
    results: dict[tuple[str, int], dict[float, tuple[float, float]]] = {}
    rates_by_t = {}
    for t in args.temperatures:
        g, valid = chances(pos, t, scales, wmax, args.draws)
        top_g = g if t == 0 else chances(pos, t, scales, wmax, args.draws, top_drafts=True)[0]
        rates = _rates(g, valid)
        rates_by_t[t] = rates
        sib_g = (chances(pos, t, scales, wmax, args.draws, sibling_scales=args.sibling_scales)[0]
                 if args.sibling_scales and t > 0 else g)
        hot_g = chances(pos, t, scales, wmax, args.draws, later_one_hot=True)[0] \
            if args.later_one_hot and t > 0 else g
        cut_g = chances(pos, t, scales, wmax, args.draws, q_top_p=args.q_top_p)[0] \
            if args.q_top_p is not None and t > 0 else g
        for name, w, b in setups:
            gg = (top_g if "top-W" in name else sib_g if "siblings at" in name else hot_g if "one-hot" in name
                  else cut_g if "top-p" in name else g)
            topo = TreeTopology.chain(k) if w == 1 else TreeTopology.build(b, k, w, _rates(gg, valid))
            results.setdefault((name, b), {})[t] = replay(topo, gg, valid)
    cols = " | ".join(f"T={t:g}" for t in args.temperatures)
    print("Tokens per verify step, decodes replayed along the captures (x the chain):\n")
    print(f"| setup | draft nodes (verify rows - 1) | {cols} |")
    print("|---|---:|" + "---:|" * len(args.temperatures))
    chain = results[("chain", k)]
    for name, _, b in setups:
        r = results[(name, b)]
        cells = " | ".join(f"{r[t][0]:.3f} ({r[t][0] / chain[t][0]:.2f}x)" for t in args.temperatures)
        print(f"| {name} | {b} | {cells} |")
    print("\nExpected tokens per verify step over every anchor (x the chain):\n")
    print(f"| setup | draft nodes | {cols} |")
    print("|---|---:|" + "---:|" * len(args.temperatures))
    for name, _, b in setups:
        r = results[(name, b)]
        cells = " | ".join(f"{r[t][1]:.3f} ({r[t][1] / chain[t][1]:.2f}x)" for t in args.temperatures)
        print(f"| {name} | {b} | {cells} |")
    print("\nWhat caps a tree at T > 0: per depth, the target's p_T on the selector's candidates (no draft can be "
          "another token) against q's overlap with it (the chain's acceptance), requests captured at T:\n")
    for t in sampled:
        rows = np.isclose(pos.cap_temperature, t)
        v = pos.valid[rows]
        share = pos.p[t][rows].sum(-1)
        q = cal.softmax(pos.scores[rows] / (t * np.asarray(scales)[None, :, None]))
        ov = np.minimum(pos.p[t][rows], q).sum(-1)
        print(f"  T={t:g} candidates' share: " + " ".join(f"{share[:, j][v[:, j]].mean():.3f}" for j in range(k))
              + " | overlap: " + " ".join(f"{ov[:, j][v[:, j]].mean():.3f}" for j in range(k)))
    for t, rates in rates_by_t.items():
        print(f"\nT={t:g}: chance that the rank-r child is accepted, its parent on the path (rows: depth 1..{k}):")
        for d, row in enumerate(rates):
            print(f"  depth {d + 1}: " + "  ".join(f"{x:.3f}" for x in row))
        for w in args.widths:
            for b in args.budgets:
                print(f"  W={w} budget {b}: parents {TreeTopology.build(b, k, w, rates).parents}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
