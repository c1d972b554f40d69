"""Plain torch reference of every piece of a routed-experts layer, BF16 and NVFP4.

The pieces, in the order a grouped-GEMM MoE runs them:

  dispatch      sort the N*k (token, slot) pairs by expert: order, counts [E], offsets [E+1]
  permute       gather the token rows into expert order: xs [N*k, H]
  grouped_gemm  one matmul per expert over its contiguous rows (gate_up: [m_e, H] x [2I, H]^T)
  silu_and_mul  silu(gate) * up
  grouped_gemm  down: [m_e, I] x [H, I]^T
  unpermute     scale each row by its top-k weight and sum the k rows of every token back into [N, H]

Every faster backend (C++ CPU, Triton, CUDA) is tested against these functions. They read expert sizes
on the host (`counts.tolist()`), which is fine for a reference and for the torch fallback backend, and
they dequantize only the experts a batch touches, never a BF16 copy of all of them.

NVFP4 layout of a stacked experts tensor (ModelOpt's per-linear tensors stacked over experts):
packed uint8 [E, out, in/2] (first element in the low nibble), block scales float8_e4m3fn
[E, out, in/16], one fp32 global scale per expert [E] (gate and up share it, so w13 has one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from namazu.layers.experts import sort_by_expert
from namazu.quant.nvfp4 import dequantize_weight, fake_quantize_activation, input_scale_for, quantize_weight


@dataclass
class MoEDispatch:
    """Where every (token, slot) pair goes: rows of the expert-sorted activations."""

    order: torch.Tensor     # [N*k] int64, indices into the flattened topk pairs, sorted by expert
    token: torch.Tensor     # [N*k] int64, token of each sorted row (order // k)
    counts: torch.Tensor    # [E] int64, rows per expert
    offsets: torch.Tensor   # [E+1] int64, cumulative counts: expert e owns rows offsets[e]:offsets[e+1]


@dataclass
class NVFP4MoEWeights:
    """The packed weights of all routed experts of one layer, as the NVFP4 kernels consume them.

    `a13_scale` / `a2_scale` are the calibrated activation input scales ([E] fp32), present only for
    W4A4 emulation; W4A16 (Hopper's weight-only path) leaves them None.
    """

    w13_packed: torch.Tensor   # [E, 2I, H/2] uint8, gate rows then up rows
    w13_scale: torch.Tensor    # [E, 2I, H/16] float8_e4m3fn
    w13_gs: torch.Tensor       # [E] fp32 (gate and up share it)
    w2_packed: torch.Tensor    # [E, H, I/2] uint8
    w2_scale: torch.Tensor     # [E, H, I/16] float8_e4m3fn
    w2_gs: torch.Tensor        # [E] fp32
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_packed.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.w13_packed.shape[1] // 2

    def validate(self) -> None:
        """Checks shapes and dtypes against each other; raises ValueError naming the bad tensor."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        want = {
            "w13_packed": ((e, 2 * i, h // 2), torch.uint8),
            "w13_scale": ((e, 2 * i, h // 16), torch.float8_e4m3fn),
            "w13_gs": ((e,), torch.float32),
            "w2_packed": ((e, h, i // 2), torch.uint8),
            "w2_scale": ((e, h, i // 16), torch.float8_e4m3fn),
            "w2_gs": ((e,), torch.float32),
        }
        if h % 16 or i % 16:
            raise ValueError(f"NVFP4 experts need hidden ({h}) and intermediate ({i}) sizes divisible by 16")
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"NVFP4 expert tensor {name}: got {tuple(t.shape)} {t.dtype}, "
                                 f"expected {shape} {dtype}")
        if (self.a13_scale is None) != (self.a2_scale is None):
            raise ValueError("W4A4 needs both a13_scale and a2_scale (or neither for W4A16)")
        for name in ("a13_scale", "a2_scale"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != (e,) or t.dtype != torch.float32):
                raise ValueError(f"NVFP4 expert tensor {name}: got {tuple(t.shape)} {t.dtype}, expected ({e},) fp32")

    def packed_bytes_per_expert(self) -> int:
        """Bytes a kernel reads for one touched expert (packed values + block scales + global scales)."""
        total = 0
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            t = getattr(self, name)
            total += t[0].numel() * t.element_size()
        return total + 8


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, a13_amax: torch.Tensor | None = None,
                     a2_amax: torch.Tensor | None = None) -> NVFP4MoEWeights:
    """Stacked high-precision experts (w13 [E, 2I, H], w2 [E, H, I]) -> NVFP4MoEWeights, one expert at a
    time (gate and up share the global scale: the one of the whole w13[e], the max of the two).
    With calibrated input amaxes [E] the result carries W4A4 input scales."""
    parts13 = [quantize_weight(w13[e], name=f"w13[{e}]") for e in range(w13.shape[0])]
    parts2 = [quantize_weight(w2[e], name=f"w2[{e}]") for e in range(w2.shape[0])]
    p13, s13, g13 = (torch.stack(t) for t in zip(*parts13))
    p2, s2, g2 = (torch.stack(t) for t in zip(*parts2))
    w = NVFP4MoEWeights(p13, s13, g13, p2, s2, g2)
    if a13_amax is not None and a2_amax is not None:
        w.a13_scale = input_scale_for(a13_amax).to(w13.device)
        w.a2_scale = input_scale_for(a2_amax).to(w13.device)
    w.validate()
    return w


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


def grouped_gemm(xs: torch.Tensor, weight_of, counts: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = xs[rows of e] @ weight_of(e).T for every expert with rows; experts without rows are
    skipped (their weights are never touched). `weight_of(e) -> [out, in]` lets NVFP4 dequantize lazily."""
    chunks, start = [], 0
    for e, m in enumerate(counts.tolist()):
        if m:
            chunks.append(xs[start:start + m] @ weight_of(e).to(xs.dtype).T)
            start += m
    if not chunks:
        return xs.new_zeros(0, 0)
    return torch.cat(chunks, 0)


def torch_moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference MoE over BF16 stacked weights (w13 [E, 2I, H] gate rows first, w2 [E, H, I]).

    Computes in fp32 from the given values (bf16 products are exact in fp32), so a kernel's error against
    it is the kernel's own rounding; the result is cast to x's dtype once.
    """
    d = dispatch(topk_ids, w13.shape[0])
    xs = permute(x, d).float()
    h = silu_and_mul(grouped_gemm(xs, lambda e: w13[e], d.counts))
    ys = grouped_gemm(h, lambda e: w2[e], d.counts)
    if ys.numel() == 0:
        return torch.zeros_like(x)
    return unpermute(ys, d, topk_weights, x.shape[0]).to(x.dtype)


def torch_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w: NVFP4MoEWeights) -> torch.Tensor:
    """Reference MoE over NVFP4 weights: dequantizes each touched expert to fp32 and runs fp32 GEMMs.

    W4A16 when `w.a13_scale` is None; otherwise W4A4 emulation (both GEMM inputs rounded to NVFP4 with the
    expert's calibrated input scale before each GEMM, products accumulated in fp32). In W4A4 the gate_up
    output and the SiLU product are rounded to x's dtype before the next quantization, as Blackwell MoE
    pipelines write them between GEMMs (and as namazu.quant.experts.NvFP4Experts emulates them).
    """
    d = dispatch(topk_ids, w.num_experts)
    xs = permute(x, d).float()
    w4a4 = w.a13_scale is not None

    def gemm(inp, packed, scale, gs, act_scale):
        chunks, start = [], 0
        for e, m in enumerate(d.counts.tolist()):
            if m:
                a = inp[start:start + m]
                if w4a4:
                    a = fake_quantize_activation(a, act_scale[e])
                chunks.append(a @ dequantize_weight(packed[e], scale[e], gs[e], dtype=torch.float32).T)
                start += m
        return torch.cat(chunks, 0) if chunks else inp.new_zeros(0, 0)

    h = gemm(xs, w.w13_packed, w.w13_scale, w.w13_gs, w.a13_scale)
    if h.numel() == 0:
        return torch.zeros_like(x)
    if w4a4:
        h = h.to(x.dtype).float()
    act = silu_and_mul(h)
    if w4a4:
        act = act.to(x.dtype).float()
    ys = gemm(act, w.w2_packed, w.w2_scale, w.w2_gs, w.a2_scale)
    return unpermute(ys, d, topk_weights, x.shape[0]).to(x.dtype)


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
