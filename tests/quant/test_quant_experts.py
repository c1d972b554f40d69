"""NVFP4 routed experts: W4A16 and W4A4 numerics, lazy per-expert dequantization, memory, checkpoint params."""
import pytest
import torch

import namazu.kernels.moe_dispatch as md
from namazu.config import ModelConfig
from namazu.kernels import backends
from namazu.layers.experts import TorchExperts
from namazu.layers.moe import make_experts
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation
from namazu.quant.nvfp4_experts import NvFP4Experts, set_mode

E, H, I, K = 6, 64, 32, 2
# The serving path: the backend auto-resolved for the CPU (the C++ kernel where built).
SERVING = backends.resolve_moe_runtime("cpu", "auto", "w4a16")


def _reference(q: NvFP4Experts, x, ids, w):
    return md.torch_moe_nvfp4(x, ids, w, q.moe_weights())


def _src(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    src = TorchExperts(E, H, I, dtype=dtype)
    src.reset_parameters(0.05)
    return src


def _route(n=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g)
    return x, ids, w


def _amax(src, x):
    """Per-expert input amaxes as calibration would take them (every expert sees all of x here)."""
    a13 = torch.full((E,), x.abs().max().item())
    a2 = torch.tensor([
        (torch.nn.functional.silu(x @ src.w13.data[e, :I].T) * (x @ src.w13.data[e, I:].T)).abs().max().item()
        for e in range(E)])
    return a13, a2


def _dequantized_torch_experts(q: NvFP4Experts) -> TorchExperts:
    ref = TorchExperts(E, H, I, dtype=torch.float32)
    ref.w13.data.copy_(dequantize_weight(q.w13_packed, q.w13_scale, q.w13_gs, torch.float32))
    ref.w2.data.copy_(dequantize_weight(q.w2_packed, q.w2_scale, q.w2_gs, torch.float32))
    return ref


@torch.no_grad()
def test_w4a16_equals_dequantized_reference_and_is_close_to_fp32():
    src = _src()
    q = NvFP4Experts.from_experts(src, mode="w4a16", runtime=SERVING)
    x, ids, w = _route()
    out = _reference(q, x, ids, w)
    ref = _dequantized_torch_experts(q)(x, ids, w)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    # The serving path (MoE kernel backend) computes the same thing.
    assert torch.allclose(q(x, ids, w), out, rtol=1e-4, atol=1e-5)
    full = src(x, ids, w)
    rel = ((out - full).norm() / full.norm()).item()
    assert 0.01 < rel < 0.2


@torch.no_grad()
def test_w4a4_matches_a_token_by_token_emulation():
    src = _src()
    x, ids, w = _route()
    a13, a2 = _amax(src, x)
    q = NvFP4Experts.from_experts(src, a13, a2, mode="w4a4", runtime=SERVING)
    out = _reference(q, x, ids, w)
    assert torch.allclose(q(x, ids, w), out, rtol=1e-4, atol=1e-5)   # the kernel backend agrees
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(K):
            e = ids[t, s].item()
            w13 = dequantize_weight(q.w13_packed[e], q.w13_scale[e], q.w13_gs[e], torch.float32)
            w2 = dequantize_weight(q.w2_packed[e], q.w2_scale[e], q.w2_gs[e], torch.float32)
            h = fake_quantize_activation(x[t:t + 1], q.a13_scale[e]) @ w13.T
            act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            want[t] += w[t, s] * (fake_quantize_activation(act, q.a2_scale[e]) @ w2.T)[0]
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    assert set_mode(q, "w4a16") == 1
    w4a16 = _reference(q, x, ids, w)
    assert not torch.allclose(out, w4a16, rtol=1e-4)      # activations really are quantized in w4a4
    full = src(x, ids, w)
    assert ((out - full).norm() / full.norm()).item() < 0.3


def test_only_touched_experts_are_dequantized(monkeypatch):
    q = NvFP4Experts.from_experts(_src())    # handed no backend: the torch reference runs
    calls = []
    real = md.dequantize_weight

    def spy(packed, *a, **kw):
        calls.append(packed.data_ptr())
        return real(packed, *a, **kw)

    monkeypatch.setattr(md, "dequantize_weight", spy)
    x, _, w = _route(n=4)
    ids = torch.tensor([[1, 3], [3, 1], [1, 3], [3, 1]])
    before = q.resident_bytes()
    with torch.no_grad():
        q(x, ids, w)
    touched = {q.w13_packed[e].data_ptr() for e in (1, 3)} | {q.w2_packed[e].data_ptr() for e in (1, 3)}
    assert set(calls) == touched and len(calls) == 4
    assert q.resident_bytes() == before       # nothing cached: no BF16 copy survives the call


def test_resident_bytes_are_about_4_5_bits_per_weight():
    q = NvFP4Experts.from_experts(_src(torch.bfloat16))
    bits = q.resident_bytes() * 8 / q.num_weights()
    assert 4.5 <= bits < 4.6, bits
    q.to(torch.bfloat16)                      # a model-wide dtype cast leaves the packed data alone
    assert q.w13_packed.dtype == torch.uint8 and q.w13_scale.dtype == torch.float8_e4m3fn
    assert q.w13_gs.dtype == torch.float32 and q.resident_bytes() * 8 / q.num_weights() == bits


def test_checkpoint_params_round_trip_and_gate_up_share_scales():
    src = _src()
    x, _, _ = _route()
    q = NvFP4Experts.from_experts(src, *_amax(src, x))
    params = list(q.expert_params())
    assert len(params) == E * 3 * 4
    by = {(e, p, n): t for e, p, n, t in params}
    for e in range(E):
        assert by[(e, "gate_proj", "weight")].shape == (I, H // 2)
        assert by[(e, "down_proj", "weight")].shape == (H, I // 2)
        assert by[(e, "gate_proj", "weight_scale")].dtype == torch.float8_e4m3fn
        assert by[(e, "up_proj", "weight_scale")].shape == (I, H // 16)
        assert by[(e, "down_proj", "weight_scale")].shape == (H, I // 16)
        for n in ("weight_scale_2", "input_scale"):
            assert by[(e, "gate_proj", n)].shape == () and by[(e, "gate_proj", n)].dtype == torch.float32
            assert torch.equal(by[(e, "gate_proj", n)], by[(e, "up_proj", n)])
    fresh = NvFP4Experts(E, H, I)
    for e, p, n, t in params:
        fresh.load_expert_param(e, p, n, t.clone())
    for name, buf in q.named_buffers():
        assert torch.equal(buf.view(torch.uint8) if buf.dtype == torch.float8_e4m3fn else buf,
                           getattr(fresh, name).view(torch.uint8) if buf.dtype == torch.float8_e4m3fn
                           else getattr(fresh, name)), name
    assert set(fresh.expected_params()) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}


def test_bad_params_are_refused_with_names():
    q = NvFP4Experts(E, H, I)
    with pytest.raises(TypeError, match="expert 2 gate_proj.weight.*uint8"):
        q.load_expert_param(2, "gate_proj", "weight", torch.zeros(I, H // 2))
    with pytest.raises(ValueError, match="expert 1 down_proj.weight_scale: shape"):
        q.load_expert_param(1, "down_proj", "weight_scale", torch.zeros(I, H // 16).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="expert 4 up_proj.input_scale = 0.0.*uncalibrated"):
        q.load_expert_param(4, "up_proj", "input_scale", torch.tensor(0.0))
    with pytest.raises(ValueError, match="input_scale = nan"):
        q.load_expert_param(4, "up_proj", "input_scale", torch.tensor(float("nan")))
    q.load_expert_param(0, "gate_proj", "weight_scale_2", torch.tensor(0.5))
    with pytest.raises(ValueError, match="share weight_scale_2"):
        q.load_expert_param(0, "up_proj", "weight_scale_2", torch.tensor(0.25))
    with pytest.raises(ValueError, match=r"experts \[0, 1, 2, 3, 4, 5\] have no calibrated input_scale"):
        list(q.expert_params())
    with pytest.raises(ValueError, match="NVFP4 mode"):
        NvFP4Experts(E, H, I, mode="w8a8")


def test_registered_as_nvfp4_format_honouring_exclude_modules(monkeypatch):
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_hidden_layers=3,
                      quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4",
                                           "exclude_modules": ["lm_head", "model.layers.2.mlp.experts*"]})
    monkeypatch.setenv(backends.MODE_ENV, "w4a4")
    runtime = backends.resolve_moe_runtime("cpu")   # reads the environment once
    m = make_experts("nvfp4", cfg, 1, dtype=torch.bfloat16, runtime=runtime)
    assert isinstance(m, NvFP4Experts) and m.nvfp4_mode == "w4a4" and m.runtime is runtime
    assert type(make_experts("nvfp4", cfg, 2, dtype=torch.bfloat16)) is TorchExperts


@torch.no_grad()
def test_backend_matches_reference_in_bf16_both_modes():
    src = _src(torch.bfloat16, seed=4)
    x, ids, w = _route(n=32, seed=5)
    x = x.to(torch.bfloat16)
    q = NvFP4Experts.from_experts(src, *_amax(src, x), runtime=SERVING)
    for mode in ("w4a16", "w4a4"):
        set_mode(q, mode)
        ref = _reference(q, x, ids, w).float()
        got = q(x, ids, w).float()
        # same rounding points; only fp32 accumulation order (and W4A16's fp32 vs bf16 GEMM) differ
        assert ((got - ref).norm() / ref.norm()).item() < 0.01, mode
