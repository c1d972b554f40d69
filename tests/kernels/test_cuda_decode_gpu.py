"""Every CUDA NVFP4 decode variant against the torch reference on the device (a GPU test: `make gpu-check`
runs it, where a skip is a failure). The CPU half is tests/kernels/test_cuda_decode.py."""
from __future__ import annotations

import functools

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err

from namazu.kernels import cuda_decode as cd
from namazu.kernels import moe_dispatch as md

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (these run in `make gpu-check`)", allow_module_level=True)

# (tokens, hidden, inter, experts, top_k, experts receiving tokens): one real row per expert block; several
# blocks of one expert; K of 3 chunks (K splits of 4 and 8 own no chunk); the 64-token end of the range.
SIZES = [(1, 512, 256, 16, 4, None), (7, 384, 256, 16, 4, None), (40, 512, 384, 16, 4, 5),
         (64, 1024, 256, 32, 8, None)]


@pytest.fixture(scope="module")
def kernels():
    return cd.CubinDecode()


@functools.cache
def decode_case(size: tuple) -> tuple:
    """One problem per size, shared by the 32 variants: (case, decode layout, reference output)."""
    n, h, i, e, k, used = size
    c = make_case(n, h, i, e, k, seed=900 + n, experts_used=used, device="cuda")
    d = cd.DecodeWeights(cd.prepack(c.nvfp4.w13_packed, c.nvfp4.w13_scale),
                         cd.prepack(c.nvfp4.w2_packed, c.nvfp4.w2_scale))
    return c, d, md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)


@pytest.mark.parametrize("variant", cd.VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"n{s[0]}_h{s[1]}_i{s[2]}")
def test_variant_matches_reference(monkeypatch, kernels, variant, size):
    c, d, ref = decode_case(size)
    # Poisoned partials and outputs: an element a kernel forgets to write shows up as NaN.
    monkeypatch.setattr(cd, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                               device=device))
    out = kernels.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, d, variant)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


PREFILL_SIZES = [(300, 512, 256, 8, 4, None), (1100, 384, 384, 16, 8, 12), (70, 256, 128, 4, 2, None)]


@pytest.fixture(scope="module")
def prefill():
    return cd.CubinPrefill()


@pytest.mark.parametrize("variant", cd.PREFILL_VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("size", PREFILL_SIZES, ids=lambda s: f"n{s[0]}_h{s[1]}_i{s[2]}")
def test_prefill_variant_matches_reference(monkeypatch, prefill, variant, size):
    from namazu.kernels import cuda_moe
    n, h, i, e, k, used = size
    c = make_case(n, h, i, e, k, seed=970 + n, experts_used=used, device="cuda")
    monkeypatch.setattr(cuda_moe, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                     device=device))
    out = prefill.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, variant)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


def test_check_variant_passes_every_variant(kernels, prefill):
    """What the tuner records (bench/tune_cuda_moe.py) on the same device."""
    for v in cd.VARIANTS:
        assert cd.check_variant(kernels, v) < cd.CHECK_TOL, v.name
    for v in cd.PREFILL_VARIANTS:
        assert cd.check_variant(prefill, v) < cd.CHECK_TOL, v.name


def test_decode_is_graph_captured_and_never_syncs(kernels):
    c = make_case(8, 512, 256, 16, 4, seed=950, device="cuda")
    v = cd.Variant(4, 4, 4)
    ref = cd.decode_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4, v)   # prepack and load outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cd.decode_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cd.decode_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)   # deterministic: no atomics in the split-K reduction


def test_zero_tokens(kernels):
    c = make_case(0, 512, 256, 16, 4, seed=960, device="cuda")
    d = cd.DecodeWeights(cd.prepack(c.nvfp4.w13_packed, c.nvfp4.w13_scale),
                         cd.prepack(c.nvfp4.w2_packed, c.nvfp4.w2_scale))
    assert kernels.moe(c.x, c.topk_ids, c.topk_weights, c.nvfp4, d, cd.VARIANTS[0]).shape == (0, 512)


def test_cuda_backend_runs_the_tables_picks(monkeypatch, tmp_path):
    """The real path: a table for this device (as the tuner writes it) makes the `cuda` backend's NVFP4
    call take the decode variant at 8 tokens and the large-batch one at 300, both right."""
    import json

    from namazu.kernels import backends
    checked = {"nt4_w4_prmt_s4": True, "pf_m128": True}
    table = cd.table_dict(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), checked,
                          [(64, "nt4_w4_prmt_s4"), (cd.NO_LIMIT, "pf_m128")])
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"cuda_moe_table": table}))
    monkeypatch.setenv(cd.TABLE_ENV, str(path))
    monkeypatch.setattr(cd, "_STATE", {})
    b = backends.build_backend("cuda", "cuda")
    for n, want in ((8, cd.Variant(4, 4, 4, "prmt")), (300, cd.PrefillVariant(128))):
        c = make_case(n, 512, 256, 16, 4, seed=990 + n, device="cuda")
        assert cd.select_decode(c.x, c.nvfp4) == want
        out = b.nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
        assert rel_err(out, md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)) < TOL
