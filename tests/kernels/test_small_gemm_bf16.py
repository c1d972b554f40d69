"""namazu::small_bmm_bf16 (csrc/cpu/small_gemm_bf16.cpp, routed by kernels/small_gemm.py) against an fp32
oracle: every shape class the kernel branches on (k below, at and past a 32-wide step, past the 256 it
keeps in registers; rows up to its 8-row block and past it; batched heads with strided rows), the rounding
rule (nearest even, as torch's own conversion), NaN, torch.compile, and that a bf16 model's decode step
really calls it. Results are compared within bf16 rounding, never bit for bit against oneDNN: the two sum
in different orders."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from namazu.kernels import small_gemm

needs_kernel = pytest.mark.skipif(not small_gemm.ENABLED, reason="no AVX512_BF16 on this CPU (or no extension)")


def _oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.double(), w.double().transpose(1, 2))


def _check(y: torch.Tensor, ref: torch.Tensor, k: int, roundings: int = 1) -> None:
    # a bf16 rounding of the result (two with a bias added after it) plus fp32 accumulation error over k
    # terms of bf16 products
    bound = ref.abs() * roundings * 2.0 ** -8 + 1e-6 * k * (1 + ref.abs().max())
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("k", [1, 31, 32, 33, 100, 256, 300, 520])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 11])
def test_every_k_and_row_count_against_the_oracle(k, m):
    g = torch.Generator().manual_seed(k * 100 + m)
    for b, n in ((1, 37), (3, 16)):
        x = torch.randn(b, m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(b, n, k, generator=g).to(torch.bfloat16)
        _check(torch.ops.namazu.small_bmm_bf16(x, w), _oracle(x, w), k)


@needs_kernel
def test_strided_heads_as_absorbed_attention_passes_them():
    """absorb_out hands the kernel o_lat [N, H, r] transposed to [H, N, r] (rows H*r apart) and w_uv, a view
    of kv_b's weight [H, dn + dv, r] (heads (dn + dv) * r apart)."""
    g = torch.Generator().manual_seed(3)
    o_lat = torch.randn(5, 4, 64, generator=g).to(torch.bfloat16)
    kv_b = torch.randn(4, 32 + 48, 64, generator=g).to(torch.bfloat16)
    w_uv = kv_b[:, 32:]
    y = small_gemm.bmm_nt(o_lat.transpose(0, 1), w_uv).transpose(0, 1)
    ref = torch.einsum("nhr,hvr->nhv", o_lat.double(), w_uv.double())
    _check(y, ref, 64)


@needs_kernel
def test_rounds_to_nearest_even():
    """Sums exact in fp32 that fall halfway between two bf16 values: 1 + 2^-8 rounds down to 1 (even),
    1 + 2^-7 + 2^-8 up to 1 + 2^-6; truncation would give 1 and 1 + 2^-7."""
    x = torch.ones(1, 1, 2, dtype=torch.bfloat16)
    w = torch.tensor([[[1.0, 2.0 ** -8], [1.0 + 2.0 ** -7, 2.0 ** -8], [-1.0, -(2.0 ** -8)]]], dtype=torch.bfloat16)
    y = torch.ops.namazu.small_bmm_bf16(x, w)[0, 0].float().tolist()
    assert y == [1.0, 1.0 + 2.0 ** -6, -1.0]
    nan = torch.ops.namazu.small_bmm_bf16(torch.full((1, 1, 2), float("nan"), dtype=torch.bfloat16), w)
    assert nan.isnan().all()


@needs_kernel
def test_linear_routes_few_rows_and_compiles():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for rows in (1, 7, small_gemm.MAX_ROWS, small_gemm.MAX_ROWS + 1, 40):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        ref = F.linear(x.double(), w.double(), b.double())
        _check(small_gemm.linear(x, w, b), ref, 256, roundings=2)
    x = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)       # leading dims flattened to 6 rows
    compiled = torch.compile(lambda t: small_gemm.linear(t, w, b), fullgraph=True)
    # the same extern kernel; the bias add is inductor's own loop, so one bf16 rounding may differ
    torch.testing.assert_close(compiled(x), small_gemm.linear(x, w, b), rtol=2 ** -7, atol=1e-2)
    assert small_gemm.applies(x, w, 6) and not small_gemm.applies(x, w, small_gemm.MAX_ROWS + 1)
    assert not small_gemm.applies(x.float(), w.float(), 1)
    wg = w.clone().requires_grad_(True)                               # training keeps autograd's path
    assert not small_gemm.applies(x, wg, 1)


@needs_kernel
def test_a_bf16_decode_step_calls_the_kernel():
    from namazu import LLM, SamplingParams
    llm = LLM(None, dtype="bfloat16", enforce_eager=True, num_speculative_tokens=0, executor="inline", threads=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(["日本の首都は"], params, use_tqdm=False)
    calls = sum(e.count for e in prof.key_averages() if e.key == "namazu::small_bmm_bf16")
    # per decode step: every attention / MLP projection of the 4 layers, absorb_out, the lm_head
    assert calls >= 2 * 20, calls


@needs_kernel
def test_the_drafters_block_makes_no_onednn_product():
    """The shipped drafter in bf16, as a drafted step runs it for one sequence (the context write of 7 verify
    rows, one block, the selector's tables, the draft-vocabulary head): every product of its few rows is
    the kernel's. Each oneDNN call costs ~50 us of set-up; a compiled tail made seven of them a step."""
    from namazu.assets import default_model_path
    from namazu.config import ModelConfig
    from namazu.spec.dflash import DFlashDrafter
    from namazu.spec.selection import SHIPPED_DRAFTER_DIR

    t = ModelConfig.from_pretrained(default_model_path())
    model = DFlashDrafter.load(default_model_path() / SHIPPED_DRAFTER_DIR, t.vocab_size, t.hidden_size,
                               t.num_hidden_layers).to(torch.bfloat16)
    model.fuse_for_serving()
    cfg, g = model.cfg, torch.Generator().manual_seed(9)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(torch.bfloat16)
    head = torch.randn(cfg.draft_vocab_size or cfg.vocab_size, cfg.hidden_size, generator=g).to(torch.bfloat16)
    hidden = [torch.randn(7, cfg.hidden_size, generator=g).to(torch.bfloat16) for _ in cfg.target_layers]
    k = cfg.block_size - 1
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        keys, values = model.context_kv_all(model.fuse(hidden), torch.arange(7) + 20)
        ctx = [(keys[i].transpose(0, 1).unsqueeze(0), values[i].transpose(0, 1).unsqueeze(0))
               for i in range(cfg.num_layers)]
        anchor, anchor_pos = torch.tensor([5]), torch.tensor([27])
        h = model.forward_blocks(anchor, anchor_pos, ctx, torch.arange(7).unsqueeze(0) + 20 < 27, embed)[:, :k]
        model.selector_tables(anchor, h, small_gemm.linear(h, head), k)
    names = [e.key for e in prof.key_averages()]
    assert not {"aten::linear", "aten::addmm", "aten::mm"} & set(names), names
    assert sum(e.count for e in prof.key_averages() if e.key == "namazu::small_bmm_bf16") >= 8


def test_without_the_kernel_every_call_is_torchs(monkeypatch):
    monkeypatch.setattr(small_gemm, "ENABLED", False)
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    assert torch.equal(small_gemm.linear(x, w), F.linear(x, w))
    xb, wb = x.unsqueeze(0), w.unsqueeze(0)
    assert torch.equal(small_gemm.bmm_nt(xb, wb), torch.bmm(xb, wb.transpose(1, 2)))


@needs_kernel
def test_bf16_cached_decode_through_the_kernel_tracks_fp32(tmp_path, monkeypatch):
    """Token-by-token decode (2 rows a step: every projection, absorb_q / absorb_out and the lm_head through
    the kernel) of a bf16 model stays as close to the fp32 model's logits as torch's own bf16 path does."""
    from namazu.models.kv_cache import ContiguousLatentCache, forward_with_cache
    from namazu.models.loader import load_model

    from hf_oracle import make_hf_checkpoint

    make_hf_checkpoint(tmp_path, seed=2)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))

    def decode(dtype: str) -> torch.Tensor:
        model = load_model(tmp_path, dtype=dtype, progress=False)
        cache = ContiguousLatentCache(model.config, batch=2, max_len=20, dtype=getattr(torch, dtype))
        with torch.no_grad():
            parts = [forward_with_cache(model, ids[:, :4], cache)]
            parts += [forward_with_cache(model, ids[:, t:t + 1], cache) for t in range(4, 16)]
        return torch.cat(parts, 1).float()

    ref = decode("float32")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours = decode("bfloat16")
    assert sum(e.count for e in prof.key_averages() if e.key == "namazu::small_bmm_bf16") > 12 * 10
    monkeypatch.setattr(small_gemm, "ENABLED", False)
    torchs = decode("bfloat16")
    err_ours, err_torch = (ours - ref).abs().max().item(), (torchs - ref).abs().max().item()
    assert err_ours < 1.5 * err_torch + 0.01, (err_ours, err_torch)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
