"""bf16 products of the few rows a decode or verify step has, on CPUs with AVX512_BF16.

torch's bf16 matmul on the CPU goes through oneDNN: its kernel runs namazu-tiny's 1 x 256 x 128 product in
about 3 us, but each call spends about 20-30 us more setting it up, where fp32's MKL call costs about 8 us in
all. A decode step makes ~50 such calls (each compiled graph calls them as extern kernels too), so a bf16
step was slower than an fp32 one although its weights are half the bytes (bench/RESULTS.md, "bf16 on CPU
against fp32"). `namazu::small_bmm_bf16` (csrc/cpu/small_gemm_bf16.cpp) is a plain loop of AVX512_BF16 dot
products with fp32 accumulation and one rounding to bf16, as oneDNN's result is rounded; it is used for
at most `MAX_ROWS` rows, where it measured faster than oneDNN at every shape of namazu-tiny. Wider
products (prefill, a batch's verify rows) keep oneDNN, whose set-up they amortise.

Its one wide product, the lm_head (12288 x 256 for namazu-tiny; the drafter's head over its draft vocabulary
too), runs on a copy of the weight packed for it once at load (`pack`, `packed_linear`:
csrc/cpu/packed_gemm_bf16.cpp), 16 columns per vector with no per-column reduction: a 7-row verify's lm_head
0.21 ms against 0.36 in cache, 0.46 against 0.62 from memory; it takes products of 5 to 8 rows (bench/RESULTS.md,
"The lm_head on a packed weight").

NAMAZU_SMALL_GEMM=0 turns it off (the A/B in bench/small_gemm.py). On CPUs without AVX512_BF16, without the
extension, on GPUs and in fp32 every call is torch's own.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

MAX_ROWS = 8
# The packed lm_head from this many rows on: with fewer, a product whose weight comes from memory (the lm_head
# of a step, after the layers) ran 0.81-0.90x the dot-product block's speed, though faster in cache
# (bench/small_gemm.py); from 5 rows on it is faster either way (7 rows: 1.35x from memory, 1.73x in cache).
PACKED_MIN_ROWS = 5
# The most (token, slot) pairs a MoE runs through small_moe_bf16: decode and verify steps, eager or compiled.
MAX_MOE_PAIRS = 128


def _available() -> bool:
    if os.environ.get("NAMAZU_SMALL_GEMM", "1") == "0":
        return False
    try:
        import namazu._nvfp4_cpu  # noqa: F401 -- registers torch.ops.namazu.small_bmm_bf16
    except ImportError:
        return False
    return bool(torch.ops.namazu.small_gemm_bf16_supported())


ENABLED = _available()

if ENABLED:
    @torch.library.register_fake("namazu::small_bmm_bf16")
    def _small_bmm_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], x.shape[1], w.shape[1])

    @torch.library.register_fake("namazu::packed_linear_bf16")
    def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("namazu::small_moe_bf16")
    def _small_moe_fake(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return x.new_empty(topk_ids.numel(), x.shape[1])


def applies(x: torch.Tensor, w: torch.Tensor, rows: int) -> bool:
    return (ENABLED and rows <= MAX_ROWS and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.device.type == "cpu" and w.stride(-1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))   # no backward


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for w [N, K]."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not applies(x, w, rows) or w.dim() != 2 or rows == 0:
        return F.linear(x, w, bias)
    y = torch.ops.namazu.small_bmm_bf16(x.reshape(1, rows, k).contiguous(), w.unsqueeze(0))
    y = y.view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] packed for `packed_linear` (a copy: w must not change after), or None where the kernel does not
    apply (fp32, GPU, no AVX512_BF16)."""
    if not (ENABLED and w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu"):
        return None
    with torch.no_grad():
        return torch.ops.namazu.pack_bf16_weight(w)


def packed_linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w) for w [N, K], through `packed` (`pack(w)`) for PACKED_MIN_ROWS to MAX_ROWS rows, else
    `linear`."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if packed is None or rows < PACKED_MIN_ROWS or not applies(x, w, rows):
        return linear(x, w)
    y = torch.ops.namazu.packed_linear_bf16(x.reshape(rows, k).contiguous(), packed, w.shape[0])
    return y.view(*x.shape[:-1], w.shape[0])


def bmm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, M, K] @ w[B, N, K]^T -> [B, M, N] (torch.bmm(x, w.transpose(1, 2)))."""
    if not applies(x, w, x.shape[1]):
        return torch.bmm(x, w.transpose(1, 2))
    return torch.ops.namazu.small_bmm_bf16(x if x.stride(-1) == 1 else x.contiguous(), w)


def moe_pairs(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor | None:
    """Each (token, slot) pair's expert output [N * k, H] (csrc/cpu/small_moe_bf16_op.cpp: pairs grouped by
    expert, each expert read once), or None where the kernel does not apply (then the caller's own path)."""
    if not (applies(x, w13, 1) and applies(x, w2, 1) and moe_applies(w13.dtype, topk_ids.device, topk_ids.numel())):
        return None
    return torch.ops.namazu.small_moe_bf16(x, topk_ids, w13, w2)


def moe_applies(dtype: torch.dtype, device: torch.device, num_pairs: int) -> bool:
    """Whether a MoE of `num_pairs` pairs in `dtype` on `device` runs through small_moe_bf16 (graph mode then
    allocates no grouped-GEMM workspace for it)."""
    return ENABLED and dtype == torch.bfloat16 and device.type == "cpu" and num_pairs <= MAX_MOE_PAIRS
