"""Draft trees from DFlash2's selector: the width-1 tree is the chain's walk, a topology is well formed."""
import pytest
import torch
from dflash_fixtures import random_drafter
from engine_helpers import tiny_checkpoint

from namazu.config import ModelConfig
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.tree import TreeTopology, draft_tree, tree_block_mask, tree_positions

K = 4


def _drafter_inputs(m: int, seed: int = 1):
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    model = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, K, t.hidden_size, generator=g)
    anchor = torch.randint(0, t.vocab_size, (m,), generator=g)
    logits = torch.randn(m, K, t.vocab_size, generator=g) * 3
    return model, anchor, h, logits


@torch.no_grad()
def test_the_width_one_tree_is_the_walk():
    """T=0: the chain tree's tokens are the greedy walk's. T>0: each node's children's q is the q the walk
    draws from after the same picks (the walk driven to the tree's picks by its uniforms)."""
    m = 16
    model, anchor, h, logits = _drafter_inputs(m)
    tables = model.selector_tables(anchor, h, logits, K)
    tt = TreeTopology.chain(K).tensors()
    seeds, base = torch.arange(m), torch.zeros(m, dtype=torch.long)
    greedy = draft_tree(tt, *tables, anchor, None, seeds, base)
    assert torch.equal(greedy.tokens[:, 1:], model.walk(anchor, h, logits, K).ids)
    assert torch.equal(greedy.tokens[:, 0], anchor)

    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0] * (m // 4))
    tree = draft_tree(tt, *tables, anchor, temperature, seeds, base)
    # The uniform that makes the walk's inverse CDF land in the middle of the tree's pick, per position.
    q = tree.child_q[:, :K].double()
    pick = tree.cand_index[:, 1:]
    before = (q.cumsum(-1) - q).gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    u = before + q.gather(-1, pick.unsqueeze(-1)).squeeze(-1) / 2
    walk = model.walk(anchor, h, logits, K, temperature, u)
    sampled = temperature > 0
    assert torch.equal(walk.ids[sampled], tree.tokens[sampled, 1:])
    dense = torch.zeros_like(walk.q).scatter_(2, tree.child_ids[:, :K], tree.child_q[:, :K])
    torch.testing.assert_close(walk.q[sampled], dense[sampled])
    # Greedy rows of a mixed batch still draft the top candidates.
    assert torch.equal(tree.tokens[~sampled], greedy.tokens[~sampled])


@torch.no_grad()
def test_siblings_are_distinct_and_seeded():
    m = 8
    model, anchor, h, logits = _drafter_inputs(m, seed=2)
    tables = model.selector_tables(anchor, h, logits, K)
    tt = TreeTopology.build(12, K, 3).tensors()
    seeds, base = torch.arange(m) * 7 + 1, torch.full((m,), 9)
    a = draft_tree(tt, *tables, anchor, torch.ones(m), seeds, base)
    b = draft_tree(tt, *tables, anchor, torch.ones(m), seeds, base)
    c = draft_tree(tt, *tables, anchor, torch.ones(m), seeds + 1, base)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    for node in range(tt.children.shape[0]):
        kids = [k for k in tt.children[node].tolist() if k >= 0]
        if len(kids) > 1:
            toks = a.tokens[:, kids]
            assert (toks.sort(-1).values.diff(dim=-1) != 0).all()
    # Each node's token is one of its position's candidates, at its recorded index.
    cand = tables[0]
    pos = (tt.depths - 1).clamp_min(0)
    want = cand[:, pos].gather(2, a.cand_index.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(a.tokens[:, 1:], want[:, 1:])


def test_topologies():
    chain = TreeTopology.chain(3)
    assert chain.parents == (-1, 0, 1, 2) and chain.width == 1 and chain.depth == 3
    t = TreeTopology.build(10, 4, 3)
    assert t.num_nodes == 10 and t.depth <= 4 and t.width <= 3
    tt = t.tensors()
    # Ancestors: a node sees itself and its parent's ancestors; nodes of one depth are contiguous.
    for i, p in enumerate(t.parents):
        want = {i}
        while p >= 0:
            want.add(p)
            p = t.parents[p]
        assert set(torch.nonzero(tt.ancestors[i]).flatten().tolist()) == want
    assert list(t.depths) == sorted(t.depths)
    # Rates that favour siblings give a bushier tree for the same budget.
    wide = TreeTopology.build(6, 6, 4, rates=((0.5, 0.4, 0.3, 0.2),) * 6)
    deep = TreeTopology.build(6, 6, 4, rates=((0.9, 0.01, 0.01, 0.01),) * 6)
    assert wide.width == 4 and deep.parents == TreeTopology.chain(6).parents
    positions = tree_positions(tt, torch.tensor([10, 20]))
    assert positions[1].tolist() == [20 + d for d in t.depths]
    mask = tree_block_mask(tt, torch.tensor([True, False]), 12)
    assert torch.equal(mask[0, :11, :11], tt.ancestors) and mask[1].all()
    with pytest.raises(ValueError, match="earlier node"):
        TreeTopology((-1, 2, 0))
    with pytest.raises(ValueError, match="ordered by depth"):
        TreeTopology((-1, 0, 1, 0))


class TreeRecordingProposer(DFlashProposer):
    """Drafts, at every step of a real engine run, a chain-shaped and a bushy tree from the same inputs
    as its chain proposal, and keeps them."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.chain_tt = TreeTopology.chain(K).tensors()
        self.bushy_tt = TreeTopology.build(9, 3, 3).tensors()
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def propose(self, inp, k):
        proposal = super().propose(inp, k)
        chain, bushy = self.propose_tree(inp, self.chain_tt), self.propose_tree(inp, self.bushy_tt)
        anchor = inp.tokens.gather(1, inp.accepted.unsqueeze(-1)).squeeze(-1)
        self.seen.append((proposal.ids.clone(), chain.tokens.clone(), bushy.tokens.clone(), anchor.clone()))
        return proposal


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_proposer_drafts_trees_from_the_steps_own_inputs(temperature):
    from engine_helpers import prompts

    from namazu import LLM, SamplingParams

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    runs = []
    for _ in range(2):
        prop = TreeRecordingProposer(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size,
                                     t.num_hidden_layers)
        params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=5)
        with LLM(tiny_checkpoint(), executor="inline", drafter=prop, num_speculative_tokens=K) as llm:
            llm.generate(prompt_token_ids=prompts(2, lo=5, hi=9, seed=3), sampling_params=params, use_tqdm=False)
        runs.append(prop.seen)
        assert prop.seen
        for ids, chain, bushy, anchor in prop.seen:
            assert torch.equal(chain[:, 0], anchor) and torch.equal(bushy[:, 0], anchor)
            if temperature == 0:
                # Greedy: the chain-shaped tree is the chain's own block; a bushy tree's first-rank spine too.
                assert torch.equal(chain[:, 1:], ids)
                assert torch.equal(bushy[:, 1], ids[:, 0])
    # Seeded: the same request drafts the same trees.
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))


@torch.no_grad()
def test_a_tree_over_more_candidates_shares_the_selectors_own_candidates():
    """Scoring more candidates than the selector's K adds candidates after its own: the first K are the
    same tokens with the same scores, so a tree over more only adds siblings' choices."""
    m = 6
    model, anchor, h, logits = _drafter_inputs(m, seed=3)
    own = model.cfg.selector_k
    small = model.selector_tables(anchor, h, logits, K)
    big = model.selector_tables(anchor, h, logits, K, 3 * own)
    assert small[0].shape[-1] == own and big[0].shape[-1] == 3 * own
    assert torch.equal(big[0][..., :own], small[0])     # token ids: topk of the same distinct logits
    torch.testing.assert_close(big[1][:, :own], small[1])
    torch.testing.assert_close(big[2][:, :, :own, :own], small[2])
    # Greedy rows keep to the selector's own K (beyond it its scores are untrained): the same tree as over
    # the first K of the same tables (slices of the same scores: exact on any machine; the tables computed
    # over K alone come from GEMMs of another shape); sampled rows draw from all of them.
    tt = TreeTopology.build(12, K, 3).tensors()
    seeds, base = torch.arange(m), torch.zeros(m, dtype=torch.long)
    temperature = torch.tensor([0.0, 1.0] * (m // 2))
    first_k = (big[0][..., :own], big[1][:, :own], big[2][:, :, :own, :own])
    want = draft_tree(tt, *first_k, anchor, temperature, seeds, base)
    got = draft_tree(tt, *big, anchor, temperature, seeds, base, greedy_candidates=own)
    greedy = temperature == 0
    assert torch.equal(got.tokens[greedy], want.tokens[greedy])
    loose = draft_tree(tt, *big, anchor, temperature, seeds, base)
    assert int(got.cand_index[greedy].max()) < own <= int(loose.cand_index[greedy].max())


class TreeCandidatesProposer(DFlashProposer):
    """Keeps the trees the engine's tree step asks for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trees: list = []

    def propose_tree(self, inp, tt):
        tree = super().propose_tree(inp, tt)
        self.trees.append(tree)
        return tree


@pytest.mark.parametrize("candidates", [0, 18])
def test_the_engines_trees_draw_from_speculative_tree_candidates(candidates):
    """`speculative_tree_candidates` reaches the drafter: the stored trees span that many candidates per
    node (0: the selector's own K), at T = 1 some children are candidates beyond the selector's K, and at
    T = 0 none are."""
    from engine_helpers import prompts

    from namazu import LLM, SamplingParams

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    prop = TreeCandidatesProposer(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    own = prop.cfg.selector_k
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    with LLM(tiny_checkpoint(), executor="inline", drafter=prop, num_speculative_tokens=K, speculative_tree_budget=12,
             speculative_tree_candidates=candidates, speculative_disable_batch_size=0) as llm:
        llm.generate(prompt_token_ids=prompts(4, lo=5, hi=9, seed=3), sampling_params=params, use_tqdm=False)
        sampled, prop.trees = prop.trees, []
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts(4, lo=5, hi=9, seed=3), sampling_params=greedy, use_tqdm=False)
    assert sampled and prop.trees
    want = candidates or own
    assert all(tree.child_ids.shape[-1] == want for tree in sampled + prop.trees)
    beyond = max(int(tree.cand_index[:, 1:].max()) for tree in sampled)
    assert (beyond >= own) == (want > own)
    # Greedy rows pick among the selector's own K only.
    assert max(int(tree.cand_index[:, 1:].max()) for tree in prop.trees) < own


def test_tree_candidates_are_never_fewer_than_the_drafters_own_selector_k():
    """The first K candidates keep the scores the selector was trained on, so fewer only take choices away:
    the default of 64 held a drafter trained on more than 64 to 64."""
    from dflash_fixtures import drafter_config

    from namazu.spec.tree_step import step_topology

    cfg = drafter_config(tiny_checkpoint(), selector_k=100)
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    assert vocab > 150
    assert step_topology(24, K, cfg, 64).candidates == 100       # the default, below its K
    assert step_topology(24, K, cfg, 0).candidates == 100
    assert step_topology(24, K, cfg, 150).candidates == 150
    assert step_topology(24, K, cfg, 10 * vocab).candidates == vocab
