"""namazu::small_moe_bf16 (csrc/cpu/small_moe_bf16_op.cpp, routed by kernels/small_gemm.moe_pairs): every
(token, slot) pair's expert output, pairs grouped by expert, against an fp64 oracle that rounds where the
kernel rounds (the two products' results and the activation to bf16); an expert with more pairs than the
8-row block; bad expert ids refused; and a bf16 MoE, compiled and eager, really running through it. Compared
within bf16 rounding, never bit for bit: summation orders differ."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from namazu.kernels import small_gemm

needs_kernel = pytest.mark.skipif(not small_gemm.ENABLED, reason="no AVX512_BF16 on this CPU (or no extension)")


def _weights(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16),
            (torch.randn(e, h, i, generator=g) * i ** -0.5).to(torch.bfloat16))


def _oracle(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    n, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.double().repeat_interleave(k, 0)
    h = torch.einsum("ph,pjh->pj", xs, w13[flat].double()).to(torch.bfloat16).double()
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(torch.bfloat16).double()
    return torch.einsum("pi,phi->ph", act, w2[flat].double())


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    # one bf16 rounding of the result, plus what a rounding of h13 or of the activation moves it by
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    bound = ref.abs() * 2.0 ** -8 + 2.0 ** -7 * ref.abs().max()
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 2, 7, 14, 56])
def test_pairs_grouped_by_expert_match_the_oracle(tokens):
    w13, w2 = _weights(12, 256, 128, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(12, generator=g)[:2] for _ in range(tokens)])
    _check(torch.ops.namazu.small_moe_bf16(x, ids, w13, w2), _oracle(x, ids, w13, w2))


@needs_kernel
def test_an_expert_with_more_pairs_than_the_row_block():
    """Eleven tokens all routed to experts 3 and 0: each expert's pairs run as an 8-row block and a 3-row one,
    and every pair's output lands in its own row (token-major, as the caller's weighted sum reads it)."""
    w13, w2 = _weights(4, 64, 32, seed=5)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ids = torch.tensor([[3, 0]] * 11)
    _check(torch.ops.namazu.small_moe_bf16(x, ids, w13, w2), _oracle(x, ids, w13, w2))


@needs_kernel
def test_a_bad_expert_id_is_refused_with_its_position():
    w13, w2 = _weights(4, 64, 32, seed=7)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="expert id 4 at pair 3 is outside 4 experts"):
        torch.ops.namazu.small_moe_bf16(x, torch.tensor([[0, 1], [2, 4]]), w13, w2)
    with pytest.raises(RuntimeError, match="w2 must be"):
        torch.ops.namazu.small_moe_bf16(x, torch.tensor([[0, 1], [2, 3]]), w13, w2[:, :, :16])


@needs_kernel
def test_a_compiled_bf16_moe_runs_through_the_kernel():
    """A compiled bf16 forward of the routed experts (a verify entry's 7 rows) calls the kernel once, and gives
    the weighted sum the fp32 grouped path gives, within bf16 rounding; so does an eager one."""
    from namazu.kernels import graph_ops
    from namazu.layers.experts import TorchExperts

    experts = TorchExperts(12, 256, 128, dtype=torch.bfloat16)
    experts.reset_parameters(0.06)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(12, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    fn = torch.compile(experts.forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        fn(x, ids, w)                       # compiled outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = fn(x, ids, w)
    assert sum(e.count for e in prof.key_averages() if e.key == "namazu::small_moe_bf16") == 1
    with torch.no_grad():
        want = graph_ops.moe_grouped_mm_eager(x.float(), ids, w, experts.w13.float(), experts.w2.float())
    torch.testing.assert_close(y.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eager = experts(x, ids, w)
    assert sum(e.count for e in prof.key_averages() if e.key == "namazu::small_moe_bf16") == 1
    torch.testing.assert_close(eager, y, rtol=0, atol=0)    # the same kernel on the same inputs


def test_without_the_kernel_the_traced_path_is_the_compilers(monkeypatch):
    monkeypatch.setattr(small_gemm, "ENABLED", False)
    w13, w2 = _weights(4, 64, 32, seed=9)
    assert small_gemm.moe_pairs(torch.randn(2, 64).to(torch.bfloat16), torch.tensor([[0, 1], [2, 3]]), w13, w2) is None
