"""Draft trees in graph mode (`--speculative-tree-budget N` without --enforce-eager): a step that verifies trees
runs a tree entry of the ladder (Bp sequences x 1 + N rows) whose buffers hold the step's in-block tree mask
and its rows' rotary positions (worker/graph_mode.py); the acceptance, the path move and the next tree run
eagerly after the compiled forward (worker/drafted_graph.py has no tail for tree entries).

With namazu-tiny and its shipped drafter, traced by torch.compile's "eager" backend (as tests/worker/
test_graph_mode.py: the same fullgraph trace over the same buffers, without inductor's code generation),
greedy outputs equal decoding without speculation, every step without a prompt chunk runs a graph entry (tree
verifies the tree entries, plain steps that draft a tree the plain ones), some accepted paths leave the rank-0
chain (so the mask and the positions mattered), and the drafter accepts as many drafts as in eager tree mode
(its context write is compiled per tree entry). tests/MUTATIONS.md GT1-GT3 break each of these.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_same_outputs
from engine_helpers import tree_engine as engine

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.spec.tree_step import TreeStep

MODEL = str(default_model_path())
TEXTS = ["Tell me a story about a fox.", "Hello, who are you?", "List three colours."]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _traced_backend(monkeypatch):
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")


def generate(llm: LLM, params, texts=TEXTS):
    outs = llm.generate(texts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.prompt_token_ids for o in outs]


@pytest.fixture
def paths(monkeypatch) -> list[tuple[list[int], int]]:
    """(accepted path, its length) of every tree sequence of every verify (read after the run: no host read
    inside the step)."""
    raw = []
    real = TreeStep.accept

    def accept(self, plan, *args):
        out = real(self, plan, *args)
        raw.append((plan.is_tree.clone(), plan.path.clone(), plan.num_accepted.clone()))
        return out

    monkeypatch.setattr(TreeStep, "accept", accept)

    class Seen(list):
        def read(self):
            self[:] = [(path[s].tolist(), int(n[s])) for is_tree, path, n in raw
                       for s in torch.nonzero(is_tree).flatten().tolist()]
            return self

    return Seen()


def off_chain(step: TreeStep, seen) -> int:
    """Accepted paths through a node that is not its parent's first draw."""
    ranks = step.topology.ranks
    return sum(any(ranks[node] > 0 for node in path[:n]) for path, n in seen)


def _watch(llm) -> list[tuple[bool, bool, bool, int]]:
    """Per step: (only decode / verify rows: no prompt chunk, verified a tree, drafts the next block, the graph
    entry's Tq or 0: eager)."""
    runner = llm.engine.executor.worker.runner
    seen = []
    real = runner._inputs

    def inputs(b, prep):
        inp = real(b, prep)
        seen.append((bool(np.all(b.seqs.num_new == 1)), runner.spec._plan is not None, bool(b.spec.max_drafts_next),
                     inp.entry.tq if inp.entry is not None else 0))
        return inp

    runner._inputs = inputs
    return seen


@pytest.mark.parametrize("budget", [8, 16])
def test_tree_steps_run_the_graph_entries_and_equal_decoding_without_speculation(paths, budget, caplog):
    with engine(-1) as llm:
        base, prompt_ids = generate(llm, PARAMS)
    with engine(budget, max_num_seqs=2, kv_cache_memory="128MiB") as llm:
        generate(llm, PARAMS)
        eager_accepted = llm.engine.get_stats().num_accepted_draft_tokens
    with caplog.at_level("INFO", logger="namazu.worker.model_runner"):
        with engine(budget, enforce_eager=False, max_num_seqs=2, kv_cache_memory="128MiB",
                    debug_no_host_sync=True) as llm:
            runner = llm.engine.executor.worker.runner
            graphs, tails = runner.graphs, runner.tails
            step = runner.spec.tree
            # The verify entries are tree entries of 1 + N rows, with a mask buffer; no compiled tail serves them.
            assert graphs.tqs == [1, 1 + budget]
            assert all((e.tree_mask is not None) == (e.tq > 1) for e in graphs.entries.values())
            assert tails is not None and tails.entries == [] and tails.resume_entries == []
            # The drafter's context write is compiled for the tree entries too (their rows' rotary positions).
            assert all(tails.writes_context(e) for e in graphs.entries.values())
            assert all(e.direct is not None for e in graphs.entries.values())
            seen = _watch(llm)
            got, _ = generate(llm, PARAMS)
            accepted = llm.engine.get_stats().num_accepted_draft_tokens
    assert_same_outputs(MODEL, prompt_ids, PARAMS, got, base)
    graph_trees = sum(tree and tq > 0 for _, tree, _, tq in seen)
    eager_trees = sum(tree and tq == 0 for _, tree, _, tq in seen)
    plain_drafting = sum(tq == 1 and drafts for _, _, drafts, tq in seen)
    print(f"{graph_trees} tree verifies in graph entries, {eager_trees} eager (beside a prompt chunk), "
          f"{plain_drafting} plain graph steps that draft a tree, of {len(seen)} steps")
    assert all(tq == 1 + budget for _, tree, _, tq in seen if tree and tq)
    # Every step without a prompt chunk ran a graph entry, whether it verifies a tree, drafts one, or both.
    assert all(tq > 0 for decode_only, _, _, tq in seen if decode_only)
    assert graph_trees > 10 and graph_trees >= 3 * eager_trees, (graph_trees, eager_trees)
    assert plain_drafting > 0, "no plain graph step drafted a tree"
    # The drafter drafts as well as in eager mode (its context written at the tree rows' positions and slots;
    # outputs alone would not show a worse drafter).
    print(f"accepted drafts: graph {accepted}, eager {eager_accepted}")
    assert accepted >= 0.9 * eager_accepted, (accepted, eager_accepted)
    paths.read()
    assert len(paths) > 10 and off_chain(step, paths) > 0, "no accepted path left the rank-0 chain"
    logs = [r.getMessage() for r in caplog.records]
    assert not any("draft tree run eagerly" in m for m in logs)
    assert sum("steps with draft trees" in m for m in logs) == 1, logs
