"""Speculation on by default with the default model's shipped drafter, and its batch-size switch.

The choice at start-up (which drafter, how many draft tokens, which threshold) is checked against the
checkpoint's own files; the switch is checked step by step through the engine's counters: no draft is
verified in a step where more sequences run than the threshold, drafting resumes one step after the
batch shrinks (the step that drafts, then the step that verifies), and outputs stay token-identical to
speculation off (greedy, and seeded sampling with deterministic drafts or with the drafter's own draws,
whose seeded rows are verified by exact match; up to near-ties, as `assert_same_outputs` says), and
exactly reproducible for a seed (the same configuration run twice computes the same products)."""
import json
import logging

import pytest
import torch
from engine_helpers import assert_same_outputs

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig
from namazu.spec.dflash_config import DFlashConfig, DrafterCheckpointError
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.selection import (
    AUTO_DISABLE_BATCH_SIZE,
    AUTO_DISABLE_BATCH_SIZE_GRAPH,
    AUTO_MIN_CONFIDENCE,
    SHIPPED_DRAFTER_DIR,
    choose_speculation,
)

PROMPTS = ["Tell me a story.", "Hello, who are you?", "Write a JSON object with a name.", "東京について教えて"]
MAX_TOKENS = [60, 5, 9, 12]
# Request 0 runs alone (drafting), three more arrive (4 running: no drafting), they finish early and
# request 0 runs on alone again: the switch turns off, then on.
ARRIVAL_STEP = [0, 6, 6, 6]


def shipped() -> str:
    return str(default_model_path() / SHIPPED_DRAFTER_DIR)


def model_copy(tmp_path, drafter: dict | None | str = "keep"):
    """A copy of the default checkpoint (files linked); drafter: "keep" = the shipped one, None = no
    drafter/ directory, a dict = the shipped one with these config fields changed."""
    src, dst = default_model_path(), tmp_path / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).symlink_to(f)
    if drafter is not None:
        d = dst / SHIPPED_DRAFTER_DIR
        d.mkdir()
        for f in (src / SHIPPED_DRAFTER_DIR).iterdir():
            if f.name != "config.json":
                (d / f.name).symlink_to(f)
        cfg = json.loads((src / SHIPPED_DRAFTER_DIR / "config.json").read_text())
        cfg.update(drafter if isinstance(drafter, dict) else {})
        (d / "config.json").write_text(json.dumps(cfg))
    return dst


def choose(model=None, **kw):
    path = default_model_path() if model is None else model
    return choose_speculation(EngineConfig(model=None if model is None else str(model), **kw), path,
                              ModelConfig.from_pretrained(path))


# -- the choice at start-up -------------------------------------------------------------------------
def test_default_model_speculates_with_its_shipped_drafter(caplog):
    with caplog.at_level(logging.INFO, logger="namazu.engine.llm_engine"):
        with LLM(executor="inline") as llm:
            engine = llm.engine
            assert isinstance(engine.drafter, DFlashProposer) and engine.drafter.path == shipped()
            assert engine.num_speculative_tokens == DFlashConfig.load(shipped()).num_draft_tokens
            assert engine.config.num_speculative_tokens == engine.num_speculative_tokens   # the workers' copy
            assert engine.scheduler.spec_disable_batch_size == AUTO_DISABLE_BATCH_SIZE
    log = caplog.text
    assert "shipped with the model" in log and f"at most {AUTO_DISABLE_BATCH_SIZE} sequence" in log


def test_explicit_zero_turns_it_off():
    with LLM(executor="inline", num_speculative_tokens=0) as llm:
        assert llm.engine.drafter is None and llm.engine.num_speculative_tokens == 0
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
        assert llm.engine.get_stats().num_draft_tokens == 0


def test_a_checkpoint_without_drafter_serves_without_speculation(tmp_path):
    c = choose(model_copy(tmp_path, drafter=None))
    assert c.drafter is None and c.num_speculative_tokens == 0


def test_draft_count_comes_from_the_drafter_config(tmp_path):
    # A retrained drafter with another block size: its block size - 1, not a constant.
    c = choose(model_copy(tmp_path, drafter={"block_size": 7}))
    assert c.num_speculative_tokens == 6 and c.disable_batch_size == AUTO_DISABLE_BATCH_SIZE


def test_explicit_settings_override_the_defaults():
    c = choose(num_speculative_tokens=2)                    # N given, no drafter named: the shipped one
    assert isinstance(c.drafter, DFlashProposer) and c.drafter.path == shipped()
    assert c.num_speculative_tokens == 2 and c.disable_batch_size == AUTO_DISABLE_BATCH_SIZE
    assert choose(speculative_disable_batch_size=16).disable_batch_size == 16 != AUTO_DISABLE_BATCH_SIZE
    # Graph mode's plain steps are cheaper: the measured break-even there is lower.
    assert choose(enforce_eager=False).disable_batch_size == AUTO_DISABLE_BATCH_SIZE_GRAPH < AUTO_DISABLE_BATCH_SIZE
    assert choose(enforce_eager=False, speculative_disable_batch_size=16).disable_batch_size == 16
    assert choose(speculative_disable_batch_size=0).disable_batch_size == 0
    named = choose(speculative_model=shipped())             # a named drafter: never disabled unless asked
    assert named.num_speculative_tokens == DFlashConfig.load(shipped()).num_draft_tokens
    assert named.disable_batch_size == 0 and "--speculative-model" in named.why
    ngram = choose(speculative_method="ngram", num_speculative_tokens=3)
    assert type(ngram.drafter).__name__ == "NgramProposer" and ngram.disable_batch_size == 0
    with pytest.raises(ValueError, match="speculative-disable-batch-size"):
        EngineConfig(speculative_disable_batch_size=-1)


def test_blocks_end_at_the_measured_threshold_by_default_and_where_told():
    """The shipped drafter ends its blocks at the measured default; the flag overrides it (0: full blocks);
    a named drafter keeps full blocks unless told; the proposer the workers get carries the number."""
    c = choose()
    assert AUTO_MIN_CONFIDENCE > 0 and c.min_confidence == AUTO_MIN_CONFIDENCE
    assert c.drafter.min_confidence == AUTO_MIN_CONFIDENCE and "running confidence" in c.describe()
    assert c.resolve(EngineConfig()).speculative_min_confidence == AUTO_MIN_CONFIDENCE
    off = choose(speculative_min_confidence=0)
    assert off.min_confidence == 0 == off.drafter.min_confidence and "confidence" not in off.describe()
    assert choose(speculative_min_confidence=0.5).drafter.min_confidence == 0.5
    assert choose(speculative_model=shipped()).drafter.min_confidence == 0
    assert choose(speculative_model=shipped(), speculative_min_confidence=0.2).drafter.min_confidence == 0.2
    # Graph mode verifies the entry's 1 + K rows whatever the block: there a cut only drops drafts.
    assert choose(enforce_eager=False).drafter.min_confidence == 0
    assert choose(enforce_eager=False, speculative_min_confidence=0.3).drafter.min_confidence == 0.3


def test_a_bad_shipped_drafter_is_refused_naming_the_field(tmp_path):
    with pytest.raises(DrafterCheckpointError, match="shipped with the model.*'hidden_size'"):
        LLM(str(model_copy(tmp_path, drafter={"hidden_size": 128})), executor="inline")


# -- the batch-size switch --------------------------------------------------------------------------
def run_steps(engine: LLMEngine, params: list[SamplingParams]):
    """Runs PROMPTS step by step, each added at its ARRIVAL_STEP; returns the outputs, per step
    (requests added and unfinished before it, drafts counted by it), and the final stats."""
    outs, steps, live, drafted, t = {}, [], 0, 0, 0
    prompt_ids = {}
    while t <= max(ARRIVAL_STEP) or engine.has_unfinished_requests():
        for i in (i for i, a in enumerate(ARRIVAL_STEP) if a == t):
            engine.add_request(str(i), PROMPTS[i], params[i])
            live += 1
        before = live
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs]
                prompt_ids[o.request_id] = o.prompt_token_ids
                live -= 1
        stats = engine.get_stats()
        steps.append((before, stats.num_draft_tokens - drafted))
        drafted = stats.num_draft_tokens
        t += 1
    engine.close()
    PROMPT_IDS[:] = [prompt_ids[str(i)] for i in range(len(PROMPTS))]
    return [outs[str(i)] for i in range(len(PROMPTS))], steps, engine.get_stats()


PROMPT_IDS: list[list[int]] = []     # PROMPTS as the engine tokenized them (the last run_steps)


def assert_same(params: list[SamplingParams], got, want) -> None:
    assert_same_outputs(str(default_model_path()), PROMPT_IDS, params, got, want)


def engine_for(threshold: int | None, async_scheduling: bool, drafter=None, **kw) -> LLMEngine:
    # Full blocks: the switch's row accounting below counts k drafts per drafted step.
    kw.setdefault("speculative_min_confidence", None if drafter is not None else 0)
    # The switch alone: the draft policy decides from wall-clock times, which no two runs share.
    kw.setdefault("speculative_adaptive", False)
    return LLMEngine(EngineConfig(executor="inline", async_scheduling=async_scheduling,
                                  speculative_disable_batch_size=threshold, **kw), drafter=drafter)


def greedy() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def greedy_reference():
    outs, _, _ = run_steps(engine_for(None, False, num_speculative_tokens=0), greedy())
    return outs


def test_no_drafts_above_the_threshold_and_drafting_resumes_below(greedy_reference):
    outs, steps, stats = run_steps(engine_for(2, async_scheduling=False), greedy())
    assert_same(greedy(), outs, greedy_reference)
    # Synchronous steps, and every arrival is admitted in its first step: the requests unfinished before
    # a step are the sequences it runs. A step verifies drafts only if it and the step before (which
    # drafted them) ran at most 2; drafts from before a large batch are never verified after it.
    for t, (live, drafted) in enumerate(steps):
        if drafted:
            assert live <= 2 and t > 0 and steps[t - 1][0] <= 2, f"step {t}: drafts verified with {live} running"
    assert stats.num_spec_disabled_steps == sum(live > 2 for live, _ in steps) > 0
    assert steps[1][1] > 0, "no drafting while one request ran alone"
    assert stats.num_draft_rows == stats.num_draft_tokens
    last_big = max(t for t, (live, _) in enumerate(steps) if live > 2)
    assert steps[last_big + 2][1] > 0, "drafting did not resume when the batch shrank"
    # A block is counted where one was drafted: each is verified by the next step, but for a sequence's
    # last one and the one before the batch grew (not the zeros of the undrafted steps).
    verified = sum(stats.acceptance_length_histogram)
    assert verified <= stats.num_draft_blocks <= verified + len(PROMPTS) + 1
    assert stats.num_drafts_proposed == stats.num_draft_blocks * DFlashConfig.load(shipped()).num_draft_tokens


def test_async_scheduling_switches_the_same_way(greedy_reference):
    outs, steps, stats = run_steps(engine_for(2, async_scheduling=True), greedy())
    assert_same(greedy(), outs, greedy_reference)
    assert stats.num_spec_disabled_steps > 0
    # Planned before the drafts are known, yet no row waits for a draft the worker was told not to make
    # (the drafter always fills its block).
    assert stats.num_draft_rows == stats.num_draft_tokens > 0
    # Call t launches step t and collects step t - 1: drafts counted in call t were verified by the step
    # launched in call t - 1 and drafted by the one launched in call t - 2, both with at most 2 running.
    for t, (_, drafted) in enumerate(steps):
        if drafted:
            assert t >= 2 and steps[t - 1][0] <= 2 and steps[t - 2][0] <= 2, f"call {t}: drafts with a big batch"
    last_big = max(t for t, (live, _) in enumerate(steps) if live > 2)
    assert any(d for _, d in steps[:last_big - 2]) and any(d for _, d in steps[last_big + 1:])


def test_seeded_sampling_stays_exact_with_deterministic_drafts():
    # Greedy drafts at T > 0 are verified by the deterministic rule: with the switch turning drafting off
    # and on, seeded outputs must equal speculation off token for token.
    params = [SamplingParams(max_tokens=m, temperature=0.8, seed=11 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    ref, _, _ = run_steps(engine_for(None, True, num_speculative_tokens=0), params)
    t = ModelConfig.from_pretrained(default_model_path())
    drafter = DFlashProposer(shipped(), t.vocab_size, t.hidden_size, t.num_hidden_layers, sample_drafts=False)
    outs, _, stats = run_steps(engine_for(2, True, drafter=drafter, num_speculative_tokens=4), params)
    assert stats.num_draft_tokens > 0 and stats.num_spec_disabled_steps > 0
    assert_same(params, outs, ref)


def test_seeded_sampling_with_drafted_draws_is_reproducible_and_plain_decodings():
    # The shipped drafter's draws from q at T > 0, with the switch turning drafting off and on: seeded rows
    # are verified by exact match, so the tokens are speculation off's (up to near-ties) and, the same
    # configuration computing the same products, exactly reproducible.
    params = [SamplingParams(max_tokens=m, temperature=0.8, seed=5 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    first, _, stats = run_steps(engine_for(2, True), params)
    assert stats.num_draft_tokens > 0 and stats.num_spec_disabled_steps > 0
    again, _, stats_again = run_steps(engine_for(2, True), params)
    assert again == first
    # The drafts themselves are seeded draws too: the same ones are accepted in both runs.
    assert stats_again.acceptance_length_histogram == stats.acceptance_length_histogram
    ref, _, _ = run_steps(engine_for(None, True, num_speculative_tokens=0), params)
    assert_same(params, first, ref)


class RecordingDrafter(DFlashProposer):
    """The shipped drafter, noting each block's draft logits by (sequence, anchor position)."""

    def __init__(self):
        t = ModelConfig.from_pretrained(default_model_path())
        super().__init__(shipped(), t.vocab_size, t.hidden_size, t.num_hidden_layers)
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}
        self.anchors: list[tuple[int, int, int]] = []     # (sequence, anchor token, its position) per block

    def draft_block(self, inp, k):
        anchor, anchor_pos, h, logits = super().draft_block(inp, k)
        for sid, a, pos, row in zip(inp.seq_ids, anchor.tolist(), anchor_pos.tolist(), logits):
            self.blocks[sid, pos] = row.clone()
            self.anchors.append((sid, a, pos))
        return anchor, anchor_pos, h, logits


def test_drafts_after_resuming_see_the_context_of_undrafted_steps():
    # The drafter's context cache is extended by every forward, drafted or not: after the large batch,
    # request 0's draft logits equal those of a drafter that never stopped, at the same positions.
    blocks = []
    for threshold in (0, 2):
        drafter = RecordingDrafter()
        run_steps(engine_for(threshold, False, drafter=drafter, num_speculative_tokens=4), greedy())
        blocks.append({pos: row for (sid, pos), row in drafter.blocks.items() if sid == 0})
    always, switched = blocks
    # Positions drafted after the gap in the switched run that the other run drafted too.
    gap = min(p for p in always if p not in switched)
    resumed = sorted(p for p in switched if p > gap and p in always)
    assert len(resumed) >= 2
    for p in resumed:
        torch.testing.assert_close(switched[p], always[p], atol=1e-3, rtol=1e-3, msg=f"position {p}")


def test_each_block_is_drafted_from_the_last_accepted_token():
    # Drafting from the verify step's first row instead of its accepted one stays lossless (the next
    # verify rejects the misplaced drafts) and the block is consistent with itself, so only a drafter
    # whose drafts get accepted shows it: the shipped one. After each synchronous step, every block it
    # drafted must start from its sequence's last committed token, at that token's position.
    drafter = RecordingDrafter()
    engine = engine_for(None, False, drafter=drafter, num_speculative_tokens=4, speculative_min_confidence=0)
    for i in range(2):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    seqs = {s.seq_id: s for s in engine.scheduler.waiting}
    checked = 0
    while engine.has_unfinished_requests():
        drafter.anchors.clear()
        engine.step()
        for sid, anchor, pos in drafter.anchors:
            committed = seqs[sid].token_ids
            assert (anchor, pos) == (committed[-1], len(committed) - 1), \
                f"sequence {sid}: block anchored at position {pos}, last committed token at {len(committed) - 1}"
            checked += 1
    stats = engine.get_stats()
    engine.close()
    assert checked >= 20
    # Blocks after a verify that accepted drafts are the ones a wrong anchor would misplace: many here.
    assert stats.num_accepted_draft_tokens >= 10 and sum(stats.acceptance_length_histogram[1:]) >= 5


def test_tensor_parallelism_keeps_the_shipped_drafter_off_by_default_and_serves_a_named_one():
    # Measured not to pay at T=0.8 under TP (bench/RESULTS.md); named, it runs (tests/distributed/test_tp_drafter.py).
    c = choose(tensor_parallel_size=2)
    assert c.drafter is None and c.num_speculative_tokens == 0 and "tensor parallelism" in c.why
    assert "--speculative-model" in c.why
    named = choose(tensor_parallel_size=2, speculative_model=shipped())
    assert isinstance(named.drafter, DFlashProposer) and named.num_speculative_tokens > 0
