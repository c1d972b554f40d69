"""The Blackwell (sm_100a) NVFP4 W4A4 routed experts: namazu/csrc/nvfp4_moe_sm100.cu through cuda-python.

  compile_sm100_cubin   nvcc -cubin for sm_100a (cached by the sources' hash); needs only the toolkit
  Sm100Args, QuantArgs  the C structs of nvfp4_moe_sm100.h, byte for byte (ctypes)
  gemm_grid, quant_grid the launch shapes
  CubinSm100            the cubin's three kernels in torch's context; `moe` runs one layer:
                        block_dispatch (128-row blocks), quantize x per row with its expert's input scale,
                        gate_up (SiLU-and-mul fused, bf16 intermediate), quantize the intermediate with the
                        expert's second input scale, down (router weight fused), torch sums each token's k rows
  check_sm100           the device check against torch_moe_nvfp4's W4A4 emulation (bench/tune_cuda_moe.py
                        records it; the backend selects the kernel only where it passed, see cuda_decode)

Only W4A4: the block-scaled MMA multiplies FP4 by FP4 (docs/kernels.md, Blackwell). No host sync anywhere in
`moe`: every size it needs is known from the shapes, so it is CUDA-graph capturable.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from namazu.kernels import cubin_loader as cl
from namazu.kernels import cuda_decode as cd
from namazu.kernels.moe_dispatch import block_dispatch
from namazu.kernels.moe_types import NVFP4MoEWeights

BM = 128            # NVFP4_SM100_BM
BN = 128            # NVFP4_SM100_BN
BK = 128            # NVFP4_SM100_BK
THREADS = 128       # NVFP4_SM100_THREADS
QUANT_THREADS = 128
MAX_QUANT_CTAS = 4096
QUANT = "nvfp4_sm100_quant_act"
KERNELS = (QUANT, *(v.kernel(gu) for v in cd.SM100_VARIANTS for gu in (True, False)))


class Sm100Args(ctypes.Structure):
    """Nvfp4Sm100Args (nvfp4_moe_sm100.h): ten pointers, four int64."""

    _fields_ = [("a_codes", ctypes.c_void_p), ("a_scale", ctypes.c_void_p), ("sorted_pairs", ctypes.c_void_p),
                ("block_expert", ctypes.c_void_p), ("total_rows", ctypes.c_void_p), ("w_packed", ctypes.c_void_p),
                ("w_scale", ctypes.c_void_p), ("alpha", ctypes.c_void_p), ("topk_weights", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("max_rows", ctypes.c_int64), ("num_pairs", ctypes.c_int64),
                ("k_dim", ctypes.c_int64), ("n_out", ctypes.c_int64)]


class QuantArgs(ctypes.Structure):
    """Nvfp4Sm100QuantArgs (nvfp4_moe_sm100.h): seven pointers, four int64."""

    _fields_ = [("src", ctypes.c_void_p), ("sorted_pairs", ctypes.c_void_p), ("block_expert", ctypes.c_void_p),
                ("total_rows", ctypes.c_void_p), ("input_scale", ctypes.c_void_p), ("codes", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("max_rows", ctypes.c_int64), ("num_pairs", ctypes.c_int64),
                ("k_dim", ctypes.c_int64), ("a_div", ctypes.c_int64)]


def compile_sm100_cubin(cache_dir: str | Path | None = None, nvcc: str | None = None) -> Path:
    return cl.compile_cubin(cache_dir, nvcc, sources=cd.SM100_SOURCES, arch=cd.SM100_ARCH)


def cols_per_cta(gate_up: bool) -> int:
    """Output columns of one CTA (nvfp4_sm100_cols_per_cta): gate_up pairs 64 gate with 64 up rows."""
    return BN // 2 if gate_up else BN


def gemm_grid(max_rows: int, n_out: int, gate_up: bool) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block): one CTA per 128-row block x output tile; blocks past total_rows return at once."""
    if max_rows % BM or n_out % cols_per_cta(gate_up):
        raise ValueError(f"max_rows {max_rows} must be a multiple of {BM} and n_out {n_out} of "
                         f"{cols_per_cta(gate_up)}")
    return (max_rows // BM, n_out // cols_per_cta(gate_up), 1), (THREADS, 1, 1)


def quant_grid(max_rows: int, k_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of the quantizer: one thread per 16-value block, grid-stride past MAX_QUANT_CTAS."""
    blocks = max_rows * (k_dim // 16)
    return (max(1, min(-(-blocks // QUANT_THREADS), MAX_QUANT_CTAS)), 1, 1), (QUANT_THREADS, 1, 1)


def check_shapes(w: NVFP4MoEWeights) -> None:
    if w.a13_scale is None or w.a2_scale is None:
        raise ValueError("the Blackwell NVFP4 kernel is W4A4: it needs the experts' calibrated input scales")
    if w.hidden_size % BK or w.intermediate_size % BK:
        raise ValueError(f"the Blackwell NVFP4 kernel needs hidden ({w.hidden_size}) and intermediate "
                         f"({w.intermediate_size}) sizes divisible by {BK}")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Outputs and scratch (a seam for tests that poison them to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


class CubinSm100(cd._Cubin):
    """The sm_100a cubin's kernels; `moe` is the routed-experts layer (W4A4)."""

    def __init__(self, cubin: str | Path | None = None):
        super().__init__(Path(cubin or compile_sm100_cubin()).read_bytes(), set(KERNELS), "Blackwell")

    def quantize(self, src: torch.Tensor, bd, input_scale: torch.Tensor, a_div: int):
        """NVFP4 codes [max_rows, K/2] and E4M3 scale bytes [max_rows, K/16] of src's rows in bd's order."""
        k = src.shape[1]
        codes = _empty((bd.max_rows, k // 2), torch.uint8, src.device)
        scale = _empty((bd.max_rows, k // 16), torch.uint8, src.device)
        args = QuantArgs(src=src.data_ptr(), sorted_pairs=bd.sorted_pairs.data_ptr(),
                         block_expert=bd.block_expert.data_ptr(), total_rows=bd.total_rows.data_ptr(),
                         input_scale=input_scale.data_ptr(), codes=codes.data_ptr(), scale=scale.data_ptr(),
                         max_rows=bd.max_rows, num_pairs=bd.num_pairs, k_dim=k, a_div=a_div)
        self._launch(QUANT, *quant_grid(bd.max_rows, k), args)
        return codes, scale

    def _gemm(self, v: cd.Sm100Variant, a, bd, packed, scale, alpha, tw, out, gate_up: bool) -> None:
        codes, sf = a
        n_out = out.shape[1]
        args = Sm100Args(a_codes=codes.data_ptr(), a_scale=sf.data_ptr(), sorted_pairs=bd.sorted_pairs.data_ptr(),
                         block_expert=bd.block_expert.data_ptr(), total_rows=bd.total_rows.data_ptr(),
                         w_packed=packed.data_ptr(), w_scale=scale.data_ptr(), alpha=alpha.data_ptr(),
                         topk_weights=tw.data_ptr() if tw is not None else None, out=out.data_ptr(),
                         max_rows=bd.max_rows, num_pairs=bd.num_pairs, k_dim=codes.shape[1] * 2, n_out=n_out)
        self._launch(v.kernel(gate_up), *gemm_grid(bd.max_rows, n_out, gate_up), args)

    def moe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
            v: cd.Sm100Variant = cd.SM100_VARIANTS[0]) -> torch.Tensor:
        """[N, H] in x's dtype; five launches (two quantizations, two GEMMs, the k-row sum), no host sync."""
        check_shapes(w)
        n, hidden = x.shape
        if n == 0:
            return torch.zeros_like(x)
        top_k, inter = topk_ids.shape[1], w.intermediate_size
        xb = x.to(torch.bfloat16).contiguous()
        bd = block_dispatch(topk_ids, w.num_experts, BM)
        s13, s2 = w.a13_scale.float().contiguous(), w.a2_scale.float().contiguous()
        alpha13 = (s13 * w.w13_gs.float()).contiguous()
        alpha2 = (s2 * w.w2_gs.float()).contiguous()
        a13 = self.quantize(xb, bd, s13, top_k)
        act = _empty((bd.max_rows, inter), torch.bfloat16, x.device)
        self._gemm(v, a13, bd, w.w13_packed.contiguous(), w.w13_scale.contiguous().view(torch.uint8), alpha13, None,
                   act, True)
        a2 = self.quantize(act, bd, s2, 0)
        pair_out = _empty((n * top_k, hidden), torch.float32, x.device)
        tw = topk_weights.reshape(-1).float().contiguous()
        self._gemm(v, a2, bd, w.w2_packed.contiguous(), w.w2_scale.contiguous().view(torch.uint8), alpha2, tw,
                   pair_out, False)
        # Freeing the temporaries while the launches are queued is safe: the caching allocator hands their
        # memory only to work queued later on the same stream.
        return pair_out.view(n, top_k, hidden).sum(1).to(x.dtype)


_LOADED: dict[str, CubinSm100] = {}


def sm100_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w: NVFP4MoEWeights,
                    v: cd.Sm100Variant) -> torch.Tensor:
    """The routed experts on the Blackwell kernel variant `v` (the cubin loaded once per process)."""
    if "k" not in _LOADED:
        _LOADED["k"] = CubinSm100()
    return _LOADED["k"].moe(x, topk_ids, topk_weights, w, v)


# ---- the device check (bench/tune_cuda_moe.py) -----------------------------------------------------------

# (tokens, hidden, inter, experts, top_k, experts receiving tokens): one and several 128-row blocks per
# expert, ragged last blocks, idle experts, K of 2 to 8 stages (both buffers, several phases of each barrier).
CHECK_CASES = ((1, 256, 128, 8, 2, None), (37, 512, 256, 16, 4, 5), (300, 1024, 384, 8, 8, None))


def check_quantize(kernels: CubinSm100, device: str = "cuda") -> int:
    """Mismatching bytes of the activation quantizer against namazu.quant.nvfp4.quantize_activation
    (codes and scales, every row in block order; padding rows must be zero)."""
    from namazu.kernels import moe_dispatch as md
    from namazu.quant.nvfp4 import pack_nibbles, quantize_activation

    g = torch.Generator(device=device).manual_seed(7)
    n, h, e, k = 40, 512, 8, 2
    x = (torch.randn(n, h, generator=g, device=device) * torch.rand(n, 1, generator=g, device=device) * 8)
    x = x.to(torch.bfloat16)
    ids = torch.rand(n, e, generator=g, device=device).topk(k, dim=1).indices
    scale = torch.rand(e, generator=g, device=device) * 1e-2 + 1e-3
    bd = md.block_dispatch(ids, e, BM)
    codes, sf = kernels.quantize(x, bd, scale, k)
    rows = bd.sorted_pairs.long()
    real = (rows < bd.num_pairs) & (torch.arange(bd.max_rows, device=device) < bd.total_rows)
    src = x[(rows.clamp(max=bd.num_pairs - 1) // k)].float()
    ref_c, ref_s = quantize_activation(src, scale[bd.block_expert.long().repeat_interleave(BM)])
    ref_c = torch.where(real[:, None], pack_nibbles(ref_c), 0)
    ref_s = torch.where(real[:, None], ref_s.view(torch.uint8), 0)
    return int((codes != ref_c).sum() + (sf != ref_s).sum())


def check_sm100(kernels: CubinSm100, v: cd.Sm100Variant, device: str = "cuda") -> float:
    """The largest relative error of `v` against torch_moe_nvfp4 (W4A4) over CHECK_CASES (inf if non-finite
    or if the quantizer differs from the reference in a single byte)."""
    from namazu.kernels import moe_dispatch as md

    if check_quantize(kernels, device):
        return float("inf")
    worst = 0.0
    for i, (n, h, inter, e, k, used) in enumerate(CHECK_CASES):
        g = torch.Generator(device=device).manual_seed(3000 + i)
        w = md.random_nvfp4_weights(e, h, inter, device=device, seed=4000 + i)
        w = w4a4_weights(w, g)
        x = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
        ids = torch.rand(n, used or e, generator=g, device=device).topk(k, dim=1).indices
        tw = torch.rand(n, k, generator=g, device=device) + 0.1
        out = kernels.moe(x, ids, tw, w, v).float()
        ref = md.torch_moe_nvfp4(x, ids, tw, w).float()
        if not torch.isfinite(out).all():
            return float("inf")
        worst = max(worst, float((out - ref).norm() / ref.norm().clamp_min(1e-12)))
    return worst


def w4a4_weights(w: NVFP4MoEWeights, g: torch.Generator) -> NVFP4MoEWeights:
    """`w` with per-expert input scales of the size calibration gives unit-variance inputs (amax ~4-5 for
    x, ~1 for the intermediate, over 6 * 448), spread so experts differ."""
    import dataclasses

    e, dev = w.num_experts, w.w13_packed.device
    s13 = (4.5 + torch.rand(e, generator=g, device=dev)) / (6 * 448)
    s2 = (0.5 + torch.rand(e, generator=g, device=dev)) / (6 * 448)
    return dataclasses.replace(w, a13_scale=s13.float(), a2_scale=s2.float())


def _dequant_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, K] of NVFP4 codes [rows, K/2] (low nibble first) and E4M3 scale bytes [rows, K/16]."""
    from namazu.quant.nvfp4 import e2m1_decode, unpack_nibbles

    sf = scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)
    return e2m1_decode(unpack_nibbles(codes)) * sf


def gemm_errors(kernels: CubinSm100, v: cd.Sm100Variant, uniform: bool = False, device: str = "cuda") -> dict:
    """Each GEMM alone against a dequantized product of the very codes it was given (the quantizer's own
    output), for diagnosing a failing check on the device: `gate_up` (bf16 SiLU-and-mul rows) and `down`
    (fp32 rows per pair). With `uniform`, every weight scale is 1 and x is +-1 (so every activation scale of
    the gate_up input is equal, padding rows' included): a gate_up right there but wrong with random scales
    reads the scale words from the wrong place; wrong even there, the descriptors, the pipeline or the
    accumulator readout (down's input scales still vary)."""
    from namazu.kernels import moe_dispatch as md

    g = torch.Generator(device=device).manual_seed(11)
    n, h, inter, e, k = 37, 512, 256, 4, 2
    w = md.random_nvfp4_weights(e, h, inter, device=device, seed=12)
    x = torch.randn(n, h, generator=g, device=device)
    if uniform:
        w.w13_scale.view(torch.uint8).fill_(0x38)   # E4M3 1.0
        w.w2_scale.view(torch.uint8).fill_(0x38)
        x = torch.where(x < 0, -1.0, 1.0)
    w = w4a4_weights(w, g)
    if uniform:   # one input scale for every expert, so every real row's block scales are the same byte
        w.a13_scale = w.a13_scale[:1].expand(e).contiguous()
    ids = torch.rand(n, e, generator=g, device=device).topk(k, dim=1).indices
    tw = torch.rand(n, k, generator=g, device=device) + 0.1
    bd = block_dispatch(ids, e, BM)
    s13, s2 = w.a13_scale.float(), w.a2_scale.float()
    a13 = kernels.quantize(x.to(torch.bfloat16).contiguous(), bd, s13, k)
    if uniform:   # padding rows (zero codes) get that byte too: no scale word differs from another
        a13[1].fill_(int(a13[1].max()))
    act = torch.zeros(bd.max_rows, inter, dtype=torch.bfloat16, device=device)
    u8 = torch.uint8
    kernels._gemm(v, a13, bd, w.w13_packed, w.w13_scale.view(u8), (s13 * w.w13_gs).contiguous(), None, act, True)
    a2 = kernels.quantize(act, bd, s2, 0)
    out = torch.zeros(bd.num_pairs, h, dtype=torch.float32, device=device)
    tw_flat = tw.reshape(-1).float().contiguous()
    kernels._gemm(v, a2, bd, w.w2_packed, w.w2_scale.view(u8), (s2 * w.w2_gs).contiguous(), tw_flat, out, False)
    rows = torch.nonzero(bd.sorted_pairs < bd.num_pairs).flatten()
    rows = rows[rows < bd.total_rows]
    expert = bd.block_expert.long()[rows // BM]
    pair = bd.sorted_pairs.long()[rows]
    ref_act, ref_out = torch.empty(len(rows), inter, device=device), torch.empty(len(rows), h, device=device)
    for ex in expert.unique().tolist():
        m = expert == ex
        w13 = _dequant_rows(w.w13_packed[ex], w.w13_scale[ex].view(u8)) * w.w13_gs[ex]
        hh = (_dequant_rows(*(t[rows[m]] for t in a13)) * s13[ex]) @ w13.T
        hh = hh.to(torch.bfloat16).float()
        ref_act[m] = (torch.nn.functional.silu(hh[:, :inter]) * hh[:, inter:]).to(torch.bfloat16).float()
        w2 = _dequant_rows(w.w2_packed[ex], w.w2_scale[ex].view(u8)) * w.w2_gs[ex]
        ref_out[m] = ((_dequant_rows(*(t[rows[m]] for t in a2)) * s2[ex]) @ w2.T) * tw_flat[pair[m], None]

    def rel(got, ref):
        return float((got.float() - ref).norm() / ref.norm().clamp_min(1e-12)) if torch.isfinite(got).all() \
            else float("inf")
    return {"gate_up": rel(act[rows], ref_act), "down": rel(out[pair], ref_out)}
