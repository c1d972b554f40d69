"""The torch reference pieces of the MoE layer, checked against the model's own experts implementations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import make_case, rel_err

from namazu.kernels import moe_dispatch as md
from namazu.layers.experts import TorchExperts
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation
from namazu.quant.nvfp4_experts import NvFP4Experts


def test_permute_unpermute_round_trip():
    c = make_case(7, 32, 16, 6, 3, seed=1, dtype=torch.float32)
    d = md.dispatch(c.topk_ids, 6)
    xs = md.permute(c.x, d)
    assert torch.equal(d.counts, torch.bincount(c.topk_ids.flatten(), minlength=6))
    # rows of one expert are contiguous and in expert order
    row_expert = c.topk_ids.flatten()[d.order]
    assert torch.all(row_expert[1:] >= row_expert[:-1])
    ones = torch.ones_like(c.topk_weights)
    torch.testing.assert_close(md.unpermute(xs, d, ones, 7), c.x * 3)


def test_bf16_reference_matches_torch_experts():
    c = make_case(9, 64, 32, 8, 2, seed=2, dtype=torch.float32)
    experts = TorchExperts(8, 64, 32, dtype=torch.float32)
    experts.w13.data.copy_(c.w13)
    experts.w2.data.copy_(c.w2)
    with torch.no_grad():
        want = experts(c.x, c.topk_ids, c.topk_weights)
    got = md.torch_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _token_by_token_nvfp4(c, w4a4: bool) -> torch.Tensor:
    """Each (token, slot) through its dequantized expert, one at a time (fp32: no rounding between GEMMs)."""
    w = c.nvfp4
    out = torch.zeros_like(c.x)
    for t in range(c.x.shape[0]):
        for s in range(c.topk_ids.shape[1]):
            e = int(c.topk_ids[t, s])
            w13 = dequantize_weight(w.w13_packed[e], w.w13_scale[e], w.w13_gs[e], torch.float32)
            w2 = dequantize_weight(w.w2_packed[e], w.w2_scale[e], w.w2_gs[e], torch.float32)
            a = fake_quantize_activation(c.x[t:t + 1], w.a13_scale[e]) if w4a4 else c.x[t:t + 1]
            h = a @ w13.T
            act = F.silu(h[:, :32]) * h[:, 32:]
            if w4a4:
                act = fake_quantize_activation(act, w.a2_scale[e])
            out[t] += c.topk_weights[t, s] * (act @ w2.T)[0]
    return out


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_nvfp4_reference_and_nvfp4_experts_match_token_by_token(mode):
    c = make_case(6, 64, 32, 4, 2, seed=3, dtype=torch.float32, w4a4=True)
    m = NvFP4Experts(4, 64, 32, mode=mode)   # handed no backend: the module runs the torch reference
    for name in ("w13_packed", "w13_scale", "w13_gs", "w2_packed", "w2_scale", "w2_gs", "a13_scale", "a2_scale"):
        getattr(m, name).copy_(getattr(c.nvfp4, name))
    w = c.nvfp4 if mode == "w4a4" else c.nvfp4.weight_only()
    want = _token_by_token_nvfp4(c, mode == "w4a4")
    got = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)
    assert rel_err(got, want) < 1e-5
    with torch.no_grad():
        assert torch.equal(m(c.x, c.topk_ids, c.topk_weights), got)


def test_block_dispatch_layout():
    num_experts, block_m = 10, 4
    c = make_case(13, 16, 16, num_experts, 3, seed=4, experts_used=5)
    bd = md.block_dispatch(c.topk_ids, num_experts, block_m)
    total = int(bd.total_rows)
    assert bd.max_rows % block_m == 0 and total <= bd.max_rows
    assert bd.max_rows == md.max_padded_rows(39, num_experts, block_m)
    pairs = bd.sorted_pairs[:total]
    real = pairs[pairs < 39]
    assert sorted(real.tolist()) == list(range(39))  # every pair exactly once
    assert torch.all(bd.sorted_pairs[total:] == 39)
    flat = c.topk_ids.flatten()
    for b in range(total // block_m):
        rows = pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < 39]
        assert rows.numel() > 0, "a used block holds at least one real row"
        assert torch.all(flat[rows.long()] == bd.block_expert[b])


def test_block_dispatch_without_tokens():
    bd = md.block_dispatch(torch.zeros(0, 2, dtype=torch.int64), 4, 16)
    assert int(bd.total_rows) == 0 and bd.max_rows == 16


def test_references_with_zero_tokens():
    c = make_case(0, 32, 16, 4, 2, seed=5)
    assert md.torch_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2).shape == (0, 32)
    assert md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4).shape == (0, 32)


def test_weights_validate_names_the_bad_tensor():
    w = make_case(2, 32, 16, 4, 2, seed=6).nvfp4
    w.w2_scale = w.w2_scale.float()
    with pytest.raises(ValueError, match="w2_scale"):
        w.validate()
