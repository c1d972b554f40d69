"""Graph-mode steps (namazu/worker/graph_mode.py): decode and verify steps run over persistent static-shape
buffers through a traced forward, with outputs token-identical to eager mode (up to near-ties: the traced
forward pads rows to its ladder entry, takes one softmax over the whole table and gathers experts where
eager runs grouped GEMMs, so its logits agree to rounding; `assert_same_outputs`), and without host syncs.

The traced path here uses torch.compile's "eager" backend (NAMAZU_GRAPH_BACKEND): the same dynamo
trace (fullgraph) over the same static buffers as inductor, without inductor's code generation (minutes
per entry on a small CPU). The custom ops' shape functions, which inductor and aot_eager trace through,
are checked by torch.library.opcheck and one aot_eager run. bench/step_profile.py checks inductor's
outputs against eager and measures the speed. CUDA-graph capture needs a device; on CPU it
is covered up to the capture call (test_cuda_graph_path_needs_a_device).
"""
from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_same_outputs, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.spec.drafters import ScriptedDrafter


@pytest.fixture(autouse=True)
def _traced_backend(monkeypatch):
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12 - 4 * (i % 3), ignore_eos=True) for i in range(n)]


def _generate(batch: list[list[int]], enforce_eager: bool, drafter_mode: str | None = None, **kw):
    drafter = ScriptedDrafter(drafter_mode, 264, seed=3) if drafter_mode else None
    with LLM(tiny_checkpoint(), executor="inline", enforce_eager=enforce_eager,
             max_num_seqs=1 if len(batch) == 1 else max(4, len(batch)),
             drafter=drafter, num_speculative_tokens=2 if drafter else 0, **kw) as llm:
        graphs = llm.engine.executor.worker.runner.graphs
        launched = []
        if graphs is not None:
            # Every entry's compiled graph is called directly (argument list built once at start-up); on a
            # GPU the entries are replayed CUDA graphs instead.
            assert graphs.use_cuda_graphs or all(e.direct is not None for e in graphs.entries.values())
            real = graphs.launch
            graphs.launch = lambda e, w: launched.append((e.bp, e.tq, w)) or real(e, w)
        outs = llm.generate(prompt_token_ids=batch, use_tqdm=False, sampling_params=_params(len(batch)))
    return [o.outputs[0].token_ids for o in outs], launched


@pytest.mark.parametrize("n, drafter_mode", [(1, None), (3, None), (32, None), (1, "random"), (3, "random"),
                                             (32, "random")])
def test_graph_mode_is_token_identical_to_eager(n, drafter_mode):
    batch = prompts(n, lo=5, hi=30, seed=5)
    eager, none = _generate(batch, True, drafter_mode)
    graph, launched = _generate(batch, False, drafter_mode)
    assert none == []
    assert_same_outputs(tiny_checkpoint(), batch, _params(n), graph, eager)
    assert launched, "no step ran as a graph"
    tqs = {tq for _, tq, _ in launched}
    assert (3 in tqs) == bool(drafter_mode) and (drafter_mode or tqs == {1})
    # 3, then 2, then 1 sequences running: 3 is padded to the ladder's 4.
    assert {bp for bp, _, _ in launched} == {1: {1}, 3: {1, 2, 4}, 32: {16, 32}}[n]


def _sampled_outputs(prompt: list[int], enforce_eager: bool) -> tuple[dict[str, list[int]], list[int]]:
    """One request at a time (one graph entry, compiled once): greedy, seeded T = 1, greedy under strong
    penalties, and greedy restricted to every token but the plain greedy ones."""
    cases = {"plain": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
             "sampled": SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
             "penalised": SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.5,
                                         max_tokens=10, ignore_eos=True)}
    with LLM(tiny_checkpoint(), executor="inline", enforce_eager=enforce_eager, max_num_seqs=1,
             num_speculative_tokens=0) as llm:
        graphs = llm.engine.executor.worker.runner.graphs
        launched = []
        if graphs is not None:
            real = graphs.launch
            graphs.launch = lambda e, w: launched.append(e.tq) or real(e, w)

        def run(params):
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
            return out[0].outputs[0].token_ids

        got = {name: run(p) for name, p in cases.items()}
        allowed = [t for t in range(256) if t not in got["plain"]]
        got["allowed"] = run(SamplingParams(temperature=0, allowed_token_ids=allowed, max_tokens=10, ignore_eos=True))
    assert bool(launched) != enforce_eager
    return got, allowed


def test_graph_mode_honours_sampling_penalties_and_allowed_tokens():
    """The compiled forward's argmax serves a step only when every row is greedy and unconstrained. With
    each request alone in its steps, sampling at T > 0, a penalty and an allowed-token set (a grammar
    mask) are each the only thing keeping its steps off that argmax: graph mode must give eager's tokens
    for each, and each must differ from the plain greedy continuation (else the case could not tell)."""
    prompt = prompts(1, lo=12, hi=12, seed=21)[0]
    eager, allowed = _sampled_outputs(prompt, enforce_eager=True)
    graph, _ = _sampled_outputs(prompt, enforce_eager=False)
    assert graph == eager
    assert all(eager[name] != eager["plain"] for name in ("sampled", "penalised", "allowed")), eager
    assert set(graph["allowed"]) <= set(allowed)


def test_graph_steps_do_not_sync():
    """The no-host-sync guard over graph-mode decode and verify steps, with every sampling feature."""
    from test_host_sync_guard import features

    batch = prompts(3, lo=5, hi=20, seed=7)
    with LLM(tiny_checkpoint(), executor="inline", enforce_eager=False, debug_no_host_sync=True, max_num_seqs=4,
             drafter=ScriptedDrafter("random", 264, seed=1), num_speculative_tokens=2) as llm:
        graphs = llm.engine.executor.worker.runner.graphs
        launched = []
        real = graphs.launch
        graphs.launch = lambda e, w: launched.append(e.tq) or real(e, w)
        outs = llm.generate(prompt_token_ids=batch, sampling_params=[features(i) for i in (0, 1, 3)],
                            use_tqdm=False)
    assert all(o.finished for o in outs)
    assert 3 in launched   # verify steps (the drafter always proposes, so no plain decode follows a prefill)


def test_a_host_read_in_the_forward_fails_graph_mode_at_start_up(monkeypatch):
    """Graph mode traces with fullgraph=True: a host read inside the forward stops start-up instead of
    silently splitting the graph (and syncing every step)."""
    from namazu.layers.norm import RMSNorm

    real = RMSNorm.forward

    def syncing(self, x):
        if x.sum().item() == float("inf"):   # a host read of a device value
            return x
        return real(self, x)

    monkeypatch.setattr(RMSNorm, "forward", syncing)
    torch._dynamo.reset()   # the forwards compiled by earlier tests would be reused otherwise
    with pytest.raises(Exception, match="item|graph break|Unsupported|data-dependent"):
        LLM(tiny_checkpoint(), executor="inline", enforce_eager=False, max_num_seqs=1)


def test_ladder_buffers_hold_a_step_padded():
    """What a CUDA graph replays is these buffers: the step's tokens in their sequences' rows, padding that
    sees nothing and writes only the scratch slot, the block table zero-padded to a ladder width."""
    import numpy as np

    from namazu.config import ModelConfig
    from namazu.worker.graph_mode import StepGraphs, batch_ladder, width_for
    from namazu.worker.paged_kv_cache import PagedLatentCache

    assert batch_ladder(32) == [1, 2, 4, 8, 16, 32] and batch_ladder(6) == [1, 2, 4, 6]
    assert [width_for(n, 64) for n in (1, 2, 3, 9, 64, 70)] == [2, 2, 4, 16, 64, 64]
    cfg = ModelConfig.from_pretrained(tiny_checkpoint())
    cache = PagedLatentCache(cfg, num_blocks=10, block_size=4, dtype=torch.float32, device="cpu")
    assert cache.kv.shape[1] == 11 and cache.scratch_slot == 40       # one block past the engine's
    g = StepGraphs(None, cache, torch.device("cpu"), max_num_seqs=4, num_speculative_tokens=2,
                   max_blocks_per_seq=8)
    assert g.entry_for(5, 1) is None                                     # outside the ladder: eager
    # The widest table is a power of two (inductor failed over a width range [2, 257]); wider: eager.
    assert [StepGraphs(None, cache, torch.device("cpu"), 1, 0, m).max_width for m in (1, 8, 9, 257)] == [2, 8, 8, 256]
    e = g.entry_for(3, 3)
    assert (e.bp, e.tq) == (4, 3)
    # Three sequences verifying 2, 0 and 1 drafts: 3 + 1 + 2 flat tokens.
    ids = np.array([11, 12, 13, 21, 31, 32])
    pos = np.array([5, 6, 7, 2, 9, 10])
    slots = np.array([1, 2, 3, 17, 25, 26])
    pad_index = np.array([0, 1, 2, 3, 6, 7])
    tables = np.array([[0, 1, 0], [4, 0, 0], [6, 7, 8]])
    width = g.load(e, pad_index, ids, pos, slots, tables)
    assert width == 4
    assert e.input_ids.tolist() == [11, 12, 13, 21, 0, 0, 31, 32, 0, 0, 0, 0]
    assert e.slot_mapping.tolist() == [1, 2, 3, 17, 40, 40, 25, 26, 40, 40, 40, 40]
    assert e.q_pos.tolist() == [[5, 6, 7], [2, -1, -1], [9, 10, -1], [-1, -1, -1]]
    assert e.block_tables[:, :4].tolist() == [[0, 1, 0, 0], [4, 0, 0, 0], [6, 7, 8, 0], [0, 0, 0, 0]]
    assert e.q_index.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    # The next step into the same buffers (written in place on CPU): nothing of the last one is left.
    assert g.load(e, np.array([0]), np.array([7]), np.array([3]), np.array([9]), np.array([[2]])) == 2
    assert e.input_ids.tolist() == [7] + [0] * 11
    assert e.positions.tolist() == [3] + [0] * 11
    assert e.slot_mapping.tolist() == [9] + [40] * 11
    assert e.q_pos.tolist() == [[3, -1, -1]] + [[-1, -1, -1]] * 3
    assert e.block_tables[:, :2].tolist() == [[2, 0], [0, 0], [0, 0], [0, 0]]
    with pytest.raises(AssertionError, match="ladder holds 8"):
        g.load(e, pad_index, ids, pos, slots, np.zeros((3, 9), dtype=np.int64))


def test_custom_ops_pass_opcheck():
    """Schema, fake (shape) implementation and dispatch of every graph op, by torch's own checker."""
    from namazu.kernels import graph_ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    n, h, r, dr, bs = 5, 2, 8, 4, 4
    kv = torch.randn(6, bs, r + dr, generator=g)
    args = (torch.randn(n, h, r, generator=g), torch.randn(n, h, dr, generator=g), kv,
            torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1, 2], [3, 4, 0]]),
            torch.tensor([[4, 5, 6], [1, 2, -1]]), torch.tensor([0, 1, 2, 3, 4]), r, 0.3)
    torch.library.opcheck(torch.ops.namazu.paged_mla.default, args)
    torch.library.opcheck(torch.ops.namazu.write_latents.default,
                          (kv.clone(), torch.tensor([0, 5, 9]), torch.randn(3, r, generator=g),
                           torch.randn(3, dr, generator=g)))
    x = torch.randn(4, 16, generator=g)
    moe_args = (x, torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0]]), torch.rand(4, 2, generator=g),
                torch.randn(3, 16, 16, generator=g), torch.randn(3, 16, 8, generator=g))
    torch.library.opcheck(torch.ops.namazu.moe_grouped_mm.default, moe_args)
    from namazu.kernels.moe_workspace import MoEWorkspace
    ws = MoEWorkspace.allocate(4, 2, 3, 16, 8, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.namazu.moe_grouped_mm_ws.default, (*moe_args, ws.tensors()))


def test_whole_table_attention_matches_the_tiled_kernel():
    """What graph mode traces (tile_tokens=None: one softmax over the whole padded table, no control flow
    over its width) equals the tiled online-softmax kernel eager steps run, padding and all."""
    from namazu.kernels.paged_mla import paged_latent_attention

    g = torch.Generator().manual_seed(4)
    r, dr, h, bs = 8, 4, 2, 4
    kv = torch.randn(20, bs, r + dr, generator=g)
    tables = torch.tensor([[3, 7, 1, 9, 12, 0], [5, 2, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0]])
    q_pos = torch.tensor([[20, 21], [6, -1], [-1, -1]])              # a padded slot and a padded sequence
    q_index = torch.tensor([[0, 1], [2, 3], [4, 5]])
    args = (torch.randn(6, h, r, generator=g), torch.randn(6, h, dr, generator=g), kv, tables, q_index, q_pos,
            torch.arange(6), r, 0.3)
    tiled = paged_latent_attention(*args, tile_tokens=8)               # three tiles of two blocks
    whole = paged_latent_attention(*args, tile_tokens=None)
    torch.testing.assert_close(whole[:3], tiled[:3], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(whole).all()


def test_aot_traced_graph_matches_eager(monkeypatch):
    """aot_eager traces through the custom ops' shape functions, as inductor does."""
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "aot_eager")
    batch = prompts(1, lo=5, hi=12, seed=9)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = []
    for eager in (True, False):
        with LLM(tiny_checkpoint(), executor="inline", enforce_eager=eager, max_num_seqs=1) as llm:
            outs.append(llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)[0]
                        .outputs[0].token_ids)
    assert_same_outputs(tiny_checkpoint(), batch, params, [outs[1]], [outs[0]])


def test_direct_call_returns_logits_argmax_and_captured_layers():
    """A launch (the compiled graph called directly) returns what the eager forward computes over the same
    step: logits, final hidden state, each row's argmax and the hidden states of the captured layers (a
    device drafter's input), each under its own layer."""
    import numpy as np

    from namazu.layers.forward_context import forward_context
    from namazu.models.loader import load_model
    from namazu.worker.graph_mode import StepGraphs
    from namazu.worker.paged_kv_cache import PagedLatentCache

    model = load_model(tiny_checkpoint(), dtype=torch.float32, device="cpu").eval()
    cache = PagedLatentCache(model.config, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    layers = (1, 0)   # (the test checkpoint has two layers)
    g = StepGraphs(model, cache, torch.device("cpu"), max_num_seqs=2, num_speculative_tokens=0,
                   max_blocks_per_seq=4, capture_layers=layers, backend="eager")
    with torch.inference_mode():
        g.warm_up(progress=False)
        e = g.entry_for(2, 1)
        assert e.direct is not None
        # Two sequences decoding their first token (position 0) into blocks 3 and 5.
        width = g.load(e, np.array([0, 1]), np.array([17, 42]), np.array([0, 0]), np.array([12, 20]),
                       np.array([[3], [5]]))
        logits, hidden, captured = g.launch(e, width)
        with forward_context(e.context(width)):
            want_hidden, want_captured = model(e.input_ids, e.positions, capture_layers=layers)
        want_logits = model.compute_logits(want_hidden)
    # (Up to summation order: the traced forward runs gathered experts where eager runs grouped GEMMs.)
    assert list(captured) == list(layers)
    for i in layers:
        torch.testing.assert_close(captured[i], want_captured[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(e.greedy, logits.argmax(-1))


def test_a_compiled_graph_with_collectives_keeps_the_python_wrapper(tmp_path):
    """A tensor-parallel rank's step graph holds its collectives (the lm_head's all-gather, the all-reduces):
    inductor's C++ wrapper cannot call them (their group argument has no C++ type: "arg type Any is not yet
    supported"), so `compile_backend` compiles such a graph with the Python wrapper. A one-rank gloo group
    traces the same functional collectives."""
    import torch.distributed as dist

    from namazu.worker.graph_mode import compile_backend, has_collectives

    def step(x):
        y = x * 2
        dist.all_reduce(y)
        parts = [torch.empty_like(y)]
        dist.all_gather(parts, y)
        return torch.cat(parts) + 1

    seen = []
    backend = compile_backend("inductor")

    def spy(gm, example_inputs):
        seen.append(has_collectives(gm))
        return backend(gm, example_inputs)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        out = torch.compile(step, backend=spy, fullgraph=True)(torch.ones(4))
    finally:
        dist.destroy_process_group()
    assert seen == [True]
    assert torch.equal(out, torch.full((4,), 3.0))     # small integers in fp32: exact on any machine
