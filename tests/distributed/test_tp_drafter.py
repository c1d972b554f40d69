"""The DFlash2 drafter under tensor parallelism (TP=2, gloo, one thread per rank), namazu-tiny with its
shipped drafter, against TP=1 without speculation:
- the chain and draft trees (`--speculative-tree-budget`) give greedy outputs equal to TP=1's, with drafts
  accepted: every rank drafts from its own copy of the whole embedding and lm_head (gathered once at
  start-up), and rank 0's drafts are the ones verified;
- rank 0's decision is every rank's, a tree's accepted path included: with a rank-dependent perturbation of
  the logits, ranks > 0 would accept other paths and move other latents; with the broadcast every rank
  commits rank 0's tokens and outputs stay TP=1's;
- rank 0's trees are every rank's: ranks > 0 whose drafter proposes other node tokens still verify rank 0's.
"""
from __future__ import annotations

import functools
import shutil

import pytest
import tp_helpers
from engine_helpers import assert_same_outputs

import namazu.engine.llm_engine as engine_module
import namazu.worker.executor as worker_module
from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.spec.selection import SHIPPED_DRAFTER_DIR

MODEL = str(default_model_path())
DRAFTER = str(default_model_path() / SHIPPED_DRAFTER_DIR)
CHATS = [[{"role": "user", "content": t}] for t in
         ("Tell me a story about a fox.", "Hello, who are you?", "List three colours.",
          "Write a JSON object with a name.", "東京について教えて", "What is two plus two?")]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [tok.encode_chat(c) for c in CHATS]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    while llm.engine.has_unfinished_requests():     # a step still in flight (async scheduling) before any rpc
        llm.engine.step()
    return [o.outputs[0].token_ids for o in outs]


def _tp2(budget: int) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "make_executor",
                   functools.partial(worker_module.make_executor, setup=tp_helpers.install_probe))
        return LLM(MODEL, tensor_parallel_size=2, dtype="float32", speculative_model=DRAFTER,
                   num_speculative_tokens=6, speculative_disable_batch_size=0, speculative_tree_budget=budget)


@pytest.fixture(scope="module")
def reference():
    with LLM(MODEL, executor="inline", dtype="float32", num_speculative_tokens=0) as llm:
        prompts = _prompts(llm)
        yield prompts, _generate(llm, prompts)


@pytest.mark.parametrize("budget", [0, 8])
def test_greedy_with_the_drafter_under_tp_equals_tp1(reference, budget):
    prompts, want = reference
    with _tp2(budget) as llm:
        got = _generate(llm, prompts)
        stats = llm.engine.get_stats()
        logs = llm.engine.collective_rpc(tp_helpers.probe_log)
    assert_same_outputs(MODEL, prompts, GREEDY, got, want)
    assert stats.num_accepted_draft_tokens >= 20, stats.num_accepted_draft_tokens
    assert logs[0] == logs[1]


def test_ranks_commit_rank0s_tree_decision_and_path(reference):
    """Rank 1 adds a large bonus to one token of its logits: alone it would accept other nodes (and move
    their latents). Without the broadcast the ranks commit different tokens; with it, rank 0's tokens and
    path, and the outputs stay TP=1's (a rank holding another path's latents would change rank 0's
    logits through its share of the attention)."""
    prompts, want = reference
    with _tp2(8) as llm:
        ex = llm.engine
        ex.collective_rpc(tp_helpers.set_probe, True, False)
        _generate(llm, prompts[:3])
        logs = ex.collective_rpc(tp_helpers.probe_log)
        assert logs[0] != logs[1], "the ranks agreed without the broadcast: the probe is inert"
        ex.collective_rpc(tp_helpers.set_probe, True, True)
        got = _generate(llm, prompts)
        logs = ex.collective_rpc(tp_helpers.probe_log)
        stats = llm.engine.get_stats()
    assert logs[0] == logs[1]
    assert_same_outputs(MODEL, prompts, GREEDY, got, want)
    assert stats.num_accepted_draft_tokens >= 20


def test_every_rank_verifies_rank0s_trees(reference):
    prompts, want = reference
    with _tp2(8) as llm:
        llm.engine.collective_rpc(tp_helpers.perturb_trees, True)
        got = _generate(llm, prompts)
        stats = llm.engine.get_stats()
    assert_same_outputs(MODEL, prompts, GREEDY, got, want)
    assert stats.num_accepted_draft_tokens >= 20


def test_a_drafter_swap_under_tp_keeps_outputs(reference, tmp_path):
    """Every rank stages and commits the new drafter between the same two steps and attaches it to the
    whole-vocabulary copies of start-up (no collective in the swap): outputs stay TP=1's, the new drafter's
    drafts are accepted."""
    prompts, want = reference
    new = tmp_path / "drafter-copy"
    shutil.copytree(DRAFTER, new)
    with _tp2(0) as llm:
        first = _generate(llm, prompts[:2])
        old_id = llm.engine.drafter_id
        new_id = llm.set_drafter(str(new))
        before = llm.engine.get_stats().num_accepted_draft_tokens
        rest = _generate(llm, prompts[2:])
        after = llm.engine.get_stats().num_accepted_draft_tokens
        swaps = llm.engine.get_stats().num_drafter_swaps
        logs = llm.engine.collective_rpc(tp_helpers.probe_log)
    assert new_id != old_id and swaps == 1
    assert_same_outputs(MODEL, prompts, GREEDY, first + rest, want)
    assert after - before >= 10
    assert logs[0] == logs[1]


def test_graph_mode_under_tp_with_the_drafter_equals_tp1(reference):
    """The deployment's shape: tensor parallelism, graph mode and the drafter together. Each rank's
    compiled forward holds its collectives (the Python wrapper calls them, `graph_mode.compile_backend`);
    the acceptance and its broadcast run after the graph (gloo cannot run inside it)."""
    prompts, want = reference
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "make_executor",
                   functools.partial(worker_module.make_executor, setup=tp_helpers.install_probe))
        llm = LLM(MODEL, tensor_parallel_size=2, dtype="float32", speculative_model=DRAFTER,
                  num_speculative_tokens=6, speculative_disable_batch_size=0, enforce_eager=False, max_num_seqs=1)
    with llm:
        got = _generate(llm, prompts[:3])
        stats = llm.engine.get_stats()
        logs = llm.engine.collective_rpc(tp_helpers.probe_log)
    assert_same_outputs(MODEL, prompts[:3], GREEDY, got, want[:3])
    assert stats.num_accepted_draft_tokens >= 10
    assert logs[0] == logs[1]
