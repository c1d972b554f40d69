"""Draft trees inside the engine's step (`--speculative-tree-budget N`, namazu/spec/tree_step.py), with the
model's shipped DFlash2 drafter (so that trees are accepted, later siblings too):
- greedy and seeded outputs equal decoding without speculation (up to near-ties, `assert_same_outputs`), for
  two budgets, with and without async scheduling, with no host read inside the step, and some accepted
  paths leave the rank-0 chain;
- every emitted token's logprob equals the dense model's at that prefix: the node rows of a tree (tree
  attention, rotary positions by depth) and the rows of the step after an accepted branch (whose context
  is the moved latents) give the logits of a fresh prefill of the accepted tokens;
- the latent cache of a sequence after tree steps equals a fresh prefill's, position by position: a
  rejected branch's latents are nowhere the sequence can read;
- at T = 1 the token decided at a tree's root follows the target's distribution (chi-square), through the
  engine, with its engine-drawn seeds (the rejection rule over siblings with the drafter's q).
Penalties and grammar masks in trees: tests/spec/test_tree_constraints.py; trees in graph mode:
tests/worker/test_tree_graph.py.
"""
import numpy as np
import pytest
import torch
from engine_helpers import assert_same_outputs, dense_model
from engine_helpers import tree_engine as engine
from scipy.stats import chi2

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.engine_config import EngineConfig
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.selection import SHIPPED_DRAFTER_DIR
from namazu.spec.tree_step import TreeStep

MODEL = str(default_model_path())
DRAFTER = str(default_model_path() / SHIPPED_DRAFTER_DIR)
TEXTS = ["Tell me a story about a fox.", "Hello, who are you?", "List three colours.",
         "Write a JSON object with a name.", "What is two plus two?", "東京について教えて"]


class Paths:
    """The accepted path of every tree sequence of every step: kept as device tensors inside the step (no
    host read there), read when the test iterates."""

    def __init__(self):
        self.raw: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __iter__(self):
        for is_tree, path, n in self.raw:
            for s in torch.nonzero(is_tree).flatten().tolist():
                yield path[s].tolist(), int(n[s])

    def __len__(self) -> int:
        return sum(1 for _ in self)


@pytest.fixture
def paths(monkeypatch):
    seen = Paths()
    real = TreeStep.accept

    def accept(self, plan, *args):
        out = real(self, plan, *args)
        seen.raw.append((plan.is_tree.clone(), plan.path.clone(), plan.num_accepted.clone()))
        return out

    monkeypatch.setattr(TreeStep, "accept", accept)
    return seen


def off_chain(step: TreeStep, seen) -> int:
    """Accepted paths through a node that is not its parent's first draw."""
    ranks = step.topology.ranks
    return sum(any(ranks[node] > 0 for node in path[:n]) for path, n in seen)


def generate(llm: LLM, params, texts=TEXTS):
    outs = llm.generate(texts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.prompt_token_ids for o in outs], outs


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# A request's own seed: its rows take the exact-match rule at every node, against the target's sample with
# the output index of the node's depth, so its text is plain seeded decoding's.
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("budget,async_sched,params", [(6, True, GREEDY), (16, False, GREEDY), (16, True, SEEDED)],
                         ids=["greedy-6-async", "greedy-16-sync", "seeded-16-async"])
def test_outputs_equal_decoding_without_speculation(paths, budget, async_sched, params):
    with engine(-1, async_scheduling=async_sched) as llm:
        base, prompt_ids, _ = generate(llm, params)
    # The step's one host read stays its only one: any other read inside it is an error here.
    with engine(budget, async_scheduling=async_sched, debug_no_host_sync=True) as llm:
        got, _, _ = generate(llm, params)
        step = llm.engine.executor.worker.runner.spec.tree
        stats = llm.engine.get_stats()
    assert_same_outputs(MODEL, prompt_ids, params, got, base)
    assert step is not None and step.num_nodes == budget
    assert len(paths) > 20 and stats.num_accepted_draft_tokens > 0
    assert off_chain(step, paths) > 0, "no accepted path used a later sibling: the test shows nothing"


def test_a_tree_accepts_more_than_the_chain_at_t0():
    """The same prompts, greedy: tokens per verify step with a 16-node tree above the chain's. Outputs are
    the same either way; this is what shows the drafter's context follows the accepted path (a drafter
    that read a rejected node's context, or counted from a node row's position, would draft worse)."""
    length = {}
    for budget in (0, 16):
        with engine(budget) as llm:
            generate(llm, GREEDY)
            length[budget] = llm.engine.get_stats().mean_acceptance_length
    assert length[16] > 1.05 * length[0], length


@torch.no_grad()
def test_logprobs_after_accepted_branches_equal_a_fresh_prefill(paths):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    with engine(16) as llm:
        got, prompt_ids, outs = generate(llm, params, TEXTS[:4])
        step = llm.engine.executor.worker.runner.spec.tree
    assert off_chain(step, paths) > 0
    model = dense_model(MODEL)
    worst = 0.0
    for prompt, toks, out in zip(prompt_ids, got, outs):
        hidden, _ = model(torch.tensor([prompt + toks]))
        lp = model.compute_logits(hidden[0, len(prompt) - 1:-1]).float().log_softmax(-1)
        want = lp.gather(1, torch.tensor(toks).unsqueeze(-1)).squeeze(-1)
        have = torch.tensor([d[t] for d, t in zip(out.outputs[0].logprobs, toks)])
        worst = max(worst, float((have - want).abs().max()))
    # fp32 logits of namazu-tiny (|logit| < ~20) in GEMMs of another shape agree to ~1e-5; a row that saw
    # a sibling, or a latent read from a rejected node, moves a logprob by far more than 1e-3.
    assert worst < 1e-3, f"largest logprob difference {worst:.2e}"


def _latents(llm: LLM, seq, n: int) -> torch.Tensor:
    kv = llm.engine.executor.worker.runner.cache.kv         # [L, blocks + 1, bs, D]
    bs = kv.shape[2]
    pos = torch.arange(n)
    blocks = torch.tensor(seq.block_table)[pos // bs]
    return kv[:, blocks, pos % bs].transpose(0, 1).clone()     # [n, L, D]


def _context(llm: LLM, seq, n: int) -> torch.Tensor:
    """The drafter's context cache [L, 2, slots, H, D] at the sequence's positions 0 .. n-1 -> [n, ...]."""
    spec = llm.engine.executor.worker.runner.spec
    bs = llm.engine.executor.worker.runner.block_size
    pos = torch.arange(n)
    slots = torch.tensor(seq.block_table)[pos // bs] * bs + pos % bs
    return spec.proposer.cache[:, :, slots].transpose(0, 2).clone()


@torch.no_grad()
def test_the_cache_after_tree_steps_equals_a_prefill(paths, monkeypatch):
    """Both caches (the target's latents, the drafter's context) at every computed position, and the
    drafter's anchors: each block it drafts starts from the emitted bonus token at that token's position."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    anchors = []
    real = DFlashProposer.draft_block

    def draft_block(self, inp, k):
        out = real(self, inp, k)
        anchors.append((out[0].tolist(), out[1].tolist()))
        return out

    monkeypatch.setattr(DFlashProposer, "draft_block", draft_block)
    with engine(16, async_scheduling=False, enable_prefix_caching=False) as llm:
        eng = llm.engine
        eng.add_request("a", TEXTS[0], params)
        for _ in range(12):
            eng.step()
        seq = eng.requests["a"].seqs[0]
        tokens, n = list(seq.token_ids), seq.num_computed_tokens
        got = _latents(llm, seq, n)
        step = eng.executor.worker.runner.spec.tree
        got_ctx = _context(llm, seq, n)
    assert len(anchors) >= 12 and all(tokens[p] == t for (t,), (p,) in anchors), anchors
    anchors.clear()
    assert off_chain(step, paths) > 0 and n > len(seq.prompt_token_ids) + 12
    # The reference prefills the accepted tokens with the same drafter (its context cache too), no tree.
    with engine(0, async_scheduling=False, enable_prefix_caching=False) as ref:
        ref.engine.add_request("b", None, SamplingParams(max_tokens=4), prompt_token_ids=tokens[:n])
        ref.engine.step()
        want = _latents(ref, ref.engine.requests["b"].seqs[0], n)
        want_ctx = _context(ref, ref.engine.requests["b"].seqs[0], n)
    for name, a, b in (("target latents", got, want), ("drafter context", got_ctx, want_ctx)):
        diff = (a - b).abs().flatten(1).amax(1)          # per position
        assert float(diff.max()) < 1e-4, f"{name}: positions {torch.nonzero(diff >= 1e-4).flatten().tolist()} differ"


@torch.no_grad()
def test_the_token_decided_at_the_root_follows_the_target_at_t1(paths):
    """Token 2 of each sequence (the first a tree decides: token 1 is the prompt's plain sample) against the
    dense model's p given the prompt and token 1, pooled over the values of token 1."""
    text = "Once upon a time"
    # max_tokens 4: the engine plans 2 of the tree's nodes, the root's two children (node order is by depth).
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=48)
    pairs = []
    with engine(6, max_num_seqs=48) as llm:
        for _ in range(60):
            out = llm.generate([text], params, use_tqdm=False)[0]
            pairs += [tuple(c.token_ids[:2]) for c in out.outputs]
        prompt = out.prompt_token_ids
        step = llm.engine.executor.worker.runner.spec.tree
    assert sum(any(step.topology.ranks[node] > 0 for node in p[:1]) for p, n in paths if n) > 0
    model = dense_model(MODEL)
    firsts = np.asarray([a for a, _ in pairs])
    stat, dof = 0.0, 0
    for x1 in np.unique(firsts):
        seconds = np.asarray([b for a, b in pairs if a == x1])
        if len(seconds) < 100:
            continue
        hidden, _ = model(torch.tensor([prompt + [int(x1)]]))
        p = model.compute_logits(hidden[0, -1]).float().softmax(-1).numpy()
        expect = p * len(seconds)
        counts = np.bincount(seconds, minlength=len(p))
        big = expect >= 5
        e = np.append(expect[big], expect[~big].sum())
        c = np.append(counts[big], counts[~big].sum())
        keep = e > 0
        stat += float((((c - e) ** 2)[keep] / e[keep]).sum())
        dof += int(keep.sum()) - 1
    assert dof >= 8, f"too few samples per first token ({len(pairs)} pairs)"
    print(f"chi2 {stat:.1f} over {dof} dof")
    assert stat < chi2.ppf(1 - 1e-3, dof), f"chi2 {stat:.1f} over {dof} dof"


def test_the_budget_is_checked_at_start_up():
    with pytest.raises(ValueError, match="speculative-tree-budget"):
        EngineConfig(speculative_tree_budget=-1).validate()
    EngineConfig(speculative_tree_budget=8, tensor_parallel_size=2).validate()     # rank 0's trees and paths
    with pytest.raises(ValueError, match="DFlash"):
        EngineConfig(speculative_tree_budget=8, speculative_method="ngram", num_speculative_tokens=3).validate()


def test_requests_joining_with_penalties_verify_trees(monkeypatch):
    """Requests with and without penalties join a running batch at different steps: every drafted block is a
    tree, the penalized sequence's too (its node rows count the tokens of their own paths), and every
    request's tokens are still those of decoding without speculation."""
    penalized_trees = []
    real = TreeStep.accept

    def accept(self, plan, processed, target, tokens, accepted, st, row_layout, slot_index):
        first = row_layout[:, 0]
        pen = (st.presence_penalty[first] != 0) | (st.frequency_penalty[first] != 0) | \
            (st.repetition_penalty[first] != 1)
        penalized_trees.append(int((pen & plan.is_tree).sum()))
        return real(self, plan, processed, target, tokens, accepted, st, row_layout, slot_index)

    monkeypatch.setattr(TreeStep, "accept", accept)
    penalized = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=1.5, frequency_penalty=1.0)
    late_params = [GREEDY, penalized, GREEDY]
    with engine(16, async_scheduling=False) as llm:
        eng = llm.engine
        for i, text in enumerate(TEXTS[:3]):
            eng.add_request(f"early{i}", text, GREEDY)
        done = {}
        for step in range(200):
            if step in (3, 9, 15):
                j = (3, 9, 15).index(step)
                eng.add_request(f"late{j}", TEXTS[3 + j], late_params[j])
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = (out.prompt_token_ids, out.outputs[0].token_ids)
            if not eng.has_unfinished_requests():
                break
    ids = sorted(done)
    params = {f"early{i}": GREEDY for i in range(3)} | {f"late{j}": p for j, p in enumerate(late_params)}
    with engine(-1) as llm:
        want = [llm.generate(None, params[r], prompt_token_ids=[done[r][0]], use_tqdm=False)[0].outputs[0].token_ids
                for r in ids]
    assert len(ids) == 6 and sum(penalized_trees) > 10, penalized_trees
    assert_same_outputs(MODEL, [done[r][0] for r in ids], [params[r] for r in ids], [done[r][1] for r in ids], want)


def test_a_replaced_drafter_drafts_trees_of_its_own_shape(paths, tmp_path):
    """After `set_drafter` (here to a copy of the shipped checkpoint with 16 candidates per position: another
    shape of the stored trees, as trees span the drafter's own candidates here) the engine drafts and verifies
    trees again, and outputs stay greedy's."""
    import json
    import shutil

    copy = tmp_path / "drafter"
    shutil.copytree(DRAFTER, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["selector_k"] = 16
    (copy / "config.json").write_text(json.dumps(cfg))
    with engine(-1) as llm:
        base, prompt_ids, _ = generate(llm, GREEDY, TEXTS[:3])
    with engine(8, speculative_tree_candidates=0) as llm:
        first, _, _ = generate(llm, GREEDY, TEXTS[:3])
        assert llm.engine.executor.worker.runner.spec.tree._trees.child_ids.shape[-1] == 32
        before = len(paths)
        llm.set_drafter(str(copy))
        second, _, _ = generate(llm, GREEDY, TEXTS[:3])
        step = llm.engine.executor.worker.runner.spec.tree
    assert before > 0 and len(paths) > before
    assert step._trees.child_ids.shape[-1] == 16
    for got in (first, second):
        assert_same_outputs(MODEL, prompt_ids, GREEDY, got, base)


def test_the_draft_policy_turns_a_tree_on_or_off_without_cutting_it():
    """The adaptive policy plans a chain length per sequence; with a tree budget a positive plan verifies the
    whole tree (its first k nodes would be a shallow tree, not a shorter chain) and 0 verifies nothing."""
    from types import SimpleNamespace

    with engine(16, speculative_adaptive=True) as llm:
        eng = llm.engine
        assert eng.draft_policy is not None
        eng._draft_plan = {5: 2, 6: 0}

        def seq(i):
            return SimpleNamespace(seq_id=i, params=SamplingParams(), num_pending=0, num_next_drafts=16,
                                   drafts_requested=True)

        assert eng._num_drafts(seq(5)) == 16
        assert eng._num_drafts(seq(6)) == 0


def test_async_planning_assumes_a_verify_accepts_the_trees_depth(monkeypatch):
    """Async scheduling plans the next step before this one's result: it assumes a tree verify accepts its
    depth (the most it can), not its N nodes, so a sequence near max_tokens keeps its whole tree (the
    scheduler's max_tokens limit is on the tokens a verify may emit, the depth + 1). Outputs stay greedy's
    (the worker moves the planned positions back by what was not accepted, as for a chain)."""
    rows = []
    real = TreeStep.accept

    def accept(self, plan, *args):
        rows.extend(plan.num_nodes[plan.is_tree].tolist())
        return real(self, plan, *args)

    monkeypatch.setattr(TreeStep, "accept", accept)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with engine(-1) as llm:
        base, prompt_ids, _ = generate(llm, params, TEXTS[:4])
    with engine(24, async_scheduling=True) as llm:
        got, _, _ = generate(llm, params, TEXTS[:4])
        step = llm.engine.executor.worker.runner.spec.tree
        assert llm.engine.scheduler.max_accepted(24) == step.topology.depth == 6
    assert_same_outputs(MODEL, prompt_ids, params, got, base)
    # A sequence's last one or two verifies may still get fewer nodes (only max_tokens' room is left): with
    # N assumed accepted, every other verify was cut (11.8 of 25 rows on average, bench/RESULTS.md).
    full = sum(r == 24 for r in rows)
    print(f"{full} of {len(rows)} tree verifies with all 24 nodes, {np.mean(rows):.1f} nodes on average")
    assert len(rows) > 20 and full >= 0.6 * len(rows), (full, len(rows), rows)


def test_outputs_under_kv_pressure_equal_decoding_without_speculation():
    """A KV pool this small preempts and hands blocks from one sequence to another every few steps, async. A
    tree's rows past its depth lie beyond what the engine assumes computed, so their blocks may be released
    while the step that writes them is in flight (harmless: the worker runs that step before any later one,
    and they never hold committed tokens); outputs are still greedy decoding's."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    texts = TEXTS + ["Count to ten.", "Name a fruit."]
    with engine(-1) as llm:
        base, prompt_ids, _ = generate(llm, params, texts)
    with engine(24, kv_cache_memory="2MiB", max_num_seqs=8, enable_prefix_caching=False) as llm:
        got, _, _ = generate(llm, params, texts)
        stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_accepted_draft_tokens > 0
    assert_same_outputs(MODEL, prompt_ids, params, got, base)
