"""The CPU decode layout (namazu/csrc/cpu/nvfp4_decode_cpu.h) and its W4A16 kernel against the torch
reference, on every vector path this CPU has (the AVX2 path and the forced scalar fallback)."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err, require_cpu_extension

from namazu.kernels import cpu_decode
from namazu.kernels import moe_dispatch as md
from namazu.kernels.backends import build_backend
from namazu.kernels.moe_types import MoERuntime, NVFP4MoEWeights
from namazu.quant.nvfp4 import dequantize_weight

require_cpu_extension()

SCALAR, AVX2 = 1, 2
# The paths the run-time pick can take here: the scalar fallback always, AVX2 where the CPU has it.
PATHS = [SCALAR] + ([AVX2] if torch.ops.namazu.nvfp4_decode_isa(0) == AVX2 else [])
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def tile_element_map() -> torch.Tensor:
    """[4 rows, 64 bytes, 2 nibbles] -> (row, element within the 128-wide tile), as the header spells it out."""
    elem = torch.empty(4, 64, 2, dtype=torch.int64)
    for b64 in range(64):
        u, b = divmod(b64, 32)
        half, slot = int((b & 15) >= 8), (b >= 16) * 8 + (b & 7)
        for nib in range(2):
            i = u * 4 + nib * 2 + half
            elem[:, b64, nib] = (slot // 2) * 16 + 2 * i + slot % 2
    return elem


def unpack(t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode layout [E, R/4, KT, 288] -> (E2M1 codes [E, R, k], E4M3 scale bytes [E, R, k/16]), in Python."""
    e, groups, kt, _ = t.shape
    nib = torch.stack([t[..., :256] & 0xF, t[..., :256] >> 4], dim=-1).reshape(e, groups, kt, 4, 64, 2)
    codes = torch.zeros(e, groups, kt, 4, 128, dtype=torch.uint8)
    elem = tile_element_map()
    for r in range(4):
        codes[:, :, :, r, elem[r].reshape(-1)] = nib[:, :, :, r].reshape(e, groups, kt, 128)
    codes = codes.permute(0, 1, 3, 2, 4).reshape(e, groups * 4, kt * 128)
    scales = t[..., 256:].reshape(e, groups, kt, 4, 8).permute(0, 1, 3, 2, 4).reshape(e, groups * 4, kt * 8)
    return codes[:, :, :k], scales[:, :, : k // 16]


def odd_scales(w: NVFP4MoEWeights, seed: int) -> NVFP4MoEWeights:
    """Some block scales negative, some subnormal: what the sign folding and the half-float decode must
    get right (a checkpoint's scales are normally positive normals)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("w13_scale", "w2_scale"):
        raw = getattr(w, name).view(torch.uint8).clone()
        pick = torch.rand(raw.shape, generator=g)
        raw[pick < 0.2] |= 0x80                                                    # negative
        sub = pick > 0.9
        raw[sub] = torch.randint(1, 8, (int(sub.sum()),), generator=g, dtype=torch.uint8)  # subnormal
        out[name] = raw.view(torch.float8_e4m3fn)
    return NVFP4MoEWeights(w.w13_packed, out["w13_scale"], w.w13_gs, w.w2_packed, out["w2_scale"], w.w2_gs)


def decode(c, w: NVFP4MoEWeights, isa: int = 0, x: torch.Tensor | None = None, out=None) -> torch.Tensor:
    d = cpu_decode.prepack(w)
    x = c.x if x is None else x
    return torch.ops.namazu.nvfp4_moe_cpu_decode(x, c.topk_ids, c.topk_weights, d.w13, w.w13_gs, d.w2, w.w2_gs, isa,
                                                 out)


@pytest.mark.parametrize("k", [128, 144, 256, 400])   # whole tiles and K tails
def test_layout_dequantizes_to_the_modelopt_weights(k):
    c = make_case(1, k, 64, 2, 1, seed=k)
    w = odd_scales(c.nvfp4.weight_only(), seed=k)
    d = cpu_decode.prepack(w)
    assert d.w13.shape == (2, 32, -(-k // 128), 288)
    assert d.nbytes() == sum(getattr(w, n).numel() for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")) \
        + (d.w13.shape[2] * 128 - k) * 128 * 9 // 16 * 2 + (d.w2.shape[2] * 128 - 64) * k * 9 // 16 * 2
    codes, scales = unpack(d.w13, k)
    assert not (scales & 0x80).any(), "stored scales are non-negative (the sign lives in the codes)"
    mine = E2M1[codes.long()] * scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    for e in range(2):
        want = dequantize_weight(w.w13_packed[e], w.w13_scale[e], torch.tensor(1.0), dtype=torch.float32)
        assert torch.equal(mine[e], want)
    # padding past K: zero codes and zero scales
    full_codes = unpack(d.w13, d.w13.shape[2] * 128)[0]
    assert not full_codes[:, :, k:].any()


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 19])   # every token tile (1-4) and remainders
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(isa, num_tokens, dtype):
    c = make_case(num_tokens, 256, 144, 6, 3, seed=30 + num_tokens, dtype=dtype, experts_used=4)
    w = odd_scales(c.nvfp4.weight_only(), seed=num_tokens)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)
    out = decode(c, w, isa)
    assert out.dtype == dtype and out.shape == c.x.shape
    # bf16: the output's own rounding dominates; fp32: only the 16-bit activation grid (2^-16 of a block max)
    assert rel_err(out, ref) < (TOL if dtype == torch.bfloat16 else 1e-4)


def test_paths_agree_and_threads_do_not_change_the_result():
    c = make_case(9, 384, 128, 8, 2, seed=41, dtype=torch.float32)
    w = c.nvfp4.weight_only()
    base = decode(c, w, PATHS[-1])
    assert rel_err(decode(c, w, SCALAR), base) < 1e-6   # same integer sums; fp32 vs fp64 scaling sums
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(decode(c, w, PATHS[-1]), base)  # each output element is one work item's
    finally:
        torch.set_num_threads(threads)


def test_activation_outliers_and_wide_blocks():
    """Blocks with a 1e4 outlier: the small values round to the block's 16-bit grid, well inside tolerance."""
    c = make_case(4, 256, 64, 4, 2, seed=42, dtype=torch.float32)
    x = c.x.clone()
    x[:, ::37] *= 1e4
    w = c.nvfp4.weight_only()
    ref = md.torch_moe_nvfp4(x, c.topk_ids, c.topk_weights, w)
    assert rel_err(decode(c, w, x=x), ref) < 1e-4


def test_non_finite_activation_reaches_only_its_token():
    c = make_case(3, 128, 64, 4, 2, seed=43, dtype=torch.float32)
    x = c.x.clone()
    x[1, 7] = float("nan")
    out = decode(c, c.nvfp4.weight_only(), x=x)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


def test_idle_experts_are_not_read_and_output_is_fully_written():
    c = make_case(11, 128, 64, 16, 2, seed=44, experts_used=3, dtype=torch.float32)
    w = c.nvfp4.weight_only()
    gs13, gs2 = w.w13_gs.clone(), w.w2_gs.clone()
    gs13[3:], gs2[3:] = float("nan"), float("nan")
    w = NVFP4MoEWeights(w.w13_packed, w.w13_scale, gs13, w.w2_packed, w.w2_scale, gs2)
    out = torch.full((11, 128), float("nan"))
    res = decode(c, w, out=out)
    assert not torch.isnan(out).any()
    assert rel_err(res, md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, w)) < 1e-4


def test_no_tokens():
    c = make_case(0, 128, 32, 4, 2, seed=45)
    assert decode(c, c.nvfp4.weight_only()).shape == (0, 128)


def test_bad_inputs_are_named():
    c = make_case(2, 128, 32, 4, 2, seed=46)
    w = c.nvfp4.weight_only()
    d = cpu_decode.prepack(w)
    bad_ids = c.topk_ids.clone()
    bad_ids[0, 0] = 4
    with pytest.raises(RuntimeError, match="expert id outside"):
        torch.ops.namazu.nvfp4_moe_cpu_decode(c.x, bad_ids, c.topk_weights, d.w13, w.w13_gs, d.w2, w.w2_gs)
    with pytest.raises(RuntimeError, match="w2 .* is not the decode layout of \\[E, H, I\\]"):
        torch.ops.namazu.nvfp4_moe_cpu_decode(c.x[:, :64], c.topk_ids, c.topk_weights, d.w13, w.w13_gs, d.w2,
                                              w.w2_gs)
    with pytest.raises(RuntimeError, match="must be a multiple of 4"):
        torch.ops.namazu.nvfp4_prepack_cpu(w.w13_packed[:, :6], w.w13_scale[:, :6])
    nan = w.w2_scale.view(torch.uint8).clone()
    nan[1, 2, 0] = 0x7F
    with pytest.raises(ValueError, match="cannot prepack w2.*NaN code"):
        cpu_decode.prepack(NVFP4MoEWeights(w.w13_packed, w.w13_scale, w.w13_gs, w.w2_packed,
                                           nan.view(torch.float8_e4m3fn), w.w2_gs))


def test_the_cpp_backend_serves_w4a16_from_the_decode_layout_and_sees_weight_updates():
    """NvFP4Experts handed the cpp backend: W4A16 runs the decode kernel (prepacked at the layer's first
    call, once), W4A4 the ModelOpt-layout kernel; an in-place update of the buffers re-prepacks."""
    from namazu.quant.nvfp4_experts import NvFP4Experts

    backend = build_backend("cpp", "cpu")
    assert backend.w4a16_impl == "cpp-decode"
    cache = backend._w4a16.args[0]
    a, b = (make_case(5, 128, 64, 6, 2, seed=s, w4a4=True) for s in (47, 48))
    m = NvFP4Experts(6, 128, 64, mode="w4a16", runtime=MoERuntime(backend))
    names = ("w13_packed", "w13_scale", "w13_gs", "w2_packed", "w2_scale", "w2_gs", "a13_scale", "a2_scale")
    for name in names:
        getattr(m, name).copy_(getattr(a.nvfp4, name))
    with torch.no_grad():
        out = m(a.x, a.topk_ids, a.topk_weights)
        assert len(cache) == 1
        assert torch.equal(out, decode(a, a.nvfp4.weight_only()))
        assert torch.equal(m(a.x, a.topk_ids, a.topk_weights), out) and len(cache) == 1
        for name in names:
            getattr(m, name).copy_(getattr(b.nvfp4, name))
        ref = md.torch_moe_nvfp4(a.x, a.topk_ids, a.topk_weights, b.nvfp4.weight_only())
        assert rel_err(m(a.x, a.topk_ids, a.topk_weights), ref) < TOL
        m.nvfp4_mode = "w4a4"
        ref4 = md.torch_moe_nvfp4(a.x, a.topk_ids, a.topk_weights, b.nvfp4)
        assert rel_err(m(a.x, a.topk_ids, a.topk_weights), ref4) < 2e-3
    del m
    assert len(cache) == 0, "freeing the layer's tensors drops its decode layout"


def test_prepare_builds_the_layout_ahead_of_the_first_call():
    backend = build_backend("cpp", "cpu")
    cache = backend._w4a16.args[0]
    c = make_case(2, 128, 64, 4, 2, seed=49)
    w = c.nvfp4.weight_only()
    backend.prepare_nvfp4(w)
    assert len(cache) == 1
    backend.nvfp4(c.x, c.topk_ids, c.topk_weights, w)
    assert len(cache) == 1


def test_run_time_pick_follows_the_cpu_flags():
    """AUTO (and any AVX-512 request: the decode layout has no AVX-512 kernel yet) takes AVX2 wherever the
    CPU has AVX2 + FMA + F16C, which /proc/cpuinfo reports independently; SCALAR stays scalar."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo")
    has = {"avx2", "fma", "f16c"} <= set(flags)
    for request in (0, 2, 3, 4):
        assert torch.ops.namazu.nvfp4_decode_isa(request) == (AVX2 if has else SCALAR)
    assert torch.ops.namazu.nvfp4_decode_isa(SCALAR) == SCALAR


def test_the_engine_serves_an_nvfp4_checkpoint_through_the_decode_layout(tmp_path):
    """End to end: LLM(model=an NVFP4 checkpoint) on the CPU picks the cpp backend, every NVFP4 layer's
    W4A16 experts run from the decode layout (one cache entry per layer), and greedy tokens match the
    torch reference backend's."""
    from quant_fixtures import random_windows, write_model_dir

    from namazu import LLM, SamplingParams
    from namazu.quant.calibrate import calibrate, finalize
    from namazu.quant.modelopt_checkpoint import save_quantized
    from namazu.quant.nvfp4_experts import NvFP4Experts
    from namazu.quant.quantize import quantize_model
    from namazu.quant.selective import QuantPolicy

    src, ckpt = tmp_path / "bf16", tmp_path / "nvfp4"
    model = write_model_dir(str(src))
    policy = QuantPolicy.preset("experts")
    cov, lin, total = calibrate(model, random_windows(2, 32), policy, min_tokens=4, progress=False)
    quantize_model(model, policy, finalize(cov, lin, total, 4, True, False)[0])
    save_quantized(model, ckpt, policy, source_dir=src)
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for backend in ("auto", "torch"):
        with LLM(str(ckpt), executor="inline", dtype="float32", moe_backend=backend) as llm:
            served = llm.engine.executor.worker.runner.model
            tokens[backend] = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
            experts = [m for m in served.modules() if isinstance(m, NvFP4Experts)]
            if backend == "auto":
                chosen = experts[0].runtime.backend
                assert chosen.name == "cpp" and chosen.w4a16_impl == "cpp-decode"
                assert len(chosen._w4a16.args[0]) == len(experts) > 0
    assert tokens["auto"] == tokens["torch"]
