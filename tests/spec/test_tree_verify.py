"""Tree verification is lossless: at T=1 the emitted tokens follow the target's p (next token and the
two-token joint, trees of several widths, with top-p and with a grammar mask), at T=0 they are greedy
decoding's, and the chain is the width-1 tree."""
import pytest
import torch
from sampling_cases import tensors
from scipy.stats import chi2

from namazu.layers.sampler import Sampler, pack_bitmask, process_logits
from namazu.spec.tree import TreeTopology, draft_tree
from namazu.spec.tree_verify import verify_tree
from namazu.spec.verify import verify_stochastic

V, K = 8, 6          # toy vocabulary; candidates per position (two tokens are never drafted)


class Toy:
    """A target whose next-token logits depend on the last token only (a table [V, V], the context's own
    row for the root), and a drafter's selector tables over K candidates per position."""

    def __init__(self, depth: int, seed: int, top_p: float = 1.0, banned: tuple[int, ...] = ()):
        g = torch.Generator().manual_seed(seed)
        self.root_logits = torch.randn(V, generator=g) * 1.5
        self.table = torch.randn(V, V, generator=g) * 1.5
        self.top_p, self.banned = top_p, banned
        # The drafter's candidates per position (a fixed subset) and its scores: far from the target's, so
        # that first draws are often rejected and later siblings decide much of the output.
        self.cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(depth)])
        self.first = torch.randn(K, generator=g) * 2.0
        self.pairs = torch.randn(max(depth - 1, 1), K, K, generator=g) * 2.0

    def processed(self, raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """The sampler's processing of raw logits [S, V] (top-p, grammar mask)."""
        s = raw.shape[0]
        allowed = torch.ones(s, V, dtype=torch.bool)
        allowed[:, list(self.banned)] = False
        t = tensors(s, V, top_p=torch.full((s,), self.top_p), temperature=torch.full((s,), temperature),
                    any_top_k_top_p=self.top_p < 1.0, bitmask=pack_bitmask(allowed) if self.banned else None,
                    all_greedy=temperature == 0)
        return process_logits(raw, t)

    def p_root(self) -> torch.Tensor:
        return self.processed(self.root_logits.unsqueeze(0)).softmax(-1)[0]

    def p_next(self) -> torch.Tensor:
        return self.processed(self.table).softmax(-1)               # [V, V] p(. | last token)

    def step(self, tt, root_raw: torch.Tensor, anchor: torch.Tensor, seeds: torch.Tensor, base: torch.Tensor,
             temperature: float = 1.0):
        """One verify step of S sequences from a root whose raw logits are root_raw [S, V]."""
        s = root_raw.shape[0]
        cand = self.cand.expand(s, -1, -1)
        temp = torch.full((s,), temperature)
        tree = draft_tree(tt, cand, self.first.expand(s, -1), self.pairs.expand(s, -1, -1, -1), anchor,
                          temp if temperature > 0 else None, seeds, base)
        raw = self.table[tree.tokens]                                   # [S, R, V] each node's next-token logits
        raw[:, 0] = root_raw
        r = raw.shape[1]
        processed = self.processed(raw.reshape(-1, V), temperature).view(s, r, V)
        rows = tensors(s * r, V, seeds=seeds.repeat_interleave(r), temperature=torch.full((s * r,), temperature),
                       counters=(base.unsqueeze(-1) + tt.depths).reshape(-1), all_greedy=temperature == 0)
        target_tokens = Sampler()(processed.reshape(-1, V), rows).token_ids.view(s, r)
        greedy = torch.full((s,), temperature == 0)
        return tree, processed, target_tokens, verify_tree(tt, tree, processed, target_tokens, greedy, seeds, base)


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, str]:
    """Pearson's test of counts against probs (bins expected under 5 pooled), at p = 0.0005."""
    n = counts.sum()
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return stat < chi2.ppf(1 - 5e-4, df), f"chi2 {stat:.1f} over {df} dof"


TREES = {"chain": TreeTopology.chain(3), "w2": TreeTopology.build(8, 3, 2), "w4": TreeTopology.build(12, 3, 4),
         "w4-flat": TreeTopology((-1, 0, 0, 0, 0, 1, 1, 1, 1)),
         # As wide as the candidates (trees are up to 8 wide): a node can draft every candidate, and after all
         # are rejected the residual lies on the two tokens never drafted.
         "w6": TreeTopology.build(30, 3, 6)}
SETTINGS = {"plain": {}, "top-p": {"top_p": 0.8}, "grammar": {"banned": (1, 4)}}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("tree", list(TREES))
def test_emitted_tokens_follow_the_target_at_t1(tree, setting):
    """Next token and the two-token joint (the second token from the same step when a draft was accepted,
    else from the next step) against p(y1) p(y2 | y1)."""
    toy = Toy(depth=3, seed=1, **SETTINGS[setting])
    tt = TREES[tree].tensors()
    s = 40000
    seeds = torch.arange(s, dtype=torch.long) * 104729 + 17
    base = torch.full((s,), 5, dtype=torch.long)
    anchor = torch.zeros(s, dtype=torch.long)
    _, _, _, first = toy.step(tt, toy.root_logits.expand(s, V), anchor, seeds, base)
    y1 = first.tokens[:, 0]
    # Where nothing was accepted the step ended at y1: the next step starts there, one output index later.
    _, _, _, second = toy.step(tt, toy.table[y1], y1, seeds, base + 1)
    y2 = torch.where(first.num_accepted >= 1, first.tokens[:, 1], second.tokens[:, 0])
    p1, p2 = toy.p_root(), toy.p_next()
    ok, why = _chi2_ok(torch.bincount(y1, minlength=V), p1)
    assert ok, f"next token: {why}"
    ok, why = _chi2_ok(torch.bincount(y1 * V + y2, minlength=V * V), (p1.unsqueeze(-1) * p2).flatten())
    assert ok, f"two-token joint: {why}"
    # The banned tokens and those top-p removed are never emitted, drafted or not.
    assert (p1[y1] > 0).all() and (p2[y1, y2] > 0).all()
    # Drafts do get accepted, at later ranks too: the rule, not the fallback, shapes the output.
    assert (first.num_accepted > 0).float().mean() > 0.2
    if TREES[tree].width > 1:
        ranks = tt.ranks[first.path[:, 0].clamp_min(0)]
        assert ((first.path[:, 0] >= 0) & (ranks > 0)).float().mean() > 0.02


def test_a_deeper_accepted_token_follows_the_target_given_the_path():
    """Given the accepted path's first token, the second emitted token of the same step (accepted or the
    bonus) follows p(. | y1): the rule is lossless below the root too."""
    toy = Toy(depth=3, seed=4)
    tt = TREES["w4"].tensors()
    s = 60000
    seeds = torch.arange(s, dtype=torch.long) * 7919 + 3
    _, _, _, out = toy.step(tt, toy.root_logits.expand(s, V), torch.zeros(s, dtype=torch.long), seeds,
                            torch.zeros(s, dtype=torch.long))
    took = out.num_accepted >= 1
    y1, y2 = out.tokens[took, 0], out.tokens[took, 1]
    p2 = toy.p_next()
    for a in range(V):
        sel = y1 == a
        if sel.sum() > 2000:
            ok, why = _chi2_ok(torch.bincount(y2[sel], minlength=V), p2[a])
            assert ok, f"after {a}: {why}"


def test_children_are_draws_without_replacement_from_q():
    """The first two children of the root: P(x1, x2) = q(x1) q(x2) / (1 - q(x1))."""
    toy = Toy(depth=1, seed=2)
    tt = TreeTopology((-1, 0, 0, 0)).tensors()
    s = 50000
    seeds = torch.arange(s, dtype=torch.long) * 31 + 1
    tree = draft_tree(tt, toy.cand.expand(s, -1, -1), toy.first.expand(s, -1), toy.pairs.expand(s, -1, -1, -1),
                      torch.zeros(s, dtype=torch.long), torch.ones(s), seeds, torch.zeros(s, dtype=torch.long))
    q = toy.first.softmax(-1)
    assert torch.allclose(tree.child_q[:, 0], q.expand(s, -1), atol=1e-6)
    i1, i2 = tree.cand_index[:, 1], tree.cand_index[:, 2]
    assert (i1 != i2).all() and (tree.cand_index[:, 3] != i1).all()
    want = q.unsqueeze(-1) * q.unsqueeze(0) / (1 - q.unsqueeze(-1))
    want.fill_diagonal_(0)
    ok, why = _chi2_ok(torch.bincount(i1 * K + i2, minlength=K * K), want.flatten())
    assert ok, why
    assert torch.equal(tree.tokens[:, 1], toy.cand[0][i1])


def test_greedy_rows_take_the_longest_path_matching_the_targets_argmax():
    toy = Toy(depth=3, seed=3)
    for topo in TREES.values():
        tt = topo.tensors()
        s = 64
        seeds = torch.arange(s, dtype=torch.long)
        g = torch.Generator().manual_seed(5)
        roots = torch.randn(s, V, generator=g) * 2
        anchor = torch.randint(0, V, (s,), generator=g)
        tree, processed, target, out = toy.step(tt, roots, anchor, seeds, torch.zeros(s, dtype=torch.long), 0.0)
        # Children at T=0: the top-W candidates by score, in order.
        assert torch.equal(tree.cand_index[:, 1:topo.width + 1][:, :len(tt.levels[0].kid_rank)],
                           toy.first.topk(topo.width).indices[:len(tt.levels[0].kid_rank)].expand(s, -1))
        for i in range(s):
            # Greedy decoding from the root, and the deepest node of the tree that spells its prefix.
            want, node = [], 0
            while True:
                nxt = int(processed[i, node].argmax())
                want.append(nxt)
                kids = [c for c in tt.children[node].tolist() if c >= 0 and int(tree.tokens[i, c]) == nxt]
                if not kids:
                    break
                node = kids[0]
            n = int(out.num_accepted[i])
            assert n == len(want) - 1
            assert out.tokens[i, :n + 1].tolist() == want
            assert all(int(target[i, c]) == int(processed[i, c].argmax()) for c in range(tt.parents.shape[0]))


def test_the_exact_only_walk_gives_the_general_walks_verdict():
    """`all_exact` (every row greedy: a batch at T = 0) skips the walk's distributions; its verdict is the
    general walk's on such rows, with prefixes of the tree (num_nodes) and depth limits too."""
    toy = Toy(depth=3, seed=4)
    g = torch.Generator().manual_seed(9)
    for topo in TREES.values():
        tt = topo.tensors()
        s = 400
        seeds, base = torch.arange(s, dtype=torch.long), torch.zeros(s, dtype=torch.long)
        tree, processed, target, _ = toy.step(tt, torch.randn(s, V, generator=g) * 2,
                                              torch.randint(0, V, (s,), generator=g), seeds, base, 0.0)
        # Targets that mostly match one of the node's children, a later sibling as often as the first draw.
        kid = tt.children[torch.arange(len(topo.parents)), torch.randint(0, topo.width, (s, len(topo.parents)),
                                                                          generator=g)]            # [S, R]
        match = (kid >= 0) & (torch.rand(kid.shape, generator=g) < 0.8)
        target = torch.where(match, tree.tokens.gather(1, kid.clamp_min(0)), target)
        greedy = torch.ones(s, dtype=torch.bool)
        for limits in ({}, {"num_nodes": torch.randint(0, topo.num_nodes + 1, (s,), generator=g),
                            "max_depth": torch.randint(0, topo.depth + 1, (s,), generator=g)}):
            want = verify_tree(tt, tree, processed, target, greedy, seeds, base, **limits)
            got = verify_tree(tt, tree, processed, target, greedy, seeds, base, all_exact=True, **limits)
            # Exact: verdicts are integer tensors (paths, tokens, counts) picked from the same target tokens.
            assert all(torch.equal(a, b) for a, b in zip(got, want)), topo
            assert want.num_accepted.float().mean() > 0.3


def test_the_chain_is_the_width_one_tree():
    """With the same drafts and q, the width-1 tree gives exactly the chain rule's tokens."""
    toy = Toy(depth=4, seed=6, top_p=0.9)
    tt = TreeTopology.chain(4).tensors()
    s = 4000
    seeds = torch.arange(s, dtype=torch.long) * 13 + 2
    base = torch.full((s,), 3, dtype=torch.long)
    g = torch.Generator().manual_seed(8)
    tree, processed, target, out = toy.step(tt, torch.randn(s, V, generator=g), torch.zeros(s, dtype=torch.long),
                                            seeds, base)
    k = 4
    # The chain's dense q of draft j: its parent's child distribution, scattered over the vocabulary.
    q = torch.zeros(s, k, V).scatter_(2, tree.child_ids[:, :k], tree.child_q[:, :k])
    counters = base.unsqueeze(-1) + torch.arange(k + 1)
    tokens, n = verify_stochastic(processed, target, tree.tokens[:, 1:], q, torch.full((s,), k),
                                  torch.zeros(s, dtype=torch.bool), seeds, counters,
                                  seeded=torch.zeros(s, dtype=torch.bool))
    assert torch.equal(n, out.num_accepted)
    j = torch.arange(k + 1)
    emitted = j <= n.unsqueeze(-1)
    assert torch.equal(tokens[emitted], out.tokens[emitted])
    assert 0 < n.float().mean() < k


def test_depth_limit_per_row():
    """A row allowed fewer tokens (max_depth) never accepts past it."""
    toy = Toy(depth=3, seed=7)
    tt = TREES["w2"].tensors()
    s = 2000
    seeds = torch.arange(s, dtype=torch.long)
    base = torch.zeros(s, dtype=torch.long)
    tree, processed, target, _ = toy.step(tt, toy.root_logits.expand(s, V), torch.zeros(s, dtype=torch.long),
                                          seeds, base)
    limit = torch.arange(s) % 4
    out = verify_tree(tt, tree, processed, target, torch.zeros(s, dtype=torch.bool), seeds, base, limit)
    assert (out.num_accepted <= limit).all()
    assert (out.num_accepted == limit).any()


def test_drafting_and_verifying_trace_as_one_graph():
    """No host read and no data-dependent Python control flow: torch.compile traces both whole
    (fullgraph: a `.item()`, a `.tolist()` or a branch on a device value would break the graph), what graph
    mode's capture of the verify step needs; and the traced results are the eager ones."""
    toy = Toy(depth=3, seed=1, top_p=0.8)
    tt = TREES["w4"].tensors()
    s = 32
    seeds, base = torch.arange(s) * 7 + 1, torch.full((s,), 3)
    greedy = torch.arange(s) % 3 == 0
    args = (toy.cand.expand(s, -1, -1), toy.first.expand(s, -1), toy.pairs.expand(s, -1, -1, -1),
            torch.zeros(s, dtype=torch.long), torch.where(greedy, 0.0, 1.0), seeds, base)
    tree = draft_tree(tt, *args)
    traced = torch.compile(lambda *a: draft_tree(tt, *a), fullgraph=True, backend="eager")(*args)
    assert all(torch.equal(a, b) for a, b in zip(traced, tree))
    raw = toy.table[tree.tokens]
    raw[:, 0] = toy.root_logits
    processed = toy.processed(raw.reshape(-1, V)).view(s, -1, V)
    target = processed.argmax(-1)
    want = verify_tree(tt, tree, processed, target, greedy, seeds, base)
    got = torch.compile(lambda *a: verify_tree(tt, *a), fullgraph=True, backend="eager")(
        tree, processed, target, greedy, seeds, base)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
