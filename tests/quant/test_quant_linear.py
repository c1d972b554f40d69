"""NvFP4Linear: ModelOpt state_dict names, W4A16 / W4A4 numerics, dtype casts leave packed data alone."""
import torch
from torch import nn

from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation, quantize_weight
from namazu.quant.nvfp4_linear import NvFP4Linear


def _pair(bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias)
    x = torch.randn(3, 5, 64)
    return lin, x, NvFP4Linear.from_linear(lin, x.abs().max(), mode="w4a4")


@torch.no_grad()
def test_numerics_of_both_modes():
    lin, x, q = _pair()
    packed, sf, s2 = quantize_weight(lin.weight)
    w = dequantize_weight(packed, sf, s2, torch.float32)
    want = fake_quantize_activation(x, q.input_scale) @ w.T + lin.bias
    assert torch.allclose(q(x), want, rtol=1e-5, atol=1e-6)
    q.nvfp4_mode = "w4a16"
    assert torch.allclose(q(x), x @ w.T + lin.bias, rtol=1e-5, atol=1e-6)
    assert torch.equal(q.weight, w)            # .weight is the dequantized weight (MLA absorb reads it)


def test_state_dict_uses_modelopt_names_and_round_trips():
    _, _, q = _pair()
    sd = q.state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()} == {
        "weight": (torch.uint8, (48, 32)), "weight_scale": (torch.float8_e4m3fn, (48, 4)),
        "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ()), "bias": (torch.float32, (48,))}
    r = NvFP4Linear.from_tensors({k: v for k, v in sd.items() if k != "bias"}, bias=sd["bias"], mode="w4a4",
                                 dtype=torch.float32)
    x = torch.randn(2, 64)
    assert torch.equal(r(x), q(x))


def test_model_dtype_cast_keeps_packed_data():
    _, _, q = _pair()
    q.to(torch.bfloat16)
    assert q.qweight.dtype == torch.uint8 and q.weight_scale.dtype == torch.float8_e4m3fn
    assert q.weight_scale_2.dtype == torch.float32 and q.bias.dtype == torch.bfloat16
    assert q(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
