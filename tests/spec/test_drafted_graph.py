"""The drafted step in graph mode (`spec/drafted_step.py`, `worker/drafted_graph.py`): sampling, the acceptance
rule and the DFlash drafter's next block compiled after the entry's forward.

The oracles: greedy outputs of graph mode with the shipped drafter equal eager decoding without any
drafter on 100 prompts (up to the target's near-ties, `assert_same_outputs`), with a real acceptance
length (a tail that accepted one draft too many would emit a token the target did not choose, and this
test fails: tests/MUTATIONS.md P1); the T=1 distribution of the second output token through the compiled
tail with the drafter's q equals the target's exact marginal (chi-square); and the whole drafted step
runs under the host-sync guard. The traced path uses torch.compile's "eager" backend, as the other
graph-mode tests do: the same fullgraph trace, without inductor's code generation."""
import numpy as np
import pytest
import torch
from engine_helpers import assert_same_outputs, prompts, tiny_checkpoint
from test_dflash import _chi2_critical, _second_token_distribution, make_proposer

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path

SUBJECTS = ["会議の議事録", "来期の予算", "新しい取引先", "出張の精算", "社内研修", "顧客からの苦情", "納期の変更",
            "the quarterly report", "a product launch", "the hiring plan"]
ASKS = ["について、要点を三つ挙げてください。", "について丁寧なメールを書いてください。", "の注意点は何ですか。",
        ": write a short summary.", "を JSON で表してください。"]
PROMPTS = [s + a for s in SUBJECTS for a in ASKS] + [f"{s}の件で、{n}日までに確認をお願いします。"
                                                     for s in SUBJECTS for n in range(1, 6)]


@pytest.fixture(autouse=True)
def traced_graphs(monkeypatch):
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")


def generate(prompts_, params, **kw):
    with LLM(None, executor="inline", kv_cache_memory="128MiB", **kw) as llm:
        outs = llm.generate(prompts_, params, use_tqdm=False)
        runner = llm.engine.executor.worker.runner
        # Which compiled tails ran, and which of them were called directly after their first call.
        called = set(runner.tails._called) if runner.tails is not None else set()
        called |= {("direct", *key) for key in (runner.tails.direct if runner.tails is not None else ())}
        ids = [list(o.prompt_token_ids) for o in outs]
        calls = runner.tails.calls if runner.tails is not None else {}
        called |= {("ran", *key) for key, n in calls.items() if n}       # in a step, not the warm-up
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats(), called, ids


def test_graph_mode_with_the_drafter_gives_eager_undrafted_greedy_outputs_on_100_prompts(monkeypatch):
    from namazu.worker.model_runner import ModelRunner

    assert len(PROMPTS) == 100
    params = SamplingParams(temperature=0, max_tokens=16)
    want, _, _, ids = generate(PROMPTS, params, enforce_eager=True, num_speculative_tokens=0, max_num_seqs=2)
    prefill_tails = []
    tail = ModelRunner._prefill_tail
    monkeypatch.setattr(ModelRunner, "_prefill_tail", lambda *a: prefill_tails.append(1) or tail(*a))
    # Drafting at batch 2 as well (the default stops at 1, where it was measured to pay): both tails run.
    got, stats, called, _ = generate(PROMPTS, params, enforce_eager=False, max_num_seqs=2,
                                     speculative_disable_batch_size=2)
    assert (2, False) in called and (1, False) in called, called     # the compiled greedy tails ran
    assert ("direct", 2, False) in called and ("direct", 1, False) in called, called     # past torch.compile's frame
    # Steps that resume drafting (after the draft policy's plain probes) run a plain entry's compiled tail.
    assert ("direct", 1, "plain") in called or ("direct", 2, "plain") in called, called
    # So does the draft after a step that prefills and verifies nothing (its sampled rows loaded as the plain
    # entry's decode rows; at batch 2 most prefills share a step with the other sequence's verify).
    assert prefill_tails, "no prefill step drafted in the compiled tail"
    assert stats.mean_acceptance_length > 1.5, stats.acceptance_length_histogram
    assert_same_outputs(str(default_model_path()), ids, params, got, want)


def test_the_compiled_context_write_of_plain_steps_equals_eager_modes():
    """Plain decode entries write the drafter's context in a compiled graph of their own; the drafter's cache
    after two requests decoded side by side without drafting equals eager mode's, up to the rounding of
    another product shape (a write to the wrong slots differs by whole entries: tests/MUTATIONS.md P6)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    caches, outs = {}, {}
    for eager in (True, False):
        with LLM(None, executor="inline", kv_cache_memory="128MiB", enforce_eager=eager, max_num_seqs=2,
                 speculative_adaptive=False, speculative_disable_batch_size=1) as llm:
            res = llm.generate(PROMPTS[:2], params, use_tqdm=False)
            runner = llm.engine.executor.worker.runner
            outs[eager] = [o.outputs[0].token_ids for o in res]
            assert llm.engine.get_stats().num_draft_tokens == 0
            used = runner.num_blocks * runner.block_size          # the scratch block after them: padding rows
            caches[eager] = runner.spec.proposer.cache[:, :, :used].clone()
            if not eager:
                assert (2, None) in runner.tails._called
    assert outs[True] == outs[False]
    assert caches[False].abs().amax() > 0
    torch.testing.assert_close(caches[False], caches[True], rtol=1e-3, atol=1e-3)   # entries are O(10)


def test_the_whole_drafted_step_reads_nothing_on_the_host_and_sampled_rows_use_the_sampled_tail():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12)
    got, stats, called, _ = generate(PROMPTS[:6], params, enforce_eager=False, max_num_seqs=2,
                                     speculative_disable_batch_size=2, debug_no_host_sync=True)
    assert ("ran", 2, True) in called, called      # top-p set: the sampled variant with its filters
    assert stats.num_draft_tokens > 0 and all(got)
    again, _, _, _ = generate(PROMPTS[:6], params, enforce_eager=False, max_num_seqs=2,
                              speculative_disable_batch_size=2)
    assert again == got       # seeded: the same configuration reproduces its draws exactly


def test_the_compiled_tail_keeps_the_targets_distribution_with_the_drafters_q():
    """As test_dflash's distribution test, through graph mode: the second output token at T=1 (drafts drawn
    from the selector's q and accepted by the rejection rule inside the compiled tail)."""
    prompt = prompts(1, lo=6, hi=6, seed=2)[0]
    want = _second_token_distribution(prompt)
    n = 2400
    params = SamplingParams(temperature=1.0, n=800, max_tokens=3, ignore_eos=True)
    proposer = make_proposer(sample_drafts=True, selector_k=200)
    with LLM(tiny_checkpoint(), executor="inline", drafter=proposer, num_speculative_tokens=3, max_num_seqs=4,
             enforce_eager=False, seed=1) as llm:
        outs = llm.generate(prompt_token_ids=[prompt] * 3, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
        assert llm.engine.executor.worker.runner.tails.calls[(4, "unfiltered")] > 0     # no top-k, top-p, min-p
    assert stats.num_accepted_draft_tokens > 0
    counts = np.bincount([c.token_ids[1] for o in outs for c in o.outputs], minlength=len(want)).astype(float)
    expected = want * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_critical(len(obs) - 1), f"chi2 {chi2:.1f} over {len(obs) - 1} dof"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}


def test_grammar_sequences_run_the_compiled_tail_with_their_bitmask_rows():
    """JSON-schema requests in graph mode with the drafter: the tail variants with a bitmask input run (their
    rows are the grammar's along the drafts, all bits set elsewhere), and outputs equal eager decoding without
    a drafter under the same grammar: greedy token for token (up to near-ties), a request's own seed exactly
    (the seeded rows' exact-match rule); every output is valid under the schema."""
    import json

    import jsonschema

    texts = [s + "を JSON で表してください。" for s in SUBJECTS[:3]]
    runs = {"greedy": SamplingParams(max_tokens=40, json_schema=SCHEMA, temperature=0),
            "seeded": SamplingParams(max_tokens=40, json_schema=SCHEMA, temperature=0.8, seed=5)}
    want, got = {}, {}
    with LLM(None, executor="inline", kv_cache_memory="128MiB", enforce_eager=True, num_speculative_tokens=0) as llm:
        for name, params in runs.items():
            outs = llm.generate(texts, params, use_tqdm=False)
            want[name] = [o.outputs[0].token_ids for o in outs]
        ids = [list(o.prompt_token_ids) for o in outs]
        decode = llm.engine.tokenizer.decode
        with LLM(None, executor="inline", kv_cache_memory="128MiB", enforce_eager=False, max_num_seqs=1) as graph:
            for name, params in runs.items():
                got[name] = [o.outputs[0].token_ids for o in graph.generate(texts, params, use_tqdm=False)]
            tails = graph.engine.executor.worker.runner.tails
            called = set(tails._called) | {("direct", *key) for key in tails.direct}
            called |= {("ran", *key) for key, n in tails.calls.items() if n}
            stats = graph.engine.get_stats()
        for toks in got["greedy"] + got["seeded"]:
            jsonschema.validate(json.loads(decode(toks)), SCHEMA)
    assert ("ran", 1, "greedy-masked") in called and ("ran", 1, "unfiltered-masked") in called, called
    assert stats.num_accepted_draft_tokens > 0
    assert_same_outputs(str(default_model_path()), ids, runs["greedy"], got["greedy"], want["greedy"])
    assert got["seeded"] == want["seeded"]
