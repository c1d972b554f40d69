"""Draft trees with what depends on each node's path (`--speculative-tree-budget N`, namazu/spec/tree_step.py,
namazu/structured/tree_masks.py), with namazu-tiny's shipped DFlash2 drafter:
- penalties: a node row counts the output tokens plus its own path's drafts; greedy outputs with repetition,
  presence and frequency penalties equal decoding without speculation;
- grammar masks: a node row's mask is the grammar's after its own path, and a node the grammar rejects is
  never accepted; greedy outputs under a grammar that reads token values (and under value-independent ones:
  an allowed-token set, min_tokens) equal decoding without speculation, and every output follows its grammar;
- at T = 1 the token decided at a tree's root follows the target's distribution masked by the grammar
  (chi-square), the drafts being drawn from a q that knows nothing of the mask.
"""
import numpy as np
import pytest
import torch
from engine_helpers import assert_same_outputs, dense_model
from scipy.stats import chi2

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.spec.selection import SHIPPED_DRAFTER_DIR
from namazu.spec.tree_step import TreeStep
from namazu.structured.grammar import ids_to_words

MODEL = str(default_model_path())
DRAFTER = str(default_model_path() / SHIPPED_DRAFTER_DIR)
TEXTS = ["Tell me a story about a fox.", "Hello, who are you?", "List three colours.",
         "Write a JSON object with a name.", "What is two plus two?", "東京について教えて"]


def engine(budget: int, **kw) -> LLM:
    spec = dict(speculative_model=DRAFTER, num_speculative_tokens=6, speculative_disable_batch_size=0,
                speculative_tree_budget=budget) if budget >= 0 else dict(num_speculative_tokens=0)
    return LLM(MODEL, executor="inline", **spec, **kw)


class ParityGrammar:
    """Each token's parity differs from the one before it (the first output token is free): a grammar that
    reads token values, whose mask at a node depends on the token of that node, so a row masked after the
    wrong path allows the wrong half of the vocabulary. Its history is what it accepted, for the checks."""

    depends_on_values = True

    def __init__(self, vocab_size: int):
        self.history: list[int] = []
        self.words = [ids_to_words(range(parity, vocab_size, 2), vocab_size) for parity in (0, 1)]

    def _ok(self, last: int | None, t: int) -> bool:
        return last is None or (t - last) % 2 == 1

    def validate_tokens(self, tokens):
        last = self.history[-1] if self.history else None
        for i, t in enumerate(tokens):
            if not self._ok(last, int(t)):
                return i
            last = int(t)
        return len(tokens)

    def accept_tokens(self, tokens):
        if self.validate_tokens(tokens) < len(tokens):
            return False
        self.history += [int(t) for t in tokens]
        return True

    def rollback(self, num_tokens):
        del self.history[len(self.history) - num_tokens:]

    def fill_bitmask(self, bitmask, row):
        if self.history:
            bitmask[row] &= self.words[1 - self.history[-1] % 2]

    def is_terminated(self):
        return False


def alternates(tokens: list[int]) -> bool:
    return all((b - a) % 2 == 1 for a, b in zip(tokens, tokens[1:]))


class Verifies:
    """Per tree verify of a sampling sequence: its accepted path, how many nodes it accepted, whether its row
    has a penalty, and how many of its planned nodes carried a token their parent's processed row gives no
    mass (a grammar's rejection)."""

    def __init__(self):
        self.raw = []
        self.count_rows: list[int] = []      # penalized node rows checked per verify
        self.count_errors: list[int] = []    # of which with counts other than the root's plus the path's

    def rows(self):
        for is_tree, path, n, pen, banned in self.raw:
            for s in torch.nonzero(is_tree).flatten().tolist():
                yield path[s].tolist(), int(n[s]), bool(pen[s]), int(banned[s])


@pytest.fixture
def verifies(monkeypatch):
    seen = Verifies()
    real = TreeStep.accept

    def accept(self, plan, processed, target, tokens, accepted, st, row_layout, slot_index):
        out = real(self, plan, processed, target, tokens, accepted, st, row_layout, slot_index)
        first = row_layout[:, 0]
        pen = (st.presence_penalty[first] != 0) | (st.frequency_penalty[first] != 0) | \
            (st.repetition_penalty[first] != 1)
        trees = self._trees
        slot = torch.where(plan.is_tree, slot_index, 0)
        node_tokens = trees.tokens[slot]                                    # [S, R]
        k = row_layout.shape[1] - 1
        parents = self.tt.parents[1:self.rows].clamp(max=k)                 # [N]
        parent_rows = row_layout[:, parents]                                # [S, N]
        nodes = torch.arange(1, self.rows)
        logit = processed[parent_rows, node_tokens[:, 1:self.rows]]         # [S, N]
        planned = nodes.unsqueeze(0) <= plan.num_nodes.unsqueeze(-1)
        banned = (torch.isneginf(logit) & planned).sum(-1)
        seen.raw.append((plan.is_tree.clone(), plan.path.clone(), plan.num_accepted.clone(), pen.clone(),
                         banned.clone()))
        if st.output_counts is not None:
            # Node j's row counts the root row's tokens plus those of the path's nodes 1..j.
            counts = st.output_counts
            onehot = torch.nn.functional.one_hot(node_tokens, counts.shape[1]).float()       # [S, R, V]
            path = self.tt.ancestors.float().clone()
            path[:, 0] = 0
            want = counts[first].unsqueeze(1) + torch.einsum("ij,sjv->siv", path, onehot)
            rows = row_layout[:, nodes.clamp(max=k)]                                         # [S, N]
            check = planned & (pen & plan.is_tree).unsqueeze(-1)
            diff = (counts[rows] - want[:, 1:self.rows]).abs().amax(-1)
            seen.count_errors.append(int((diff[check] > 0).sum()))
            seen.count_rows.append(int(check.sum()))
        return out

    monkeypatch.setattr(TreeStep, "accept", accept)
    return seen


def leaves_the_chain(path: list[int], n: int) -> bool:
    """An accepted path whose node j is not node j of a chain: its penalty counts differ from drafts[:j]."""
    return any(node != d + 1 for d, node in enumerate(path[:n]))


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PENALTIES = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.0),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5,
                   frequency_penalty=0.5),
    # A request's own seed: every node row's sample is compared with the drafts (exact matching), so any count
    # a row gets wrong moves the tokens of the whole distribution, not only an argmax.
    SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, frequency_penalty=2.0),
    SamplingParams(temperature=0.8, seed=9, max_tokens=40, ignore_eos=True, presence_penalty=2.0,
                   repetition_penalty=1.5),
]


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_penalized_outputs_equal_decoding_without_speculation(verifies, async_sched):
    with engine(-1, async_scheduling=async_sched) as llm:
        outs = llm.generate(TEXTS, PENALTIES, use_tqdm=False)
        want, prompt_ids = [o.outputs[0].token_ids for o in outs], [o.prompt_token_ids for o in outs]
    with engine(16, async_scheduling=async_sched) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(TEXTS, PENALTIES, use_tqdm=False)]
    assert_same_outputs(MODEL, prompt_ids, PENALTIES, got, want)
    penalized = [(path, n) for path, n, pen, _ in verifies.rows() if pen]
    assert len(penalized) > 20 and sum(n for _, n in penalized) > 20
    # Accepted paths whose counts a chain's drafts[:j] would get wrong: what the test is about.
    assert sum(leaves_the_chain(path, n) for path, n in penalized) > 5
    # Outputs rarely show a row's count of a token it should not count (a sibling's draft is seldom a likely
    # next token): every penalized node row's counts are checked against its path as well.
    assert sum(verifies.count_rows) > 200 and sum(verifies.count_errors) == 0, sum(verifies.count_errors)


def _grammar_params(vocab: int, grammars: list) -> list[SamplingParams]:
    def factory():
        grammars.append(ParityGrammar(vocab))
        return grammars[-1]

    parity = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, grammar_factory=factory)
              for _ in range(4)]
    # Value-independent grammars: rows by each node's depth (the engine walks the tree with placeholders).
    low = list(range(0, vocab, 3))
    others = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=low),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=30)]
    return parity + others


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_grammar_outputs_equal_decoding_without_speculation(verifies, async_sched):
    base_grammars, tree_grammars = [], []
    with engine(-1, async_scheduling=async_sched) as llm:
        vocab = llm.engine.vocab_size
        params = _grammar_params(vocab, base_grammars)
        outs = llm.generate(TEXTS, params, use_tqdm=False)
        want = [o.outputs[0].token_ids for o in outs]
    with engine(16, async_scheduling=async_sched) as llm:
        params = _grammar_params(vocab, tree_grammars)
        outs = llm.generate(TEXTS, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.get_stats()
    for o in outs[:4]:
        assert o.outputs[0].finish_reason == "length" and alternates(o.outputs[0].token_ids)
    # Each grammar saw exactly its committed tokens: every node it was walked through was rolled back.
    assert sorted(g.history for g in tree_grammars) == sorted(o.outputs[0].token_ids for o in outs[:4])
    assert set(outs[4].outputs[0].token_ids) <= set(range(0, vocab, 3))
    assert got == want       # a grammar's decision is never excused as a near-tie
    rows = list(verifies.rows())
    assert stats.num_accepted_draft_tokens > 0 and len(rows) > 20
    # The drafter does not know the grammar: its trees hold nodes the grammar rejects, which the rule passes.
    assert sum(banned for *_, banned in rows) > 20
    assert sum(n for _, n, _, banned in rows if banned) > 5


# The penalties of the sampled variant: strong enough that a row counting the wrong tokens moves its mass.
PENALTY = dict(repetition_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.8)


def _target(model, prompt: list[int], outputs: list[int], variant: str) -> np.ndarray:
    """The dense model's next-token p after prompt + outputs, as the sampler processes it at T = 1: masked to
    the parity the grammar allows after the last token ("grammar"), or with the request's penalties over the
    outputs (and the prompt, for repetition) ("penalties")."""
    hidden, _ = model(torch.tensor([prompt + outputs]))
    logits = model.compute_logits(hidden[0, -1]).float()
    v = len(logits)
    if variant == "grammar":
        allowed = (torch.arange(v) - outputs[-1]) % 2 == 1
        logits = logits.masked_fill(~allowed, float("-inf"))
    else:
        counts = torch.bincount(torch.tensor(outputs), minlength=v).float()
        seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=v) > 0)
        rep = PENALTY["repetition_penalty"]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - PENALTY["frequency_penalty"] * counts - PENALTY["presence_penalty"] * (counts > 0).float()
    return logits.softmax(-1).numpy()


def _chi2(expect: np.ndarray, counts: np.ndarray) -> tuple[float, int]:
    """Cells expected 5 or more, the rest pooled into one."""
    big = expect >= 5
    e = np.append(expect[big], expect[~big].sum())
    c = np.append(counts[big], counts[~big].sum())
    keep = e > 0
    return float((((c - e) ** 2)[keep] / e[keep]).sum()), int(keep.sum()) - 1


@torch.no_grad()
@pytest.mark.parametrize("variant", ["grammar", "penalties"])
def test_tokens_decided_in_a_tree_follow_the_processed_target_at_t1(verifies, variant):
    """Tokens 2 and 3 of each sequence (token 1 is the prompt's plain sample; token 2 is decided at the tree's
    root, token 3 at a depth-1 node's row when token 2 was a draft, whose mask or penalty counts follow that
    node's path) against the dense model's distributions as the sampler processes them (the grammar's mask,
    or the penalties, then renormalised): token 2 given token 1, and the joint of tokens 2 and 3 given token 1
    (chi-square, pooled over token 1). The drafts come from a q that knows neither."""
    text = "Once upon a time"
    grammars = []
    triples = []
    with engine(6, max_num_seqs=48) as llm:
        vocab = llm.engine.vocab_size

        def factory():
            grammars.append(ParityGrammar(vocab))
            return grammars[-1]

        extra = dict(grammar_factory=factory) if variant == "grammar" else PENALTY
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=48, **extra)
        for _ in range(60):
            out = llm.generate([text], params, use_tqdm=False)[0]
            triples += [tuple(c.token_ids[:3]) for c in out.outputs]
            if variant == "grammar":
                assert all(alternates(c.token_ids) for c in out.outputs)
        prompt = out.prompt_token_ids
    rows = list(verifies.rows())
    if variant == "grammar":
        assert sum(banned for *_, banned in rows) > 100, "no drafted node was masked out: the test shows nothing"
    else:
        assert all(pen for _, _, pen, _ in rows) and sum(verifies.count_errors) == 0
    # Token 3 came from a depth-1 node's row (token 2 accepted) in many sequences.
    assert sum(n >= 1 for _, n, _, _ in rows) > 300
    model = dense_model(MODEL)
    firsts = np.asarray([a for a, _, _ in triples])
    stat, dof, joint_stat, joint_dof = 0.0, 0, 0.0, 0
    for x1 in np.unique(firsts):
        group = [(b, c) for a, b, c in triples if a == x1]
        if len(group) < 100:
            continue
        p2 = _target(model, prompt, [int(x1)], variant)
        seconds = np.asarray([b for b, _ in group])
        st, df = _chi2(p2 * len(group), np.bincount(seconds, minlength=len(p2)))
        stat, dof = stat + st, dof + df
        # The joint over (x2, x3): x2 values expected 5 times or more get their own p3 row, the rest one cell.
        tops = [int(x) for x in np.flatnonzero(p2 * len(group) >= 5)]
        expect, counts = [], []
        for x2 in tops:
            p3 = _target(model, prompt, [int(x1), x2], variant)
            expect.append(p2[x2] * p3 * len(group))
            counts.append(np.bincount([c for b, c in group if b == x2], minlength=len(p3)))
        rest = sum(1 for b, _ in group if b not in tops)
        e, c = np.concatenate(expect + [[len(group) * (1 - p2[tops].sum())]]), np.concatenate(counts + [[rest]])
        st, df = _chi2(e, c)
        joint_stat, joint_dof = joint_stat + st, joint_dof + df
    assert dof >= 8 and joint_dof >= 8, f"too few samples per first token ({len(triples)} sequences)"
    print(f"{variant}: token 2: chi2 {stat:.1f} over {dof} dof; tokens 2-3: chi2 {joint_stat:.1f} over "
          f"{joint_dof} dof")
    assert stat < chi2.ppf(1 - 1e-3, dof), f"token 2: chi2 {stat:.1f} over {dof} dof"
    assert joint_stat < chi2.ppf(1 - 1e-3, joint_dof), f"tokens 2-3: chi2 {joint_stat:.1f} over {joint_dof} dof"

SCHEMAS = [
    {"type": "object", "properties": {"status": {"enum": ["ok", "ng"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 50}},
     "required": ["status", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "minItems": 1, "maxItems": 3},
]


@pytest.mark.parametrize("async_sched", [True, False], ids=["async", "sync"])
def test_json_schema_outputs_validate_with_trees(verifies, async_sched):
    """The compiled grammars (xgrammar's matcher, rolled back node by node) at T > 0: every output that ends
    with "stop" validates, the others end with "length"; trees were verified for them, with masked nodes."""
    import json

    import jsonschema

    params = [SamplingParams(temperature=0.8, seed=i if i % 2 else None, max_tokens=48,
                             json_schema=SCHEMAS[i % 2]) for i in range(8)]
    with engine(16, async_scheduling=async_sched, max_num_seqs=8) as llm:
        outs = llm.generate(["JSON: " + json.dumps(SCHEMAS[i % 2])[:60] for i in range(8)], params,
                            use_tqdm=False)
    stops = 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        if c.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(c.text), SCHEMAS[i % 2])
    rows = list(verifies.rows())
    assert stops >= 4 and len(rows) > 10 and sum(banned for *_, banned in rows) > 10
