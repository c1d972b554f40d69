"""Plain torch reference of every piece of a routed-experts layer, BF16 and NVFP4.

The pieces, in the order a grouped-GEMM MoE runs them:

  dispatch      sort the N*k (token, slot) pairs by expert: order, counts [E], offsets [E+1]
  permute       gather the token rows into expert order: xs [N*k, H]
  grouped_gemm  one matmul per expert over its contiguous rows (gate_up: [m_e, H] x [2I, H]^T)
  silu_and_mul  silu(gate) * up
  grouped_gemm  down: [m_e, I] x [H, I]^T
  unpermute     scale each row by its top-k weight and sum the k rows of every token back into [N, H]

`torch_moe_bf16` and `torch_moe_nvfp4` are namazu's one plain-torch MoE reference: every faster backend
(C++ CPU, Triton, CUDA) is tested against them, and NVFP4 experts handed no backend run them. They
read expert sizes on the host (`counts.tolist()`), which is fine for a reference and for the torch
fallback backend, and they dequantize only the experts a batch touches, never a BF16 copy of all of them.

NVFP4 layout of a stacked experts tensor (ModelOpt's per-linear tensors stacked over experts):
packed uint8 [E, out, in/2] (first element in the low nibble), block scales float8_e4m3fn
[E, out, in/16], one fp32 global scale per expert [E] (gate and up share it, so w13 has one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from namazu.kernels.moe_types import NVFP4MoEWeights, sort_by_expert
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation


@dataclass
class MoEDispatch:
    """Where every (token, slot) pair goes: rows of the expert-sorted activations."""

    order: torch.Tensor     # [N*k] int64, indices into the flattened topk pairs, sorted by expert
    token: torch.Tensor     # [N*k] int64, token of each sorted row (order // k)
    counts: torch.Tensor    # [E] int64, rows per expert
    offsets: torch.Tensor   # [E+1] int64, cumulative counts: expert e owns rows offsets[e]:offsets[e+1]


def random_nvfp4_weights(num_experts: int, hidden: int, inter: int, device: torch.device | str = "cpu",
                         seed: int = 0) -> NVFP4MoEWeights:
    """Random valid NVFP4 experts without quantizing anything (fast at Kimi-K2 sizes, for benchmarks):
    uniform FP4 codes, block scales drawn from a narrow E4M3 range, global scales near 1/(6*448)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def packed(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=device)

    def scales(*shape):
        return (torch.rand(shape, generator=g, device=device) * 64 + 16).to(torch.float8_e4m3fn)

    e, h, i = num_experts, hidden, inter
    gs = torch.full((e,), 0.05 / (6 * 448), device=device)
    return NVFP4MoEWeights(packed(e, 2 * i, h // 2), scales(e, 2 * i, h // 16), gs.clone(),
                           packed(e, h, i // 2), scales(e, h, i // 16), gs.clone())


def dispatch(topk_ids: torch.Tensor, num_experts: int) -> MoEDispatch:
    """Sorts the router's choices by expert (stable, so rows of one expert keep token order)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [N, k], got shape {tuple(topk_ids.shape)}")
    order, counts, offsets = sort_by_expert(topk_ids, num_experts)
    return MoEDispatch(order=order, token=order // topk_ids.shape[1], counts=counts, offsets=offsets)


def permute(x: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
    """[N, H] -> [N*k, H] rows in expert order."""
    return x.index_select(0, d.token)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate columns first) -> [M, I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def unpermute(ys: torch.Tensor, d: MoEDispatch, topk_weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Expert-sorted rows [N*k, H] -> [N, H]: each row times its router weight, summed per token (fp32)."""
    w = topk_weights.reshape(-1).index_select(0, d.order).float().unsqueeze(-1)
    out = torch.zeros(num_tokens, ys.shape[-1], dtype=torch.float32, device=ys.device)
    return out.index_add_(0, d.token, ys.float() * w)


def grouped_gemm(xs: torch.Tensor, weight_of, counts: torch.Tensor, quantize_input=None) -> torch.Tensor:
    """y[rows of e] = xs[rows of e] @ weight_of(e).T for every expert with rows; experts without rows are
    skipped (their weights are never touched). `weight_of(e) -> [out, in]` lets NVFP4 dequantize lazily;
    `quantize_input(e, rows)` rounds an expert's input rows first (W4A4 emulation)."""
    chunks, start = [], 0
    for e, m in enumerate(counts.tolist()):
        if m:
            a = xs[start:start + m]
            if quantize_input is not None:
                a = quantize_input(e, a)
            chunks.append(a @ weight_of(e).to(xs.dtype).T)
            start += m
    if not chunks:
        return xs.new_zeros(0, 0)
    return torch.cat(chunks, 0)


def _torch_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
               w13_of, w2_of, a13_quant=None, a2_quant=None) -> torch.Tensor:
    """The reference pipeline both formats share, in fp32: dispatch, gate_up, SiLU-and-mul, down, weighted
    sum. With activation quantization (W4A4) the gate_up output and the SiLU product are rounded to x's
    dtype before the next quantization, as Blackwell MoE pipelines write them between GEMMs."""
    d = dispatch(topk_ids, num_experts)
    xs = permute(x, d).float()
    h = grouped_gemm(xs, w13_of, d.counts, a13_quant)
    if h.numel() == 0:
        return torch.zeros_like(x)
    round_between = a13_quant is not None
    if round_between:
        h = h.to(x.dtype).float()
    act = silu_and_mul(h)
    if round_between:
        act = act.to(x.dtype).float()
    ys = grouped_gemm(act, w2_of, d.counts, a2_quant)
    return unpermute(ys, d, topk_weights, x.shape[0]).to(x.dtype)


def torch_moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference MoE over BF16 stacked weights (w13 [E, 2I, H] gate rows first, w2 [E, H, I]).

    Computes in fp32 from the given values (bf16 products are exact in fp32), so a kernel's error against
    it is the kernel's own rounding; the result is cast to x's dtype once.
    """
    return _torch_moe(x, topk_ids, topk_weights, w13.shape[0], lambda e: w13[e], lambda e: w2[e])


def torch_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w: NVFP4MoEWeights) -> torch.Tensor:
    """Reference MoE over NVFP4 weights: dequantizes each touched expert to fp32 and runs fp32 GEMMs.

    W4A16 when `w.a13_scale` is None; otherwise W4A4 emulation (both GEMM inputs rounded to NVFP4 with the
    expert's calibrated input scale before each GEMM, products accumulated in fp32, rounding between the
    GEMMs as `_torch_moe` says; the C++ kernel rounds at the same points).
    """
    def dequant(packed, scale, gs):
        return lambda e: dequantize_weight(packed[e], scale[e], gs[e], dtype=torch.float32)

    a13_quant = a2_quant = None
    if w.a13_scale is not None:
        a13_quant = lambda e, a: fake_quantize_activation(a, w.a13_scale[e])  # noqa: E731
        a2_quant = lambda e, a: fake_quantize_activation(a, w.a2_scale[e])  # noqa: E731
    return _torch_moe(x, topk_ids, topk_weights, w.num_experts, dequant(w.w13_packed, w.w13_scale, w.w13_gs),
                      dequant(w.w2_packed, w.w2_scale, w.w2_gs), a13_quant, a2_quant)


@dataclass
class BlockDispatch:
    """Expert-sorted rows padded so every `block_m` rows belong to one expert: the layout grouped-GEMM
    kernels (Triton, CUDA) tile over. Built with static shapes and no host sync.

    Padded row p holds pair `sorted_pairs[p]` (a sentinel equal to N*k marks padding); row block b
    belongs to expert `block_expert[b]`; only the first `total_rows` (a device scalar) rows are used.
    """

    sorted_pairs: torch.Tensor   # [max_rows] int32
    block_expert: torch.Tensor   # [max_rows / block_m] int32
    total_rows: torch.Tensor     # [1] int32
    block_m: int
    num_pairs: int

    @property
    def max_rows(self) -> int:
        return self.sorted_pairs.shape[0]


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row count: at most min(E, pairs) experts each waste < block_m rows."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def block_dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockDispatch:
    """Sorts (token, slot) pairs by expert and pads each expert's rows to a multiple of `block_m`."""
    flat = topk_ids.reshape(-1)
    m = flat.numel()
    max_rows = max(max_padded_rows(m, num_experts, block_m), block_m)
    # Counts by scatter_add rather than bincount: bincount sizes its output from the data (a host sync).
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0) - counts
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    sorted_experts = flat[order]
    rank = torch.arange(m, device=flat.device) - offsets[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_pairs = torch.full((max_rows,), m, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp(max=num_experts - 1)
    total = padded_end[-1:].to(torch.int32)
    return BlockDispatch(sorted_pairs=sorted_pairs, block_expert=block_expert.to(torch.int32), total_rows=total,
                         block_m=block_m, num_pairs=m)
