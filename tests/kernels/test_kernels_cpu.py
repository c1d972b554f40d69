"""The C++ OpenMP NVFP4 MoE kernel (namazu/csrc/cpu) against the torch reference."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err, require_cpu_extension

from namazu.kernels import moe_dispatch as md
from namazu.kernels.backends import build_backend
from namazu.kernels.moe_types import MoERuntime, NVFP4MoEWeights

require_cpu_extension()   # a missing extension fails unless NAMAZU_BUILD_EXT=0

ISAS = {"scalar": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}


def run_cpp(c, w=None, isa=0, out=None):
    w = w or c.nvfp4
    return torch.ops.namazu.nvfp4_moe_cpu(c.x, c.topk_ids, c.topk_weights, w.w13_packed, w.w13_scale, w.w13_gs,
                                          w.w2_packed, w.w2_scale, w.w2_gs, w.a13_scale, w.a2_scale, isa, out)


def w4a16(w: NVFP4MoEWeights) -> NVFP4MoEWeights:
    return w.weight_only()


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("num_tokens", [1, 5, 19])
def test_w4a16_matches_reference(isa, num_tokens):
    c = make_case(num_tokens, 128, 64, 8, 2, seed=10 + num_tokens)
    resolved = torch.ops.namazu.nvfp4_moe_cpu_isa(ISAS[isa])
    if resolved != ISAS[isa]:
        pytest.skip(f"this CPU has no {isa} (resolves to {resolved})")
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w4a16(c.nvfp4))
    out = run_cpp(c, w4a16(c.nvfp4), ISAS[isa])
    assert out.dtype == torch.bfloat16 and out.shape == c.x.shape
    assert rel_err(out, ref) < TOL


def test_w4a4_emulation_matches_reference():
    c = make_case(6, 64, 32, 4, 2, seed=20, dtype=torch.float32, w4a4=True)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    out = run_cpp(c)
    # Same rounding rules, same fp32 operation order: only summation order differs.
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, run_cpp(c, w4a16(c.nvfp4))) > 1e-3, "W4A4 must actually round the activations"


def test_w4a4_bf16_matches_the_nvfp4_experts_emulation():
    """In bf16 the kernel rounds between GEMMs exactly where the torch reference does, and NvFP4Experts
    handed the cpp backend serves through it."""
    from namazu.quant.nvfp4_experts import NvFP4Experts

    c = make_case(12, 128, 64, 6, 2, seed=26, w4a4=True)
    m = NvFP4Experts(6, 128, 64, mode="w4a4", runtime=MoERuntime(build_backend("cpp", "cpu")))
    for name in ("w13_packed", "w13_scale", "w13_gs", "w2_packed", "w2_scale", "w2_gs", "a13_scale", "a2_scale"):
        getattr(m, name).copy_(getattr(c.nvfp4, name))
    want = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert rel_err(run_cpp(c), want) < 2e-3
    with torch.no_grad():
        assert torch.equal(m(c.x, c.topk_ids, c.topk_weights), run_cpp(c))


def test_poisoned_output_is_fully_written_and_idle_experts_skipped():
    c = make_case(11, 64, 32, 16, 2, seed=21, experts_used=3)  # 13 of 16 experts get no tokens
    # Poison the idle experts' weights: reading them would show up as NaN in the output.
    w = w4a16(c.nvfp4)
    for name in ("w13_gs", "w2_gs"):
        gs = getattr(w, name).clone()
        gs[3:] = float("nan")
        setattr(w, name, gs)
    out = torch.full((11, 64), float("nan"))
    res = run_cpp(c, w, out=out)
    assert not torch.isnan(out).any()
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)
    assert rel_err(res, ref) < TOL


def test_no_tokens():
    c = make_case(0, 32, 16, 4, 2, seed=22)
    assert run_cpp(c).shape == (0, 32)


def test_thread_count_does_not_change_the_result():
    c = make_case(64, 256, 128, 4, 2, seed=23, dtype=torch.float32)  # big enough to run in parallel
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_cpp(c)
        torch.set_num_threads(2)
        two = run_cpp(c)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_expert_id_is_rejected():
    c = make_case(3, 32, 16, 4, 2, seed=24)
    c.topk_ids[1, 0] = 4
    with pytest.raises(RuntimeError, match=r"expert id outside \[0, 4\)"):
        run_cpp(c)


def test_mismatched_weights_are_rejected():
    c = make_case(3, 32, 16, 4, 2, seed=25)
    w = w4a16(c.nvfp4)
    w.w2_packed = w.w2_packed[:, :, :4].contiguous()
    with pytest.raises(RuntimeError, match="w2_packed"):
        run_cpp(c, w)


def test_fp32_activations_stay_fp32():
    """The bf16 dot-product path is for bf16 callers only: an fp32 model keeps fp32 activations."""
    if torch.ops.namazu.nvfp4_moe_cpu_isa(ISAS["avx512bf16"]) != ISAS["avx512bf16"]:
        pytest.skip("this CPU has no AVX512_BF16")
    c = make_case(9, 64, 32, 4, 2, seed=27, dtype=torch.float32)
    w = w4a16(c.nvfp4)
    assert torch.equal(run_cpp(c, w, ISAS["avx512bf16"]), run_cpp(c, w, ISAS["avx512"]))
