"""The DFlash2 drafter as a device proposer: checkpoint checks, drafts equal to a dense recomputation,
lossless greedy and seeded outputs under the engine's features (the same tokens as without speculation
up to near-ties of the target, `assert_same_outputs`: verify rows are products of other shapes than
decode rows), and the T=1 output distribution."""
import math

import numpy as np
import pytest
import torch
from dflash_fixtures import drafter_config, random_drafter, shortlisted_drafter
from engine_helpers import assert_same_outputs, dense_model, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.config import ModelConfig
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_config import DrafterCheckpointError, check_drafter_checkpoint
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.training.train import Target, context_kv, draft_hidden

K = 3


def make_proposer(sample_drafts: bool = True, cls=DFlashProposer, shortlist: int = 0,
                  **overrides) -> DFlashProposer:
    """shortlist N > 0: the random drafter with a draft vocabulary of N random token ids."""
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    path = (shortlisted_drafter(tiny_checkpoint(), shortlist, **overrides) if shortlist
            else random_drafter(tiny_checkpoint(), **overrides))
    return cls(path, t.vocab_size, t.hidden_size, t.num_hidden_layers, sample_drafts=sample_drafts)


def run(prompt_ids, params, drafter=None, **kw):
    kw.setdefault("num_speculative_tokens", K if drafter is not None else 0)
    with LLM(tiny_checkpoint(), executor="inline", drafter=drafter, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.engine.get_stats()


# -- checkpoints ----------------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path):
    target = tiny_checkpoint()
    src = random_drafter(target)
    t = ModelConfig.from_pretrained(target)
    model = DFlashDrafter.load(src, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    model.save(tmp_path)
    again = DFlashDrafter.load(tmp_path, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change, needle", [
    (dict(vocab_size=300), "'vocab_size'"),
    (dict(hidden_size=32, conv_groups=4), "'hidden_size'"),
    (dict(target_layers=[0, 5]), "'target_layers'"),
    (dict(mask_token_id=9999), "'mask_token_id'"),
])
def test_mismatched_config_is_refused_naming_the_field(tmp_path, change, needle):
    target = tiny_checkpoint()
    DFlashDrafter(drafter_config(target, **change)).save(tmp_path)
    t = ModelConfig.from_pretrained(target)
    with pytest.raises(DrafterCheckpointError, match=needle):
        check_drafter_checkpoint(tmp_path, t.vocab_size, t.hidden_size, t.num_hidden_layers)


def test_missing_or_misshapen_tensor_is_refused_at_start_up(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_checkpoint()
    src = random_drafter(target)
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(src) / "config.json").read_text())
    weights = load_file(f"{src}/model.safetensors")
    missing = dict(weights)
    del missing["layers.1.v_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterCheckpointError, match="'layers.1.v_proj.weight' is missing"):
        LLM(target, executor="inline", speculative_model=str(tmp_path), num_speculative_tokens=K)
    weights["selector.pred"] = weights["selector.pred"][:, :4].contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterCheckpointError, match="'selector.pred' has shape"):
        LLM(target, executor="inline", speculative_model=str(tmp_path), num_speculative_tokens=K)


def test_draft_vocabulary_round_trip_and_bad_ids_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_checkpoint()
    t = ModelConfig.from_pretrained(target)
    src = shortlisted_drafter(target)
    model = DFlashDrafter.load(src, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    assert model.cfg.draft_vocab_size == len(model.draft_vocab) > 0
    assert bool((model.draft_vocab[1:] > model.draft_vocab[:-1]).all())
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(src) / "config.json").read_text())
    weights = load_file(f"{src}/model.safetensors")
    for bad, needle in ((None, "'draft_vocab' is missing"), (weights["draft_vocab"][:-1], "'draft_vocab' has shape"),
                        (weights["draft_vocab"].clone().fill_(3), "repeated ids"),
                        (weights["draft_vocab"] + t.vocab_size, "outside the vocabulary")):
        w = {k: v for k, v in weights.items() if k != "draft_vocab"}
        if bad is not None:
            w["draft_vocab"] = bad.contiguous()
        save_file(w, str(tmp_path / "model.safetensors"))
        with pytest.raises(DrafterCheckpointError, match=needle):
            DFlashDrafter.load(tmp_path, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    with pytest.raises(DrafterCheckpointError, match="'draft_vocab_size'"):
        drafter_config(target, draft_vocab_size=t.vocab_size + 1)


def test_walk_over_a_draft_vocabulary_is_the_full_walk_restricted_to_it():
    """Scoring only the draft vocabulary's rows drafts exactly what the full walk drafts once every other
    token's logit is -inf: the same ids, and at T > 0 the same q."""
    target = tiny_checkpoint()
    t = ModelConfig.from_pretrained(target)
    short = DFlashDrafter.load(shortlisted_drafter(target), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    full = DFlashDrafter.load(random_drafter(target), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    torch.manual_seed(0)
    m = 16
    h = torch.randn(m, K, t.hidden_size)
    anchor = torch.randint(0, t.vocab_size, (m,))
    logits = torch.randn(m, K, t.vocab_size) * 3
    masked = torch.full_like(logits, -math.inf)
    masked[..., short.draft_vocab] = logits[..., short.draft_vocab]
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5] * (m // 4))
    u = torch.rand(m, K, dtype=torch.float64)
    with torch.no_grad():
        want_g, _, *_ = full.walk(anchor, h, masked, K)
        got_g, _, *_ = short.walk(anchor, h, logits[..., short.draft_vocab], K)
        want_s, want_q, *_ = full.walk(anchor, h, masked, K, temperature, u)
        got_s, got_q, *_ = short.walk(anchor, h, logits[..., short.draft_vocab], K, temperature, u)
    assert torch.equal(got_g, want_g) and torch.equal(got_s, want_s)
    assert bool(torch.isin(got_s, short.draft_vocab).all())
    torch.testing.assert_close(got_q, want_q)


def test_frequent_tokens_picks_the_commonest_outputs():
    from namazu.spec.draft_vocab import coverage, frequent_tokens

    outs = [[5, 5, 5, 9, 2], [9, 9, 7, 2, 3], [3, 1]]      # counts: 5:3 9:3 2:2 3:2 7:1 1:1
    assert frequent_tokens(outs, 3).tolist() == [2, 5, 9]     # 2 and 3 tie: the smaller id
    assert frequent_tokens(outs, 10).tolist() == [1, 2, 3, 5, 7, 9]
    assert coverage(frequent_tokens(outs, 2), outs) == 6 / 12


# -- the drafts themselves ------------------------------------------------------------------------------
class RecordingProposer(DFlashProposer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.blocks = []

    def draft_block(self, inp, k):
        anchor, pos, h, logits = super().draft_block(inp, k)
        self.blocks.append((list(inp.seq_ids), anchor.tolist(), pos.tolist(), logits.clone()))
        return anchor, pos, h, logits


@pytest.mark.parametrize("engine_kw, shortlist", [
    (dict(), 0), (dict(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4), 0),
    (dict(), 120)], ids=["sync", "async-chunked", "draft-vocab"])
def test_drafts_equal_a_dense_recomputation(engine_kw, shortlist):
    """The paged context cache (extended every step, rejected drafts never visible) gives the block the
    same context as the drafter run over the target's dense hidden states of the committed tokens; with a
    draft vocabulary the logits are those of its rows of the lm_head."""
    ps = prompts(3, lo=5, hi=30, seed=11)
    proposer = make_proposer(cls=RecordingProposer, shortlist=shortlist)
    outs, _ = run(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), proposer, **engine_kw)
    path = tiny_checkpoint()
    target = dense_model(path)
    drafter = proposer.model
    assert len(proposer.blocks) >= 10
    for seq_ids, anchors, positions, logits in proposer.blocks:
        for s, sid in enumerate(seq_ids):
            full = ps[sid] + outs[sid][0]
            pos = positions[s]
            assert full[pos] == anchors[s]
            with torch.no_grad():
                _, captured = target(torch.tensor([full[:pos]]), capture_layers=drafter.cfg.target_layers)
                feat = drafter.fuse({i: h[0] for i, h in captured.items()})
                ctx = [tuple(t.unsqueeze(0) for t in layer.context_kv(feat, torch.arange(pos)))
                       for layer in drafter.layers]
                h = drafter.forward_blocks(torch.tensor([anchors[s]]), torch.tensor([pos]), ctx,
                                           torch.ones(1, pos, dtype=torch.bool), target.model.embed_tokens.weight)
                want = h[:, :logits.shape[1]] @ target.lm_head.weight.T
                if shortlist:
                    want = want[..., drafter.draft_vocab]
            torch.testing.assert_close(logits[s], want[0], atol=2e-4, rtol=1e-4)


def test_serving_drafts_equal_the_trainers_forward():
    """No train/serve skew: the block logits the engine drafts from (its paged context cache, one block per
    step) equal the trainer's forward over the whole finished sequence (the trainer's Target hidden
    states, every anchor in one pass under the block mask), so what training optimises is what is served."""
    ps = prompts(3, lo=6, hi=24, seed=12)
    proposer = make_proposer(cls=RecordingProposer)
    outs, _ = run(ps, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), proposer,
                  max_num_batched_tokens=16, max_num_seqs=4)
    drafter = proposer.model
    target = Target(tiny_checkpoint(), drafter.cfg.target_layers)
    checked = 0
    for sid, p in enumerate(ps):
        full = p + outs[sid][0]
        blocks = [(anchors[s], positions[s], logits[s]) for seq_ids, anchors, positions, logits in proposer.blocks
                  for s, x in enumerate(seq_ids) if x == sid and positions[s] < len(full)]
        with torch.no_grad():
            ctx = context_kv(drafter, target.hidden(full))
            h = draft_hidden(drafter, target.embed, torch.tensor(full), ctx, torch.tensor([b[1] for b in blocks]))
            want = h @ target.lm_head.T
        for j, (anchor, pos, logits) in enumerate(blocks):
            assert full[pos] == anchor
            torch.testing.assert_close(logits, want[j, :logits.shape[0]], atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked >= 15


# -- lossless outputs -----------------------------------------------------------------------------------
SHARED = prompts(1, lo=20, hi=20, seed=3)[0]


@pytest.mark.parametrize("engine_kw", [
    dict(),
    dict(async_scheduling=True),
    dict(max_num_batched_tokens=8, max_num_seqs=4),          # chunked prefill mixed with verifies
    dict(num_kv_blocks=8, block_size=4, max_num_batched_tokens=16, max_num_seqs=4),  # preemption
    dict(shortlist=120),
], ids=["sync", "async", "chunked", "preemption", "draft-vocab"])
def test_greedy_output_identical_to_no_speculation(engine_kw):
    ps = prompts(5, lo=3, hi=12, seed=5, prefix=SHARED[:8]) + prompts(1, lo=3, hi=12, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine_kw = dict(engine_kw)
    shortlist = engine_kw.pop("shortlist", 0)
    base, _ = run(ps, params, **engine_kw)
    got, stats = run(ps, params, make_proposer(shortlist=shortlist), debug_no_host_sync=True, **engine_kw)
    assert_same_outputs(tiny_checkpoint(), ps, params, got, base)
    assert stats.num_draft_tokens > 0
    hist = stats.acceptance_length_histogram      # index i: i drafts accepted in one verify step
    assert len(hist) == K + 1 and sum(i * n for i, n in enumerate(hist)) == stats.num_accepted_draft_tokens
    assert sum(hist) * K >= stats.num_draft_tokens > 0 and stats.drafter_seconds > 0
    if "num_kv_blocks" in engine_kw:
        assert stats.num_preemptions > 0


def test_seeded_sampling_with_greedy_drafts_is_identical_and_requests_opt_out():
    """Deterministic drafts at T > 0 are verified against the target's own seeded samples, so outputs equal
    plain decoding exactly (n > 1, per-request seeds); a request with num_speculative_tokens=0 drafts nothing."""
    ps = prompts(3, lo=3, hi=12, seed=8)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=21, n=2, max_tokens=10, ignore_eos=True)
    base, _ = run(ps, params)
    got, stats = run(ps, params, make_proposer(sample_drafts=False), async_scheduling=True)
    assert got == base and stats.num_draft_tokens > 0
    off = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, num_speculative_tokens=0)
    _, stats = run(ps, off, make_proposer())
    assert stats.num_draft_tokens == 0


# -- T = 1: the output distribution is the target's -----------------------------------------------------
def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.9995)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@torch.no_grad()
def _second_token_distribution(prompt: list[int]) -> np.ndarray:
    """Exact marginal of output token 2 under the target at T=1: sum_a p(a) p(. | a)."""
    model = dense_model(tiny_checkpoint())
    h, _ = model(torch.tensor([prompt]))
    p1 = model.compute_logits(h[0, -1]).softmax(-1)
    v = p1.shape[0]
    rows = torch.tensor([prompt + [a] for a in range(v)])
    h2, _ = model(rows)
    p2 = model.compute_logits(h2[:, -1]).softmax(-1)
    return (p1 @ p2).numpy()


@pytest.mark.parametrize("sample_drafts, shortlist, scales", [(True, 0, None), (False, 0, None), (True, 220, None),
                                                              (True, 0, (0.5, 2.0, 1.5, 0.8))],
                         ids=["selector-q", "greedy-drafts", "selector-q-draft-vocab", "selector-q-calibrated"])
def test_sampling_distribution_equals_the_targets(sample_drafts, shortlist, scales):
    prompt = prompts(1, lo=6, hi=6, seed=2)[0]
    want = _second_token_distribution(prompt)
    n = 3000          # three requests of n=1000 (a request may have at most 1024 sequences)
    params = SamplingParams(temperature=1.0, n=1000, max_tokens=3, ignore_eos=True)
    # Many candidates: q spreads like the (flat) random target's p, so drafts are often accepted and the
    # acceptance rule shapes a large share of the samples.
    # A draft vocabulary leaves q zero on the tokens outside it: the residual p - q must restore them.
    # A calibrated q (per-position temperature scales) is still exactly the q the rule sees.
    extra = {"q_temperature_scale": scales} if scales else {}
    proposer = make_proposer(sample_drafts=sample_drafts, shortlist=shortlist, selector_k=200, **extra)
    got, stats = run([prompt] * 3, params, proposer, max_num_seqs=256,
                     max_num_batched_tokens=2048, seed=1)
    print("accepted", stats.num_accepted_draft_tokens, "of", stats.num_draft_tokens)
    assert stats.num_accepted_draft_tokens > 0
    counts = np.bincount([c[1] for req in got for c in req], minlength=len(want)).astype(float)
    expected = want * n
    big = expected >= 5      # pool the rare tokens into one bin
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_critical(len(obs) - 1), f"chi2 {chi2:.1f} over {len(obs) - 1} dof"


def test_metrics_export_speculation():
    from server.metrics import ServerMetrics

    stats = {"acceptance_length_histogram": [3, 1, 0, 2], "num_draft_tokens": 18, "num_accepted_draft_tokens": 7,
             "num_steps": 4, "drafter_seconds": 0.2, "num_draft_blocks": 8, "num_drafts_proposed": 20}
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'namazu_spec_acceptance_length_bucket{le="1.0"} 3.0' in text
    assert 'namazu_spec_acceptance_length_bucket{le="2.0"} 4.0' in text
    assert 'namazu_spec_acceptance_length_bucket{le="+Inf"} 6.0' in text
    assert "namazu_spec_acceptance_length_sum 13.0" in text       # 3*1 + 1*2 + 2*4
    assert "namazu_spec_draft_acceptance_rate 0.3888" in text
    assert "namazu_spec_drafter_seconds_per_step 0.05" in text
    assert "namazu_spec_draft_block_length 2.5" in text
    assert "namazu_engine_num_draft_blocks_total 8.0" in text


def test_flags_and_their_errors():
    from namazu.engine_config import EngineConfig

    with pytest.raises(ValueError, match="--speculative-model"):
        EngineConfig(speculative_model="x", speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="--capture-shard-bytes"):
        EngineConfig(capture_shard_bytes="12 parsecs")
    # num_speculative_tokens=0 turns a configured drafter off: no proposer, no drafts.
    _, stats = run(prompts(2, seed=1), SamplingParams(temperature=0, max_tokens=4), None,
                   speculative_model=random_drafter(tiny_checkpoint()), num_speculative_tokens=0)
    assert stats.num_draft_tokens == 0


def test_graph_mode_drafts_and_outputs_equal_eager():
    """Graph mode pads a verify step's rows to its ladder entry; the drafter must still read the step's own
    rows (its hidden states, positions and slots), so greedy outputs equal plain decoding and the drafts
    are the eager mode's. Under inductor itself (the other graph tests trace with the "eager" backend):
    the compiled greedy drafted tail, and seeded sampled rows giving eager mode's tokens."""
    ps = prompts(2, lo=4, hi=10, seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, ignore_eos=True, seed=5 + i)
              for i in range(len(ps))]
    base, _ = run(ps, params)
    eager, eager_stats = run(ps, params, make_proposer(), max_num_seqs=2)
    eager_seeded, _ = run(ps, seeded, make_proposer(), max_num_seqs=2)
    with LLM(tiny_checkpoint(), executor="inline", drafter=make_proposer(), num_speculative_tokens=K,
             max_num_seqs=2, enforce_eager=False) as llm:
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
        graph, stats = [[c.token_ids for c in o.outputs] for o in outs], llm.engine.get_stats()
        outs = llm.generate(prompt_token_ids=ps, sampling_params=seeded, use_tqdm=False)
        graph_seeded = [[c.token_ids for c in o.outputs] for o in outs]
        called = llm.engine.executor.worker.runner.tails._called
    assert_same_outputs(tiny_checkpoint(), ps, params, eager, base)
    assert_same_outputs(tiny_checkpoint(), ps, params, graph, eager)
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_length_histogram == eager_stats.acceptance_length_histogram
    assert (2, False) in called, called
    assert_same_outputs(tiny_checkpoint(), ps, seeded, graph_seeded, eager_seeded)


# -- blocks that end where the drafter is unsure (--speculative-min-confidence) ----------------------------
def test_draft_counts_keep_the_prefix_whose_running_confidence_clears_the_bar():
    from namazu.spec.dflash import draft_counts

    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9],      # running 0.9 0.81 0.729 0.656
                         [0.5, 0.9, 0.9, 0.9],      # 0.5 0.45 0.405 0.36
                         [0.1, 1.0, 1.0, 1.0],      # below at once: still one draft
                         [1.0, 1.0, 1.0, 0.69]])    # 0.69 at the last
    assert draft_counts(conf, 0.7).tolist() == [3, 1, 1, 3]
    assert draft_counts(conf, 0.4).tolist() == [4, 3, 1, 4]
    assert draft_counts(conf, 0.0).tolist() == [4, 4, 4, 4]          # off: every block k long
    assert draft_counts(conf[:, :0], 0.5).tolist() == [0, 0, 0, 0]


def test_walk_confidence_is_known_before_each_pick():
    """Where a row samples, a position's confidence is q's largest probability, not q of the draw (a block
    that kept a draw only when it was likely would bias the output); where it is greedy, it is the
    selector's softmax at temperature 1 of its argmax, which at the first position (no predecessor pick)
    is the largest probability a T=1 walk's q gives."""
    drafter = make_proposer()
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    model = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    torch.manual_seed(1)
    m = 12
    h = torch.randn(m, K, t.hidden_size)
    anchor = torch.randint(0, t.vocab_size, (m,))
    logits = torch.randn(m, K, t.vocab_size) * 3
    u = torch.rand(m, K, dtype=torch.float64)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5] * (m // 4))
    with torch.no_grad():
        greedy = model.walk(anchor, h, logits, K)
        mixed = model.walk(anchor, h, logits, K, temperature, u)
        t1 = model.walk(anchor, h, logits, K, torch.ones(m), u)
    assert drafter.min_confidence == 0
    q_pick = mixed.q.gather(-1, mixed.ids.unsqueeze(-1)).squeeze(-1)
    sampled = temperature > 0
    torch.testing.assert_close(mixed.confidence[sampled], mixed.q.max(-1).values[sampled])
    assert bool((q_pick[sampled] < mixed.confidence[sampled]).any())      # some draws were not the likeliest
    torch.testing.assert_close(mixed.confidence[~sampled], greedy.confidence[~sampled])
    torch.testing.assert_close(greedy.confidence[:, 0], t1.q[:, 0].max(-1).values)
    assert bool(((greedy.confidence > 0) & (greedy.confidence <= 1)).all())


class CountingProposer(DFlashProposer):
    """Keeps the draft count of every block it proposes (batch 1: one per step)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.blocks: list[torch.Tensor] = []     # kept as tensors: reading them inside the step would sync

    def propose(self, inp, k):
        proposal = super().propose(inp, k)
        counts = proposal.counts if proposal.counts is not None else torch.full((len(inp.seq_ids),), k)
        self.blocks.append(counts.clone())
        return proposal

    @property
    def counts(self) -> list[list[int]]:
        return [c.tolist() for c in self.blocks]


MIN_CONFIDENCE = 0.08   # the random drafter's running confidence falls past it at its 2nd or 3rd draft


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_early_block_ends_keep_outputs_identical_and_verify_fewer_rows(async_scheduling):
    """With a threshold the blocks have varying lengths; greedy outputs stay those of plain decoding; and a
    short block costs a short verify: at batch 1 each verify step's forward has 1 + the previous block's
    count rows, also when async scheduling planned all K before the count was known."""
    p = prompts(1, lo=5, hi=12, seed=31)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = run(p, params)
    proposer = make_proposer(cls=CountingProposer)
    proposer.min_confidence = MIN_CONFIDENCE
    with LLM(tiny_checkpoint(), executor="inline", drafter=proposer, num_speculative_tokens=K,
             async_scheduling=async_scheduling, debug_no_host_sync=True) as llm:
        runner = llm.engine.executor.worker.runner
        runner.profile = []
        outs = llm.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
    assert_same_outputs(tiny_checkpoint(), p, params, [[c.token_ids for c in o.outputs] for o in outs], base)
    counts = [c[0] for c in proposer.counts]
    assert min(counts) >= 1 and len(set(counts)) > 1, counts                 # blocks really vary
    rows = [s.num_tokens for s in runner.profile]
    # Step 0 is the prefill; step i + 1 verifies block i. The last blocks may be cut by max_tokens.
    checked = [(rows[i + 1], 1 + c) for i, c in enumerate(counts[:len(rows) - 1])][:len(counts) // 2]
    assert all(r == want for r, want in checked), checked
    assert stats.num_draft_blocks == len(counts)
    assert stats.num_drafts_proposed == sum(counts)
    assert 1 <= stats.mean_draft_block_length < K
    assert stats.num_draft_tokens <= stats.num_drafts_proposed


def test_early_block_ends_keep_seeded_sampling_identical_and_graph_mode_equal():
    """At T > 0 with deterministic drafts the outputs equal plain decoding exactly, blocks ending early or
    not (n > 1, seeds); graph mode, whose verify entries are K + 1 rows wide, gives the eager outputs."""
    ps = prompts(3, lo=3, hi=12, seed=8)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=21, n=2, max_tokens=10, ignore_eos=True)
    base, _ = run(ps, params)
    proposer = make_proposer(sample_drafts=False, cls=CountingProposer)
    proposer.min_confidence = MIN_CONFIDENCE
    got, stats = run(ps, params, proposer, async_scheduling=True)
    assert_same_outputs(tiny_checkpoint(), ps, params, got, base)
    assert stats.num_draft_tokens > 0
    assert len({c for block in proposer.counts for c in block}) > 1
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, _ = run(ps[:2], greedy)
    graph = make_proposer()
    graph.min_confidence = MIN_CONFIDENCE
    got, stats = run(ps[:2], greedy, graph, max_num_seqs=2, enforce_eager=False)
    assert_same_outputs(tiny_checkpoint(), ps[:2], greedy, got, want)
    assert 1 <= stats.mean_draft_block_length < K


def test_min_confidence_flag_validation_and_choice():
    from namazu.engine_config import EngineConfig

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--speculative-min-confidence"):
            EngineConfig(speculative_min_confidence=bad)
    with pytest.raises(ValueError, match="no confidence"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=2, speculative_min_confidence=0.2)
    # A named drafter keeps full blocks unless told; the flag reaches the proposer the workers get.
    path = random_drafter(tiny_checkpoint())
    with LLM(tiny_checkpoint(), executor="inline", speculative_model=path) as llm:
        assert llm.engine.drafter.min_confidence == 0 and llm.engine.config.speculative_min_confidence == 0
    with LLM(tiny_checkpoint(), executor="inline", speculative_model=path, speculative_min_confidence=0.25) as llm:
        assert llm.engine.drafter.min_confidence == 0.25
        assert llm.engine.executor.worker.runner.proposer.min_confidence == 0.25
    # A caller's drafter keeps its own threshold unless the flag says otherwise.
    own = make_proposer()
    own.min_confidence = 0.4
    with LLM(tiny_checkpoint(), executor="inline", drafter=own, num_speculative_tokens=K) as llm:
        assert llm.engine.config.speculative_min_confidence == 0.4


def test_blocks_ending_early_keep_the_targets_distribution_where_they_end():
    """T = 1 through the selector walk, the block-ending rule and the acceptance rule (no model: the same
    target logits for every row, so the second output token must follow that position's p whatever the
    first was). Whether draft 1 is verified varies by row; had the rule read q of the drawn draft, the
    verified draws would lean to likely candidates and the second token would not follow p."""
    from namazu.spec.dflash import draft_counts
    from namazu.spec.verify import verify_stochastic

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    model = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    g = torch.Generator().manual_seed(5)
    s, k, v = 40_000, 2, t.vocab_size
    h = torch.randn(1, k, t.hidden_size, generator=g).expand(s, -1, -1)
    logits = (torch.randn(1, k, v, generator=g) * 3).expand(s, -1, -1)
    anchor = torch.full((s,), 7)
    with torch.no_grad():
        walk = model.walk(anchor, h, logits, k, torch.ones(s), torch.rand(s, k, generator=g, dtype=torch.float64))
    running = walk.confidence.cumprod(-1)[:, 1]
    counts = draft_counts(walk.confidence, float(running.median()))
    assert 0.2 < float((counts == 2).float().mean()) < 0.8            # draft 1 verified on some rows only
    # The target at each position: most of its mass on that position's candidates, so drafts are often
    # accepted and the rule (not the fallback to p) decides most second tokens.
    cand = logits[0].topk(model.cfg.selector_k, -1).indices
    on_cand = torch.zeros(k + 1, v).scatter_(1, torch.cat([cand, cand[-1:]]), 1.0)
    target = torch.randn(k + 1, v, generator=g) + 5 * on_cand
    p = target.softmax(-1)
    sampled = torch.multinomial(p.repeat(s, 1), 1, generator=g).view(s, k + 1)
    tokens, n = verify_stochastic(target.expand(s, -1, -1), sampled, walk.ids, walk.q, counts,
                                  torch.zeros(s, dtype=torch.bool), torch.arange(s), torch.arange(k + 1).repeat(s, 1),
                                  seeded=torch.zeros(s, dtype=torch.bool))
    second = tokens[n >= 1, 1]
    assert len(second) > s // 4
    counts_obs = np.bincount(second.numpy(), minlength=v).astype(float)
    expected = p[1].numpy() * len(second)
    big = expected >= 5
    obs = np.append(counts_obs[big], counts_obs[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_critical(len(obs) - 1), f"chi2 {chi2:.1f} over {len(obs) - 1} dof"
