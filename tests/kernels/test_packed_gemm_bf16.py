"""The lm_head's few-row product on a packed weight (csrc/cpu/packed_gemm_bf16.cpp, kernels/small_gemm.py
`pack` / `packed_linear`) against an fp64 oracle: every row count the kernel's register blocks branch on (up
to 8, past 8), odd K (one bf16 of padding per pair), columns that end inside a 16-column block, the rounding
rule and NaN; a row's result whatever the rows beside it (the kernel accumulates each row alone, in one
order: bit for bit here because the code makes it so); the routing (5 to 8 rows); and that a served bf16
model's lm_head and the drafter's head run through it while fp32 does not."""
from __future__ import annotations

import pytest
import torch

from namazu.kernels import small_gemm

needs_kernel = pytest.mark.skipif(not small_gemm.ENABLED, reason="no AVX512_BF16 on this CPU (or no extension)")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().t()
    k = x.shape[-1]
    # one bf16 rounding of the result plus fp32 accumulation error over k terms of bf16 products
    bound = ref.abs() * 2.0 ** -8 + 1e-6 * k * (1 + ref.abs().max())
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("k", [1, 2, 37, 256, 300])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 7, 8, 11, 17])
def test_every_row_count_and_k_against_the_oracle(k, m):
    g = torch.Generator().manual_seed(k * 100 + m)
    for n in (16, 37, 200):   # one block, a block cut after 5 columns, 12.5 blocks (3-block groups cut short)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        _check(torch.ops.namazu.packed_linear_bf16(x, small_gemm.pack(w), n), x, w)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    packed = small_gemm.pack(w)
    x = torch.randn(11, 256, generator=g).to(torch.bfloat16)
    # Exact: the kernel accumulates each row alone over k in one order whatever the row count (the one code path
    # the op has, on every CPU that runs it); this is what the test checks.
    alone = torch.cat([torch.ops.namazu.packed_linear_bf16(x[i:i + 1], packed, 300) for i in range(11)])
    for m in (2, 5, 7, 8, 11):
        assert torch.equal(torch.ops.namazu.packed_linear_bf16(x[:m], packed, 300), alone[:m]), m


@needs_kernel
def test_rounds_to_nearest_even_and_keeps_nan():
    # 1 + 2^-8 is halfway between two bf16 values: nearest even is 1.0; 1 + 3 * 2^-8 rounds up to 1 + 2^-6
    # (as torch's own float -> bfloat16 conversion does).
    x2 = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    w2 = torch.zeros(16, 2, dtype=torch.bfloat16)
    w2[0] = torch.tensor([1.0, 2.0 ** -8])
    w2[1] = torch.tensor([1.0, 3 * 2.0 ** -8])
    w2[2] = torch.tensor([-1.0, 0.0])
    y = torch.ops.namazu.packed_linear_bf16(x2, small_gemm.pack(w2), 16)[0, :3]
    want = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -1.0]).to(torch.bfloat16)
    assert torch.equal(y, want), (y, want)   # exact: the fp32 sums are exact, only the rounding rule acts
    w2[5, 1] = float("nan")
    assert torch.ops.namazu.packed_linear_bf16(x2, small_gemm.pack(w2), 16)[0, 5].isnan()


@needs_kernel
def test_packed_linear_routes_few_bf16_rows_only_and_compiles():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16)
    packed = small_gemm.pack(w)
    assert small_gemm.pack(w.float()) is None
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    y = small_gemm.packed_linear(x, w, packed)
    assert y.shape == (2, 3, 100)
    # Exact below: each side runs the same op (or the same `linear`) on the same rows and shape.
    assert torch.equal(y.reshape(6, 100), torch.ops.namazu.packed_linear_bf16(x.reshape(6, 64), packed, 100))
    # past MAX_ROWS torch's own; under PACKED_MIN_ROWS the dot-product block
    for m in (small_gemm.MAX_ROWS + 1, small_gemm.PACKED_MIN_ROWS - 1):
        other = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        assert torch.equal(small_gemm.packed_linear(other, w, packed), small_gemm.linear(other, w)), m
    compiled = torch.compile(lambda a: small_gemm.packed_linear(a, w, packed), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), y)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_served_bf16_model_packs_its_lm_head_and_the_drafters_head(dtype):
    from namazu import LLM, SamplingParams
    from namazu.assets import default_model_path
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    with LLM(None, dtype=dtype, enforce_eager=True, executor="inline", threads=1,
             speculative_model=str(default_model_path() / SHIPPED_DRAFTER_DIR)) as llm:
        runner = llm.engine.executor.worker.runner
        head, proposer = runner.model.lm_head, runner.spec.proposer
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(["会議の議事録について、要点を三つ挙げてください。"], params, use_tqdm=False)
    calls = sum(e.count for e in prof.key_averages() if e.key == "namazu::packed_linear_bf16")
    if dtype == "float32":
        assert head.packed is None and proposer.head_packed is None and calls == 0
        return
    # Exact: packing only moves bf16 values.
    assert torch.equal(head.packed, small_gemm.pack(head.weight))
    assert torch.equal(proposer.head_packed, small_gemm.pack(proposer.head))
    # every verify step's lm_head (7 rows), and every block the drafter proposes (6 rows)
    assert calls >= 2 * 3, calls
