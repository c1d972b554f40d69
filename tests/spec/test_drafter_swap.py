"""Replacing the serving DFlash drafter in a running engine (`namazu/spec/drafter_swap.py`): outputs of the
sequences in flight are unchanged, every KV block comes back, the new drafter drafts from a context built
from each sequence's own tokens (equal to a dense recomputation), a bad checkpoint is refused with the old
drafter still serving, and acceptance is tallied per drafter."""
from pathlib import Path

import pytest
import torch
from dflash_fixtures import drafter_config, random_drafter, shortlisted_drafter
from engine_helpers import assert_same_outputs, dense_model, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.config import ModelConfig
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.drafter_swap import DrafterSwapError, drafter_id, resolve_under_root

K = 3
SHARED = prompts(1, lo=20, hi=20, seed=3)[0]     # a shared prefix: its blocks sit in the prefix cache


def proposer(path: str, sample_drafts: bool = False) -> DFlashProposer:
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    return DFlashProposer(path, t.vocab_size, t.hidden_size, t.num_hidden_layers, sample_drafts=sample_drafts)


def requests():
    ps = prompts(4, lo=3, hi=10, seed=7, prefix=SHARED) + prompts(2, lo=4, hi=12, seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=14, ignore_eos=True)
    return ps, [greedy, seeded, greedy, greedy, seeded, greedy]


def drive(llm: LLM, ps, params, swaps: list[str]) -> list:
    """Runs the requests step by step, switching to the next drafter of `swaps` as soon as the serving one
    had some of its drafts verified (so each serves while sequences are in flight)."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(str(i), None, sp, prompt_token_ids=p)
    done, pending, verified = {}, list(swaps), 0
    while engine.has_unfinished_requests():
        outs = []
        if pending and engine.get_stats().num_draft_tokens > verified:
            outs = engine.set_drafter(pending.pop(0))
            verified = engine.get_stats().num_draft_tokens
        for out in outs + engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not pending, "the requests ended before every swap"
    return [[c.token_ids for c in done[str(i)].outputs][0] for i in range(len(ps))]


def serving(llm: LLM) -> DFlashProposer:
    return llm.engine.executor.worker.runner.spec.proposer


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(async_scheduling=True),
                                       dict(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["sync", "async", "async-chunked"])
def test_swaps_mid_generation_keep_outputs_and_free_every_block(engine_kw):
    ps, params = requests()
    target = tiny_checkpoint()
    with LLM(target, executor="inline", num_speculative_tokens=0, **engine_kw) as llm:
        want = drive(llm, ps, params, [])
    a, b = random_drafter(target), random_drafter(target, seed=1)
    small = random_drafter(target, num_layers=1)       # a smaller context cache: a new one is allocated
    with LLM(target, executor="inline", drafter=proposer(a), num_speculative_tokens=K, **engine_kw) as llm:
        ids = [llm.engine.drafter_id]
        got = drive(llm, ps, params, [b, small, a])
        ids += [drafter_id(proposer(p)) for p in (b, small)]
        engine = llm.engine
        assert serving(llm).path == a and engine.drafter_id == ids[0]
        stats = engine.get_stats()
        bm = engine.block_manager
        assert bm.usage == 0 and len(bm.free) + len(bm.evictable) == bm.num_blocks
        bm.check_invariants([])
    assert_same_outputs(target, ps, params, got, want)
    assert stats.num_drafter_swaps == 3 and stats.num_preemptions >= 3
    by = stats.acceptance_by_drafter
    assert set(by) == set(ids) and len(set(ids)) == 3
    assert sum(v["num_draft_tokens"] for v in by.values()) == stats.num_draft_tokens
    assert sum(v["num_accepted_draft_tokens"] for v in by.values()) == stats.num_accepted_draft_tokens
    assert [sum(col) for col in zip(*(v["acceptance_length_histogram"] for v in by.values()))] == \
        stats.acceptance_length_histogram
    assert all(v["num_draft_tokens"] > 0 for v in by.values())


class Recorder:
    """Wraps a serving proposer's draft_block: every block's sequences, anchors, positions and logits."""

    def __init__(self, p: DFlashProposer):
        self.blocks, self.inner = [], p.draft_block
        p.draft_block = self

    def __call__(self, inp, k):
        anchor, pos, h, logits = self.inner(inp, k)
        self.blocks.append((list(inp.seq_ids), anchor.tolist(), pos.tolist(), logits.clone()))
        return anchor, pos, h, logits


def test_the_new_drafter_drafts_from_a_context_built_from_each_sequences_tokens():
    """After the swap every block equals the new drafter run over the target's dense hidden states of the
    committed tokens: no context entry of the old drafter is read, the shared prefix's cached blocks
    included (the cache is emptied and every sequence recomputed)."""
    ps = prompts(3, lo=3, hi=8, seed=13, prefix=SHARED)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(ps)
    target_path = tiny_checkpoint()
    b = random_drafter(target_path, seed=1)     # other weights: the old context would be visible
    with LLM(target_path, executor="inline", drafter=proposer(random_drafter(target_path)),
             num_speculative_tokens=K, async_scheduling=True) as llm:
        engine = llm.engine
        for i, p in enumerate(ps):
            engine.add_request(str(i), None, params[i], prompt_token_ids=p)
        outs = {}
        for _ in range(4):
            outs.update({o.request_id: o for o in engine.step()})
        outs.update({o.request_id: o for o in engine.set_drafter(b)})
        rec = Recorder(serving(llm))
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        drafter = serving(llm).model
    target = dense_model(target_path)
    assert len(rec.blocks) >= 5
    for seq_ids, anchors, positions, logits in rec.blocks:
        for s, sid in enumerate(seq_ids):
            full = ps[sid] + outs[str(sid)].outputs[0].token_ids
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
            torch.testing.assert_close(logits[s], want[0], atol=2e-4, rtol=1e-4)


def _broken(tmp_path: Path, name: str, what: str) -> str:
    """A drafter directory with one defect."""
    from safetensors.torch import load_file, save_file

    target = tiny_checkpoint()
    d = tmp_path / name
    if what == "vocab_size":
        DFlashDrafter(drafter_config(target, vocab_size=300)).save(d)
        return str(d)
    if what == "num_layers":       # a larger context cache than the server planned for
        DFlashDrafter(drafter_config(target, num_layers=3)).save(d)
        return str(d)
    src = Path(shortlisted_drafter(target))
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    w = load_file(src / "model.safetensors")
    if what == "missing":
        del w["layers.0.q_proj.weight"]
    elif what == "repeated":          # the shapes are right: only loading the weights finds it (in the worker)
        w["draft_vocab"] = w["draft_vocab"].clone().fill_(3)
    save_file(w, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("what, needle", [
    ("vocab_size", "'vocab_size'"), ("missing", "'layers.0.q_proj.weight' is missing"),
    ("num_layers", "num_layers=3"), ("repeated", "repeated ids"), ("nowhere", "no drafter config.json")])
def test_a_bad_drafter_is_refused_and_the_old_one_serves_on(tmp_path, what, needle):
    target = tiny_checkpoint()
    a = random_drafter(target)
    bad = str(tmp_path / "nowhere") if what == "nowhere" else _broken(tmp_path, "bad", what)
    ps, params = requests()
    with LLM(target, executor="inline", drafter=proposer(a), num_speculative_tokens=K) as llm:
        before = llm.engine.drafter_id
        with pytest.raises(DrafterCheckpointError, match=needle):
            llm.set_drafter(bad)
        assert llm.engine.drafter_id == before and serving(llm).path == a
        assert llm.engine.executor.worker.staged_drafter is None
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
    assert all(len(o.outputs[0].token_ids) == 14 for o in outs)
    assert stats.num_drafter_swaps == 0 and stats.num_draft_tokens > 0 and list(stats.acceptance_by_drafter) == [before]


def test_only_a_dfl_drafter_is_replaced_and_paths_stay_under_the_root(tmp_path):
    target = tiny_checkpoint()
    with LLM(target, executor="inline", num_speculative_tokens=0) as llm:
        with pytest.raises(DrafterSwapError, match="serves no drafter"):
            llm.set_drafter(random_drafter(target))
    root = tmp_path / "root"
    (root / "d1").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    assert resolve_under_root("d1", root) == (root / "d1").resolve()
    assert resolve_under_root(str(root / "d1"), root) == (root / "d1").resolve()
    for bad in ("../outside", str(tmp_path / "outside"), "link", "d1/../../outside"):
        with pytest.raises(DrafterSwapError, match="outside the drafter root"):
            resolve_under_root(bad, root)
    with pytest.raises(DrafterSwapError, match="no such drafter directory"):
        resolve_under_root("d2", root)
    with pytest.raises(DrafterSwapError, match="non-empty string"):
        resolve_under_root(3, root)      # type: ignore[arg-type]


def test_drafter_ids_tell_retrained_weights_apart(tmp_path):
    target = tiny_checkpoint()
    t = ModelConfig.from_pretrained(target)
    m = DFlashDrafter.load(random_drafter(target), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    m.save(tmp_path / "d")
    first = drafter_id(proposer(str(tmp_path / "d")))
    with torch.no_grad():
        m.norm.weight.add_(1e-3)
    m.save(tmp_path / "d")
    second = drafter_id(proposer(str(tmp_path / "d")))
    assert first != second and first.startswith("d-") and second.startswith("d-")


def test_graph_mode_swaps_like_eager(monkeypatch):
    """Graph mode compiles the target's step only; after a swap the eagerly run new drafter reads the padded
    step's own rows as before: the same outputs and the same acceptance per drafter as eager mode."""
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")     # the same trace without inductor's code generation
    target = tiny_checkpoint()
    ps, params = requests()
    ps, params = ps[:2], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    b = random_drafter(target, seed=1)
    runs = []
    for eager in (True, False):
        with LLM(target, executor="inline", drafter=proposer(random_drafter(target)), num_speculative_tokens=K,
                 max_num_seqs=2, enforce_eager=eager) as llm:
            runs.append((drive(llm, ps, params, [b]), llm.engine.get_stats().acceptance_by_drafter))
    (eager_out, eager_by), (graph_out, graph_by) = runs
    assert_same_outputs(target, ps, params, graph_out, eager_out)
    assert graph_by == eager_by and len(graph_by) == 2
