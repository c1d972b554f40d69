"""The shadow drafter (`namazu/spec/shadow.py`): its scores against hand-computed cases, served outputs that do not
change with a shadow on, a shadow identical to the serving drafter scoring what the serving drafter got, bad
shadow directories refused at start-up, the request sample, and the metrics and refresh report that read it."""
import json
import os
import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dflash_fixtures import random_drafter
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.assets import resolve_model_path
from namazu.config import ModelConfig
from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.shadow import (
    STREAM_SHADOW,
    ShadowError,
    ShadowRunner,
    _Block,
    exact_accepted,
    expected_accepted,
    shadow_sampled,
)
from namazu.spec.shadow_report import from_prometheus, from_stats, shadow_markdown
from server.metrics import ServerMetrics

K = 3


# -- the scoring functions, by hand ---------------------------------------------------------------------------
def test_exact_rule_counts_the_matching_prefix_and_waits_for_tokens():
    assert exact_accepted([5, 6, 7], [5, 6, 8]) == (2, True)       # a mismatch settles it
    assert exact_accepted([5, 6, 7], [9]) == (0, True)
    assert exact_accepted([5, 6, 7], [5, 6]) == (2, False)         # not every draft compared yet
    assert exact_accepted([5, 6, 7], [5, 6, 7, 1]) == (3, True)
    assert exact_accepted([], [4]) == (0, True)


def test_expected_acceptance_by_hand():
    # r = min(1, p/q) = 1, 0.9, 0.5: E = 1 + 1 * 0.9 + 1 * 0.9 * 0.5 = 2.35
    assert expected_accepted([0.5, 0.9, 0.2], [0.25, 1.0, 0.4]) == pytest.approx(2.35)
    assert expected_accepted([0.1, 1.0], [0.4, 0.5]) == pytest.approx(0.25 + 0.25)
    assert expected_accepted([], []) == 0.0


@pytest.fixture(scope="module")
def runner() -> ShadowRunner:
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    return ShadowRunner(random_drafter(tiny_checkpoint()), (t.vocab_size, t.hidden_size, t.num_hidden_layers), K,
                        sample_drafts=True, min_confidence=0.0)


def _step(runner, seq_ids, verify_from):
    b = SimpleNamespace(seqs=SimpleNamespace(seq_ids=np.asarray(seq_ids)), shadow_seq_ids=[],
                        spec=SimpleNamespace(batch_index=np.arange(len(seq_ids))))
    runner.note(b)
    return b, SimpleNamespace(verify_from=np.asarray(verify_from))


def test_expected_acceptance_reads_the_target_rows_on_the_shadows_path(runner):
    """A held block d = [1, 2, 3] with q(d) = [0.5, 0.5, 0.25], anchored after 10 tokens; the next step verifies
    the serving drafts s = [1, 3]. Row 0 (after the anchor) gives p(d_1) = 0.5; row 1 is after s_1 = d_1, so it
    gives p(d_2) = 0.4; row 2 is after s_2 = 3 != d_2: not the shadow's path, not scored. r = 1, 0.8:
    expected tau = 1 + 1 + 0.8 = 2.8, truncated (2 of 3 drafts scored). A second sequence's block is not at its
    anchor (recomputed meanwhile): dropped."""
    runner.shadowed = {7, 8}
    runner.held = {7: _Block(10, [1, 2, 3], [0.5, 0.5, 0.25]), 8: _Block(20, [1], [0.5])}
    probs = torch.tensor([[0.25, 0.5, 0.125, 0.125], [0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1],
                          [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    processed = probs.log() + 3.0             # any shift: the rule reads the softmax
    b, prep = _step(runner, [7, 8], [9, 25])
    row_layout = torch.tensor([[0, 1, 2], [3, 4, 5]])
    runner.score_on_device(b, prep, processed, torch.tensor([[1, 3], [0, 0]]), torch.tensor([2, 0]), row_layout)
    t = runner.after_read(SimpleNamespace(tokens_of=lambda sid: []))
    assert t["num_expected_blocks"] == 1 and t["expected_acceptance_length_sum"] == pytest.approx(2.8)
    assert t["num_truncated_blocks"] == 1 and t["num_dropped_blocks"] == 1 and not runner.held


def test_a_row_past_the_verified_drafts_is_not_scored(runner):
    """d = [1, 3] equals the serving drafts, but the step verified only one of them: row 1 (after s_1) exists,
    row 2 would be padding. p(d_1) = 0.5, p(d_2) = 0.4 with q = 0.5 each: 1 + 1 + 0.8."""
    runner.shadowed, runner.held = {7}, {7: _Block(10, [1, 3], [0.5, 0.5])}
    probs = torch.tensor([[0.25, 0.5, 0.125, 0.125], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    b, prep = _step(runner, [7], [9])
    runner.score_on_device(b, prep, probs.log(), torch.tensor([[1, 3]]), torch.tensor([1]),
                           torch.tensor([[0, 1, 1]]))
    t = runner.after_read(SimpleNamespace(tokens_of=lambda sid: []))
    assert t["expected_acceptance_length_sum"] == pytest.approx(2.8) and t["num_truncated_blocks"] == 0


def test_exact_blocks_stay_open_until_settled_and_score_on_what_they_got(runner):
    runner.shadowed, runner.held = {5}, {}
    runner.open = {5: [_Block(3, [10, 11, 12])]}
    hist = [0, 1, 2, 10]
    t = runner.after_read(SimpleNamespace(tokens_of=lambda sid: hist))
    assert t["num_exact_blocks"] == 0 and 5 in runner.open          # one of three compared: still open
    hist += [11]
    runner.forget([5], SimpleNamespace(tokens_of=lambda sid: hist))  # the sequence ends: 2 matched of 2 known
    t = runner.after_read(SimpleNamespace(tokens_of=lambda sid: hist))
    assert t["num_exact_blocks"] == 1 and t["acceptance_length_histogram"] == [0, 0, 1]
    assert not runner.open and 5 not in runner.shadowed


# -- the request sample ---------------------------------------------------------------------------------------
def test_the_sample_is_a_deterministic_share_of_request_ids():
    ids = [f"req-{i}" for i in range(2000)]
    assert not any(shadow_sampled(r, 0.0) for r in ids) and all(shadow_sampled(r, 1.0) for r in ids)
    share = np.mean([shadow_sampled(r, 0.25) for r in ids])
    assert 0.2 < share < 0.3
    assert [shadow_sampled(r, 0.25) for r in ids] == [shadow_sampled(r, 0.25) for r in ids]
    assert all(shadow_sampled(r, 0.5) for r in ids if shadow_sampled(r, 0.25))      # nested: F grows the set
    assert STREAM_SHADOW != 3         # not the serving drafter's draws (dflash_proposer.STREAM_DRAFT)


def test_the_shadow_draws_from_its_own_noise_stream(runner):
    assert runner.proposer.draft_stream == STREAM_SHADOW


# -- in the engine ----------------------------------------------------------------------------------------------
def _generate(llm: LLM, ps, params):
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(f"r{i}", None, sp, prompt_token_ids=p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [[c.token_ids for c in done[f"r{i}"].outputs] for i in range(len(ps))], engine.get_stats()


@pytest.mark.parametrize("engine_kw", [dict(), dict(async_scheduling=False),
                                       dict(max_num_batched_tokens=16, max_num_seqs=4),
                                       dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["async", "sync", "chunked", "preempting"])
def test_outputs_are_unchanged_with_a_shadow_on(engine_kw):
    target = tiny_checkpoint()
    serving, shadow = random_drafter(target), random_drafter(target, seed=1)
    ps = prompts(5, lo=3, hi=12, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True),      # engine-drawn seed
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, ignore_eos=True)]
    kw = dict(executor="inline", num_speculative_tokens=K, **engine_kw)
    with LLM(target, drafter=_proposer(serving, sample=True), **kw) as llm:
        want, _ = _generate(llm, ps, params)
    with LLM(target, drafter=_proposer(serving, sample=True), shadow_drafter=shadow, shadow_fraction=1.0,
             **kw) as llm:
        got, stats = _generate(llm, ps, params)
        bm = llm.engine.block_manager
        assert bm.usage == 0
    assert got == want
    if "num_kv_blocks" in engine_kw:
        assert stats.num_preemptions > 0
    sh = stats.shadow_acceptance[stats.shadow_drafter_id]
    assert sh["num_shadowed_requests"] == len(ps) and sh["role"] == "shadow"
    assert sh["num_exact_blocks"] > 0 and sh["num_expected_blocks"] > 0      # both rules ran
    assert stats.shadow_seconds > 0
    assert 1.0 <= sh["mean_acceptance_length_expected"] <= K + 1


def _proposer(path: str, sample: bool = False):
    from namazu.spec.dflash_proposer import DFlashProposer

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    return DFlashProposer(path, t.vocab_size, t.hidden_size, t.num_hidden_layers, sample_drafts=sample)


def test_a_shadow_identical_to_the_serving_drafter_scores_what_it_got():
    """The shipped drafter beside itself at T=0: each block the serving drafter had verified, the shadow drafted
    too (same context, same greedy walk) and scored from the committed tokens; it also scores the blocks the
    serving drafter never had verified (at most one per sequence, its last), so its histogram holds the serving
    one's plus those."""
    drafter = os.path.join(resolve_model_path(None), "drafter")
    texts = ["こんにちは、今日は", "The capital of France is", "def fib(n):", "JSON: {\"name\":"]
    with LLM(executor="inline", shadow_drafter=drafter, shadow_fraction=1.0, async_scheduling=False,
             speculative_adaptive=False, speculative_min_confidence=0.0, speculative_disable_batch_size=0) as llm:
        llm.generate(texts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.get_stats()
    sh = stats.shadow_acceptance[stats.shadow_drafter_id]
    mine, theirs = sh["acceptance_length_histogram"], sh["serving_acceptance_length_histogram"]
    assert theirs == stats.acceptance_length_histogram[:len(theirs)]
    assert sum(theirs) > 20 and len(theirs) > 2                  # a drafter that gets drafts accepted
    assert len(mine) >= len(theirs)
    assert all(m >= t for m, t in zip(mine, theirs)), (mine, theirs)
    assert 0 < sum(mine) - sum(theirs) <= len(texts), (mine, theirs)
    assert sh["num_expected_blocks"] == 0 and sh["num_dropped_blocks"] == 0


def test_fraction_zero_shadows_nothing_and_a_share_shadows_its_hash():
    target = tiny_checkpoint()
    d = random_drafter(target)
    ps = prompts(6, lo=3, hi=8, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(ps)
    for fraction in (0.0, 0.5):
        with LLM(target, executor="inline", speculative_model=d, num_speculative_tokens=K, shadow_drafter=d,
                 shadow_fraction=fraction) as llm:
            _, stats = _generate(llm, ps, params)
            # The worker learns of finished sequences with the next step: after one more request, none of the
            # first ones is left in the shadow's state.
            llm.engine.add_request("later", None, params[0], prompt_token_ids=ps[0])
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            runner = llm.engine.executor.worker.runner.shadow
            first = set(range(len(ps)))
            assert not (runner.shadowed | set(runner.open) | set(runner.held)) & first
        sh = stats.shadow_acceptance[stats.shadow_drafter_id]
        want = sum(shadow_sampled(f"r{i}", fraction) for i in range(len(ps)))
        assert sh["num_shadowed_requests"] == want
        if fraction == 0.0:
            assert sh["num_proposed_blocks"] == sh["num_exact_blocks"] == 0
        else:
            assert 0 < want < len(ps) and sh["num_exact_blocks"] > 0
            assert sum(sh["serving_acceptance_length_histogram"]) < sum(stats.acceptance_length_histogram)


# -- bad shadows ------------------------------------------------------------------------------------------------
def test_a_bad_shadow_directory_is_refused_at_start_up():
    target = tiny_checkpoint()
    d = random_drafter(target)
    kw = dict(executor="inline", speculative_model=d, num_speculative_tokens=K)
    with pytest.raises(DrafterCheckpointError, match="not a directory"):
        LLM(target, shadow_drafter=os.path.join(tempfile.gettempdir(), "no-such-shadow-drafter"), **kw)
    wrong = tempfile.mkdtemp(prefix="namazu-shadow-wrong-")
    shutil.copytree(d, wrong, dirs_exist_ok=True)
    cfg = json.loads(open(os.path.join(wrong, "config.json")).read())
    cfg["hidden_size"] += 8
    open(os.path.join(wrong, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(DrafterCheckpointError, match="hidden_size"):
        LLM(target, shadow_drafter=wrong, **kw)
    os.remove(os.path.join(wrong, "model.safetensors"))
    with pytest.raises(DrafterCheckpointError):
        LLM(target, shadow_drafter=wrong, **kw)
    with pytest.raises(ShadowError, match="serves no drafter"):
        LLM(target, executor="inline", num_speculative_tokens=0, shadow_drafter=d)
    with pytest.raises(ValueError, match="shadow-fraction"):
        LLM(target, shadow_drafter=d, shadow_fraction=1.5, **kw)


# -- metrics and the refresh report ----------------------------------------------------------------------------
def _stats_with_shadow() -> dict:
    target = tiny_checkpoint()
    d = random_drafter(target)
    ps = prompts(3, lo=3, hi=8, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    with LLM(target, executor="inline", drafter=_proposer(d, sample=True), num_speculative_tokens=K,
             shadow_drafter=d, shadow_fraction=1.0) as llm:
        _, stats = _generate(llm, ps, params)
    import dataclasses

    return dataclasses.asdict(stats)


def test_metrics_label_the_shadow_and_the_refresh_report_reads_them():
    stats = _stats_with_shadow()
    text = ServerMetrics(lambda: stats, "tiny").render().decode()
    sid = stats["shadow_drafter_id"]
    assert f'namazu_spec_shadow_acceptance_length_count{{drafter="{sid}",model_name="tiny",role="shadow"}}' in text
    assert 'role="serving"' in text and "namazu_engine_shadow_seconds_total" in text
    assert "namazu_spec_shadow_expected_acceptance_length_sum_total" in text
    assert "namazu_spec_shadow_seconds_per_step" in text
    live = from_prometheus(text)
    assert set(live) == {sid}
    want = from_stats(stats)[sid]
    for key, value in want.items():
        assert live[sid][key] == pytest.approx(value, rel=1e-6), key
    assert want["exact_blocks"] > 0 and want["expected_blocks"] > 0 and want["mean"] > 0
    overall = {"ratio": 1.1, "a_acceptance": 2.0, "b_acceptance": 2.2, "gain_low": 0.05, "gain_high": 0.3}
    md = shadow_markdown(live, overall, {sid: "candidate"})
    assert f"`{sid}` | candidate" in md and f"{want['mean']:.3f}" in md


def test_refresh_takes_the_live_shadow_numbers_into_its_report(tmp_path):
    from namazu.spec.refresh import add_live_shadow

    stats = _stats_with_shadow()
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    (tmp_path / "report.md").write_text("# Drafter refresh: KEEP\n")
    report = {"overall": {"ratio": 1.0, "a_acceptance": 1.0, "b_acceptance": 1.0, "gain_low": -0.1,
                          "gain_high": 0.1}}
    base = stats["shadow_acceptance"][stats["shadow_drafter_id"]]["path"]
    args = SimpleNamespace(shadow_metrics=str(tmp_path / "stats.json"), base=base)
    for _ in range(2):        # a second run replaces the section
        add_live_shadow(report, args, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.count("## Live shadow") == 1 and "serving (base)" in md
    assert json.loads((tmp_path / "report.json").read_text())["live_shadow"][stats["shadow_drafter_id"]]["mean"] > 0
    with pytest.raises(SystemExit, match="no such file"):
        add_live_shadow(report, SimpleNamespace(shadow_metrics=str(tmp_path / "nope"), base=base), tmp_path)


def test_graph_mode_with_a_shadow_serves_and_scores_as_eager(monkeypatch):
    """CPU graph mode runs a step with a shadowed sequence without its compiled drafted tail (the shadow reads
    the processed rows the tail keeps inside), the others with it: the same outputs as eager mode without a
    shadow, and the same shadow scores as eager mode with one."""
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")     # the same trace without inductor's code generation
    target = tiny_checkpoint()
    serving, shadow = random_drafter(target), random_drafter(target, seed=1)
    ps = prompts(4, lo=3, hi=9, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(ps)
    assert 0 < sum(shadow_sampled(f"r{i}", 0.5) for i in range(len(ps))) < len(ps)
    runs, ran = [], []
    for eager, fraction in ((True, None), (True, 0.5), (False, 0.5)):
        kw = dict(shadow_drafter=shadow, shadow_fraction=fraction) if fraction is not None else {}
        with LLM(target, executor="inline", drafter=_proposer(serving), num_speculative_tokens=K, max_num_seqs=2,
                 enforce_eager=eager, **kw) as llm:
            tails = llm.engine.executor.worker.runner.tails
            if tails is not None:       # count the steps the compiled tail ran
                monkeypatch.setattr(tails, "run",
                                    lambda *a, _run=tails.run, _ran=ran, **k: _ran.append(1) or _run(*a, **k))
            out, stats = _generate(llm, ps, params)
        scores = {k: v for k, v in (stats.shadow_acceptance.get(stats.shadow_drafter_id) or {}).items()
                  if k != "seconds"}
        runs.append((out, scores))
    assert runs[1][0] == runs[0][0] and runs[2][0] == runs[0][0]
    assert runs[2][1] == runs[1][1] and runs[1][1]["num_exact_blocks"] > 0
    assert ran, "no step without a shadowed sequence ran the compiled tail"


def test_seeded_requests_are_scored_by_the_exact_rule_and_unseeded_by_the_expected_one():
    """A request that gave its seed is verified by exact match at T > 0 (spec/verify.py), so its shadow blocks
    are scored exactly from the committed tokens; an unseeded one by the expected acceptance."""
    target = tiny_checkpoint()
    d = random_drafter(target)
    ps = prompts(2, lo=3, hi=8, seed=9)
    got = {}
    for seed in (3, None):
        params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=8, ignore_eos=True)] * len(ps)
        with LLM(target, executor="inline", drafter=_proposer(d, sample=True), num_speculative_tokens=K,
                 shadow_drafter=d, shadow_fraction=1.0) as llm:
            _, stats = _generate(llm, ps, params)
        got[seed] = stats.shadow_acceptance[stats.shadow_drafter_id]
    assert got[3]["num_exact_blocks"] > 0 and got[3]["num_expected_blocks"] == 0
    assert got[None]["num_exact_blocks"] == 0 and got[None]["num_expected_blocks"] > 0


def test_a_server_with_a_shadow_serves_scores_and_reports_it(tmp_path):
    """`python -m namazu.server --shadow-drafter DIR --shadow-fraction 1` (worker process, async front): greedy
    completions equal to a server without a shadow, the shadow named by GET /admin/drafter, its series in
    /metrics, and the refresh report reading them from the URL."""
    import httpx
    from server_harness import LiveServer, make_tiny_model

    from namazu.spec.shadow_report import read_shadow_metrics

    model = make_tiny_model(tmp_path / "model")
    root = tmp_path / "drafters"
    root.mkdir()
    shutil.copytree(random_drafter(str(model)), root / "a")
    shutil.copytree(random_drafter(str(model), seed=1), root / "b")
    ps = prompts(3, lo=3, hi=8, seed=12)
    body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    common = ("--max-model-len", "128", "--kv-cache-memory", "8MiB", "--speculative-model", str(root / "a"),
              "--num-speculative-tokens", str(K))
    texts = []
    for extra in ((), ("--shadow-drafter", str(root / "b"), "--shadow-fraction", "1", "--admin-key", "adm",
                       "--drafter-root", str(root))):
        with LiveServer(model, *common, *extra) as srv:
            texts.append([httpx.post(srv.url + "/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                          ["choices"][0]["text"] for p in ps])
            if extra:
                got = httpx.get(srv.url + "/admin/drafter", headers={"Authorization": "Bearer adm"}, timeout=10).json()
                live = read_shadow_metrics(srv.url)
                text = httpx.get(srv.url + "/metrics", timeout=10).text
    assert texts[0] == texts[1]
    assert got["shadow_drafter_id"].startswith("b-") and got["shadow_fraction"] == 1.0
    assert set(live) == {got["shadow_drafter_id"]} and live[got["shadow_drafter_id"]]["exact_blocks"] > 0
    assert f'drafter="{got["drafter_id"]}"' in text and 'role="serving"' in text
    assert "namazu_engine_shadow_seconds_total" in text
