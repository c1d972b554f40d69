"""Byte-for-byte agreement with an outside oracle: NVIDIA ModelOpt's NVFP4QTensor (CPU path)."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from namazu.quant.nvfp4 import dequantize_weight, quantize_weight

# nvidia-modelopt is pinned in requirements-dev.txt: without it this oracle must fail, not skip.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.quantization.qtensor import NVFP4QTensor


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "gauss_bf16", torch.randn(32, 128, generator=g).to(torch.bfloat16)
    yield "gauss_fp32", torch.randn(16, 64, generator=g)
    heavy = torch.randn(24, 96, generator=g) * torch.exp(2 * torch.randn(24, 96, generator=g))
    yield "heavy_tailed", heavy.to(torch.bfloat16)
    mixed = torch.randn(8, 64, generator=g)
    mixed[0, :16] = 0                      # zero block
    mixed[1, 16:32] *= 1e-6                # tiny block -> scale clamps to 2^-9
    mixed[2, 32:48] *= 1e4                 # huge block sets the global scale
    yield "mixed_blocks", mixed
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(4)
    ties = torch.cat([grid, -grid]).view(1, 64).repeat(2, 1)
    ties[:, -1] = 6 * 448                  # s2 = 1 and block scales 1 make every tie exact
    yield "exact_ties", ties
    yield "experts_3d", torch.randn(4, 16, 32, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("name,w", list(_cases()), ids=[c[0] for c in _cases()])
def test_quantize_matches_modelopt(name, w):
    packed, sf, s2 = quantize_weight(w, name=name)
    ref_q, ref_sf, ref_s2 = NVFP4QTensor.quantize(w.clone(), 16)
    ref_packed = ref_q._quantized_data
    assert ref_packed.dtype == packed.dtype == torch.uint8 and ref_packed.shape == packed.shape
    assert torch.equal(s2, ref_s2.float().reshape(()))
    assert ref_sf.dtype == sf.dtype and torch.equal(sf.view(torch.uint8), ref_sf.view(torch.uint8))
    assert torch.equal(packed, ref_packed), f"{(packed != ref_packed).sum().item()} bytes differ"
    ours = dequantize_weight(packed, sf, s2, torch.float32)
    ref = ref_q.dequantize(dtype=torch.float32, scale=ref_sf, double_scale=ref_s2, block_sizes={-1: 16})
    assert torch.equal(ours, ref)


def test_shared_global_scale_matches_modelopt():
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    up = (3 * torch.randn(16, 64, generator=g)).to(torch.bfloat16)
    shared = torch.maximum(quantize_weight(gate)[2], quantize_weight(up)[2])
    for t in (gate, up):
        packed, sf, _ = quantize_weight(t, global_scale=shared)
        ref_q, ref_sf, _ = NVFP4QTensor.quantize(t.clone(), 16, weights_scaling_factor_2=shared.clone())
        assert torch.equal(sf.view(torch.uint8), ref_sf.view(torch.uint8))
        assert torch.equal(packed, ref_q._quantized_data)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.integers(-30, 30), spread=st.floats(0.0, 4.0),
       rows=st.integers(1, 6), blocks=st.integers(1, 6), bf16=st.booleans())
def test_property_matches_modelopt_over_magnitudes(seed, log_scale, spread, rows, blocks, bf16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 16 * blocks, generator=g) * torch.exp(spread * torch.randn(rows, 16 * blocks, generator=g))
    w = w * (10.0 ** log_scale)
    if bf16:
        w = w.to(torch.bfloat16)
    packed, sf, s2 = quantize_weight(w)
    ref_q, ref_sf, ref_s2 = NVFP4QTensor.quantize(w.clone(), 16)
    assert torch.equal(s2, ref_s2.float().reshape(()))
    assert torch.equal(sf.view(torch.uint8), ref_sf.view(torch.uint8))
    assert torch.equal(packed, ref_q._quantized_data)
