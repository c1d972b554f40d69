"""NVFP4 format rules (REFERENCE.md section 2): rounding, ties, saturation, packing, scales, bad input."""
import pytest
import torch

from namazu.quant.nvfp4 import (
    E4M3_MIN_SUBNORMAL,
    dequantize_weight,
    e2m1_decode,
    e2m1_encode,
    fake_quantize_activation,
    input_scale_for,
    pack_nibbles,
    quantize_activation,
    quantize_weight,
    unpack_nibbles,
)

VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_encode_grid_points_and_negatives():
    x = torch.tensor(VALUES + [-v for v in VALUES[1:]])
    codes = e2m1_encode(x)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(e2m1_decode(codes), x)


@pytest.mark.parametrize("value,code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),    # exact ties -> even code
    (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (1.7499999, 3), (2.5000002, 5), (3.4999998, 5),
    (5.0000005, 7), (6.0, 7), (6.5, 7), (1e30, 7),                                   # saturation at 6
    (-0.75, 10), (-3.5, 14), (-100.0, 15), (-0.1, 8), (0.1, 0),
])
def test_round_nearest_even_with_saturation(value, code):
    assert e2m1_encode(torch.tensor([value], dtype=torch.float32)).item() == code


def test_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[1 | 2 << 4, 15 | 0 << 4, 7 | 9 << 4]]
    assert torch.equal(unpack_nibbles(packed), codes)


def _two_block_tensor(block0):
    """Row with a first block chosen by the test and a second block holding 2688 so that s2 == 1."""
    w = torch.zeros(1, 32)
    w[0, :16] = torch.tensor(block0)
    w[0, 16] = 6 * 448
    return w


def test_scales_and_ties_in_quantize_weight():
    block = [6, 0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5, -0.75, -1.75, -3.5, -5, 0.5, 3, 4, 0]
    packed, sf, s2 = quantize_weight(_two_block_tensor(block))
    assert s2.dtype == torch.float32 and s2.dim() == 0 and s2.item() == 1.0
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (1, 2)
    assert sf.float().tolist() == [[1.0, 448.0]]
    codes = unpack_nibbles(packed)[0, :16].tolist()
    assert codes == [7, 2, 4, 6, 0, 2, 4, 6, 10, 12, 14, 14, 1, 5, 6, 0]
    deq = dequantize_weight(packed, sf, s2, torch.float32)
    assert deq[0, 16].item() == 6 * 448 and deq[0, 0].item() == 6


def test_divides_by_the_fp8_rounded_block_scale():
    # Block amax 6.18 wants scale 1.03, which E4M3 rounds to 1.0. The value 2.55 then quantizes as
    # 2.55 / 1.0 -> 3 (code 5); dividing by the unrounded 1.03 would give 2.48 -> 2 (code 4).
    w = _two_block_tensor([6 * 1.03, 2.55] + [0.0] * 14)
    packed, sf, s2 = quantize_weight(w)
    assert s2.item() == 1.0 and sf[0, 0].float().item() == 1.0
    assert unpack_nibbles(packed)[0, 1].item() == 5


def test_zeros_tensor_and_zero_block():
    packed, sf, s2 = quantize_weight(torch.zeros(4, 32))
    assert torch.all(packed == 0) and torch.all(sf.float() == 1.0) and s2.item() > 0
    assert torch.all(dequantize_weight(packed, sf, s2) == 0)
    w = torch.randn(2, 32)
    w[1, 16:] = 0
    packed, sf, s2 = quantize_weight(w)
    assert sf[1, 1].float().item() == 1.0 and torch.all(unpack_nibbles(packed)[1, 16:] == 0)


def test_tiny_block_clamps_to_min_subnormal_scale_and_huge_values_stay_finite():
    w = torch.zeros(1, 32)
    w[0, 0] = 1e-7          # block 0: far below s2 * 6 * 2^-9
    w[0, 16] = 1e4
    packed, sf, s2 = quantize_weight(w)
    assert sf[0, 0].float().item() == E4M3_MIN_SUBNORMAL
    assert unpack_nibbles(packed)[0, 0].item() == 0
    huge = torch.randn(8, 64) * 1e30
    packed, sf, s2 = quantize_weight(huge)
    deq = dequantize_weight(packed, sf, s2, torch.float32)
    assert torch.isfinite(deq).all()
    rel = (deq - huge).abs().max() / huge.abs().max()
    assert rel < 0.2


def test_shared_global_scale_and_saturation():
    w = torch.full((1, 16), 1e4)
    packed, sf, s2 = quantize_weight(w, global_scale=1.0)   # too small: scale saturates at 448, codes at 6
    assert s2.item() == 1.0 and sf.float().max().item() == 448.0
    assert torch.all(unpack_nibbles(packed) == 7)
    gate, up = torch.randn(8, 32), 3 * torch.randn(8, 32)
    shared = torch.maximum(quantize_weight(gate)[2], quantize_weight(up)[2])
    for t in (gate, up):
        p, s, g = quantize_weight(t, global_scale=shared)
        assert g.item() == shared.item()
        err = (dequantize_weight(p, s, g, torch.float32) - t).abs().max() / t.abs().max()
        assert err < 0.2


def test_round_trip_error_is_small_on_gaussian_weights():
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    packed, sf, s2 = quantize_weight(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8 and sf.shape == (64, 16)
    deq = dequantize_weight(packed, sf, s2, torch.float32)
    rel = ((deq - w.float()).norm() / w.float().norm()).item()
    assert 0.02 < rel < 0.15   # FP4 with block scales: ~9% relative error on Gaussians, never exact


@pytest.mark.parametrize("bad,kind", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_rejected_naming_the_tensor(bad, kind):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=rf"layers\.3\.mlp\.experts\.7\.up_proj.*{kind}"):
        quantize_weight(w, name="layers.3.mlp.experts.7.up_proj")


def test_bad_shapes_and_scales_rejected():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_weight(torch.randn(4, 24), name="w")
    with pytest.raises(ValueError, match="global_scale"):
        quantize_weight(torch.randn(4, 32), global_scale=0.0)
    with pytest.raises(ValueError, match="same NVFP4 tensor"):
        dequantize_weight(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 4).to(torch.float8_e4m3fn),
                          1.0)


def test_leading_dims_and_per_expert_global_scales():
    w = torch.randn(3, 8, 32)
    w[1] *= 100
    parts = [quantize_weight(w[e]) for e in range(3)]
    packed = torch.stack([p[0] for p in parts])
    sf = torch.stack([p[1] for p in parts])
    s2 = torch.stack([p[2] for p in parts])
    deq = dequantize_weight(packed, sf, s2, torch.float32)
    for e in range(3):
        assert torch.equal(deq[e], dequantize_weight(*parts[e], torch.float32))


def test_activation_quantization_follows_the_blackwell_rule():
    torch.manual_seed(1)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    amax = x.float().abs().max()
    s = input_scale_for(amax)
    codes, sf8 = quantize_activation(x, s)
    xb = x.float().view(5, 4, 16)
    want_sf = ((1 / s) * xb.abs().amax(-1) / 6).to(torch.float8_e4m3fn)
    assert torch.equal(sf8.float(), want_sf.float())
    want_codes = e2m1_encode((xb / (want_sf.float() * s).unsqueeze(-1)).view(5, 64))
    assert torch.equal(codes, want_codes)
    fq = fake_quantize_activation(x, s)
    want = e2m1_decode(codes).view(5, 4, 16) * (sf8.float().unsqueeze(-1) * s)
    assert torch.allclose(fq, want.view(5, 64))
    assert ((fq - x.float()).norm() / x.float().norm()).item() < 0.15
    # An activation far above the calibrated amax saturates the block scale at 448 and the codes at 6.
    big = torch.full((1, 16), 1000.0)
    codes, sf8 = quantize_activation(big, input_scale_for(1.0))
    assert sf8.float().item() == 448.0 and torch.all(codes == 7)
    # A block of zeros (or one whose scale underflows) quantizes to zeros, not NaN.
    codes, sf8 = quantize_activation(torch.zeros(1, 16), input_scale_for(1.0))
    assert torch.all(codes == 0) and torch.all(fake_quantize_activation(torch.zeros(1, 16), 0.5) == 0)


def test_scale_search_never_worse_and_usually_better():
    torch.manual_seed(3)
    w = torch.randn(64, 256) * torch.exp(torch.randn(64, 256) * 0.5)
    base = quantize_weight(w)
    searched = quantize_weight(w, scale_search=True)
    assert torch.equal(searched[2], base[2])                       # same global scale: same format
    err = lambda q: (dequantize_weight(*q, torch.float32) - w).square().unflatten(-1, (-1, 16)).sum(-1)  # noqa: E731
    e0, e1 = err(base), err(searched)
    assert torch.all(e1 <= e0 * (1 + 1e-6))
    assert e1.sum() < 0.95 * e0.sum()
