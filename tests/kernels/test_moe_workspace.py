"""The MoE runner's per-ladder-entry workspace (namazu/kernels/moe_workspace.py): graph-mode steps run
the routed experts in buffers built once per entry, bit-identical to the eager grouped-GEMM path, with
no allocation per call, and every step of an entry reuses the same buffers."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import prompts, tiny_checkpoint
from torch.profiler import profile

from namazu import LLM, SamplingParams
from namazu.kernels import graph_ops, moe_workspace
from namazu.kernels.moe_workspace import MoEWorkspace, moe_grouped_mm_into


def _case(n: int, dtype: torch.dtype, seed: int, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    e, h, i, k = 6, 32, 16, 2
    x = torch.randn(n, h, generator=g).to(dtype)
    if skew:   # every token on experts 0 and 1: the other experts get no rows
        ids = torch.tensor([[0, 1]] * n)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    w13 = (0.1 * torch.randn(e, 2 * i, h, generator=g)).to(dtype)
    w2 = (0.1 * torch.randn(e, h, i, generator=g)).to(dtype)
    return x, ids, w, w13, w2, MoEWorkspace.allocate(n, k, e, h, i, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, skew", [(1, False), (5, False), (16, False), (4, True)])
def test_workspace_moe_is_bit_identical_to_grouped_mm(dtype, n, skew):
    x, ids, w, w13, w2, ws = _case(n, dtype, seed=n, skew=skew)
    want = graph_ops.moe_grouped_mm_eager(x, ids, w, w13, w2)
    got = moe_grouped_mm_into(ws, x, ids, w, w13, w2)
    assert got is ws.out
    assert torch.equal(got, want)
    assert torch.equal(ws.order, torch.argsort(ids.reshape(-1), stable=True))
    # A second call with other routing reuses the buffers and is right again.
    x2, ids2, w2_, *_ = _case(n, dtype, seed=100 + n)
    assert torch.equal(moe_grouped_mm_into(ws, x2, ids2, w2_, w13, w2),
                       graph_ops.moe_grouped_mm_eager(x2, ids2, w2_, w13, w2))


def _allocations(fn) -> list[tuple[str, int]]:
    with profile(profile_memory=True) as p:
        fn()
    return [(ev.name, ev.self_cpu_memory_usage) for ev in p.events() if ev.self_cpu_memory_usage > 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_moe_allocates_nothing(dtype):
    x, ids, w, w13, w2, ws = _case(8, dtype, seed=1)
    moe_grouped_mm_into(ws, x, ids, w, w13, w2)
    # The profiler sees the allocating path's allocations (so an empty list below means something).
    assert _allocations(lambda: graph_ops.moe_grouped_mm_eager(x, ids, w, w13, w2))
    assert _allocations(lambda: moe_grouped_mm_into(ws, x, ids, w, w13, w2)) == []


def test_workspace_rejects_bad_sizes():
    with pytest.raises(ValueError, match="must be positive"):
        MoEWorkspace.allocate(0, 2, 4, 8, 8, torch.float32, "cpu")
    x, ids, w, w13, w2, ws = _case(3, torch.float32, seed=2)
    assert ws.fits(x, ids, w13, w2)
    assert not ws.fits(x[:2], ids[:2], w13, w2)                 # another token count
    assert not ws.fits(x.double(), ids, w13.double(), w2.double())


def test_graph_steps_reuse_the_entry_workspace(monkeypatch):
    """Every graph-mode step of a ladder entry runs its MoE layers in that entry's workspace: the same
    buffers on every call (built once at start-up), written by the step (the counts are its routing)."""
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")
    seen = []
    real = graph_ops.moe_grouped_mm_into

    def recording(ws, x, topk_ids, *args):
        out = real(ws, x, topk_ids, *args)
        seen.append((tuple(t.data_ptr() for t in ws.tensors()), int(ws.counts.sum()), topk_ids.numel()))
        return out

    monkeypatch.setattr(graph_ops, "moe_grouped_mm_into", recording)
    torch._dynamo.reset()   # forwards traced by other tests would not call the patched function
    # The test model's experts are 24 KB: at this budget entries of 2 tokens (4 pairs over 8 experts, 17 KB
    # more read gathered) trace gathered experts, entries of 4 (67 KB more) run the workspace op.
    monkeypatch.setattr(moe_workspace, "GATHER_EXTRA_BYTES", 50_000)
    with LLM(tiny_checkpoint(), executor="inline", enforce_eager=False, max_num_seqs=4) as llm:
        graphs = llm.engine.executor.worker.runner.graphs
        assert graphs.entries[(2, 1)].moe_workspace is None
        ws = graphs.entries[(4, 1)].moe_workspace
        assert ws is not None
        built = tuple(t.data_ptr() for t in ws.tensors())
        seen.clear()                       # start-up's trace and warm-up call
        llm.generate(prompt_token_ids=prompts(4, lo=5, hi=10, seed=3), use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    moe_layers = sum(1 for layer in llm.engine.executor.worker.runner.model.model.layers
                     if hasattr(layer.mlp, "experts"))
    assert moe_layers > 0
    assert len(seen) == 5 * moe_layers, "graph-mode decode steps did not run the MoE in the workspace"
    assert {ptrs for ptrs, _, _ in seen} == {built}
    assert all(total == pairs for _, total, pairs in seen)


def test_traced_gathered_experts_match_the_grouped_path():
    """Entries with few pairs per expert trace the experts as gathered products (compiled with the
    forward); they compute the grouped-GEMM result up to summation order."""
    from namazu.kernels.moe_workspace import gathers_in_graph
    from namazu.layers.experts import TorchExperts

    tiny = 3 * 128 * 256 * 2         # namazu-tiny's bf16 expert: 14 and 28 pairs over 12 gather, 56 do not
    assert gathers_in_graph(14, 12, tiny) and gathers_in_graph(28, 12, tiny) and not gathers_in_graph(56, 12, tiny)
    big = 3 * 7168 * 2048 * 2        # a DeepSeek-V3 expert: gathered while experts rarely repeat
    assert gathers_in_graph(2, 256, big) and not gathers_in_graph(16, 256, big)
    experts = TorchExperts(6, 32, 16)
    experts.reset_parameters(0.1)
    x, ids, w, *_ = _case(3, torch.float32, seed=7)
    with torch.no_grad():
        want = graph_ops.moe_grouped_mm_eager(x, ids, w, experts.w13, experts.w2)
        torch.testing.assert_close(experts._forward_gathered_traced(x, ids, w), want, rtol=1e-5, atol=1e-6)
