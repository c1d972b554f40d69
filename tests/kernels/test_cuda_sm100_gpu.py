"""The Blackwell (sm_100a) W4A4 kernel on the device against the torch reference (a GPU test for a compute
capability 10.x device: `make gpu-check` runs it there, where a skip is a failure; on other GPUs gpu-check
leaves it out). The CPU half is tests/kernels/test_cuda_sm100.py."""
from __future__ import annotations

import json

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err

from namazu.kernels import cuda_decode as cd
from namazu.kernels import cuda_sm100 as bw
from namazu.kernels import moe_dispatch as md

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != cd.SM100_MAJOR:
    pytest.skip("needs a compute capability 10.x (Blackwell) device: the cubin is sm_100a code",
                allow_module_level=True)

# (tokens, hidden, inter, experts, top_k, experts receiving tokens): decode (one real row in a 128-row
# block), several blocks per expert with ragged ends, idle experts, K of 2 to 8 stages.
SIZES = [(1, 256, 128, 8, 2, None), (9, 512, 256, 16, 4, None), (150, 512, 384, 16, 4, 5),
         (600, 1024, 256, 8, 4, None)]


@pytest.fixture(scope="module")
def kernels():
    return bw.CubinSm100()


@pytest.fixture(scope="module")
def errors(kernels) -> dict[str, float]:
    """check_sm100 of every scale arrangement: the tuner's verdicts on this device."""
    return {v.name: bw.check_sm100(kernels, v) for v in cd.SM100_VARIANTS}


@pytest.fixture(scope="module")
def variant(errors) -> cd.Sm100Variant:
    """The arrangement the MMA reads (the tests below run it); none passing fails them all."""
    passing = [v for v in cd.SM100_VARIANTS if errors[v.name] < cd.CHECK_TOL]
    assert passing, f"no scale arrangement passes its check: {errors}"
    return passing[0]


def nan_empty(shape, dtype, device):
    if dtype == torch.uint8:
        return torch.full(shape, 0x7F, dtype=dtype, device=device)   # E4M3 NaN / nibbles 0xF,0x7
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def test_activation_quantizer_is_byte_exact(kernels):
    """Codes and scales of every row (padding rows zero) equal namazu.quant.nvfp4.quantize_activation."""
    assert bw.check_quantize(kernels) == 0


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"n{s[0]}_h{s[1]}_i{s[2]}")
def test_moe_matches_the_w4a4_reference(monkeypatch, kernels, variant, size):
    n, h, i, e, k, used = size
    c = make_case(n, h, i, e, k, seed=1200 + n, experts_used=used, device="cuda", w4a4=True)
    w = c.nvfp4
    if used:   # idle experts' weights poisoned: a kernel that reads them turns the output NaN
        w.w13_scale.view(torch.uint8)[used:] = 0x7F   # E4M3 NaN
        w.w2_scale.view(torch.uint8)[used:] = 0x7F
    monkeypatch.setattr(bw, "_empty", nan_empty)   # every element of every scratch buffer must be written
    out = kernels.moe(c.x, c.topk_ids, c.topk_weights, w, variant)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


def test_exactly_one_scale_arrangement_is_right(errors):
    """The two arrangements put different words where the MMA reads a row's scales (the CPU replay shows
    it), so with random block scales exactly one can match the reference; which one is this device's
    answer to the one layout question the PTX ISA answers only in figures."""
    assert sum(err < cd.CHECK_TOL for err in errors.values()) == 1, errors


@pytest.mark.parametrize("uniform", [False, True])
def test_each_gemm_matches_its_dequantized_product(kernels, variant, uniform):
    """gate_up and down one at a time, against the dequantized product of the very codes they were given."""
    errs = bw.gemm_errors(kernels, variant, uniform=uniform)
    assert max(errs.values()) < 1e-2, errs


def test_graph_captured_and_never_syncs(kernels, variant):
    c = make_case(8, 512, 256, 16, 4, seed=1300, device="cuda", w4a4=True)
    ref = kernels.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, variant)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, variant)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, variant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)   # no atomics: a replay is bit-exact


def test_cuda_backend_runs_it_when_the_table_checked_it(monkeypatch, tmp_path, variant):
    from namazu.kernels import backends
    table = cd.table_dict(torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
                          {variant.name: True}, [], w4a4=variant.name)
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"cuda_moe_table": table}))
    monkeypatch.setenv(cd.TABLE_ENV, str(path))
    monkeypatch.setattr(cd, "_STATE", {})
    calls = []
    real = bw.sm100_moe_nvfp4
    monkeypatch.setattr(bw, "sm100_moe_nvfp4", lambda *a: calls.append(a[-1]) or real(*a))
    c = make_case(5, 512, 256, 16, 4, seed=1400, device="cuda", w4a4=True)
    out = backends.build_backend("cuda", "cuda").nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert calls == [variant]
    assert rel_err(out, md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)) < TOL
