"""The routed-experts layer on the Hopper NVFP4 grouped GEMM of namazu/csrc (W4A16, bf16 activations).

Two launches over the block-padded expert order (block_m 16): gate_up with SiLU-and-mul fused into
the epilogue, then down scaled by the router weights; torch sums each token's k rows. No host sync.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from namazu.kernels.moe_dispatch import block_dispatch
from namazu.kernels.moe_types import NVFP4MoEWeights

BLOCK_M = 16   # NVFP4_GEMM_BLOCK_M in nvfp4_grouped_gemm.h
K_ALIGN = 128  # NVFP4_GEMM_K_ALIGN


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch and output buffers (a seam for tests that poison them to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def load_extension() -> None:
    """Imports the compiled extension (registers torch.ops.namazu.nvfp4_grouped_gemm_cuda)."""
    import namazu._nvfp4_cuda  # noqa: F401


def cuda_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w: NVFP4MoEWeights, gemm: Callable | None = None, block_m: int = BLOCK_M) -> torch.Tensor:
    """`gemm(a, sorted_pairs, block_expert, total_rows, w_packed, w_scale, w_gs, topk_weights, out, num_pairs,
    top_k, gate_up)` launches one grouped GEMM: the torch extension's op by default, or the cubin loaded
    through cuda-python (kernels/cubin_loader.py, `cubin_moe_nvfp4`), or the large-batch kernels of the
    same contract with row blocks of `block_m` (kernels/cuda_decode.py, `prefill_moe_nvfp4`)."""
    if w.a13_scale is not None:
        raise ValueError("the CUDA NVFP4 kernel is weight-only (W4A16); W4A4 emulation runs on torch or cpp")
    if w.hidden_size % K_ALIGN or w.intermediate_size % K_ALIGN:
        raise ValueError(f"the CUDA NVFP4 kernel needs hidden ({w.hidden_size}) and intermediate "
                         f"({w.intermediate_size}) sizes divisible by {K_ALIGN}")
    if gemm is None:
        load_extension()
        gemm = torch.ops.namazu.nvfp4_grouped_gemm_cuda
    n, hidden = x.shape
    top_k = topk_ids.shape[1]
    xb = x.to(torch.bfloat16).contiguous()
    bd = block_dispatch(topk_ids, w.num_experts, block_m)
    inter = _empty((bd.max_rows, w.intermediate_size), torch.bfloat16, x.device)
    gemm(xb, bd.sorted_pairs, bd.block_expert, bd.total_rows, w.w13_packed.contiguous(), w.w13_scale.contiguous(),
         w.w13_gs.float().contiguous(), None, inter, bd.num_pairs, top_k, True)
    pair_out = _empty((n * top_k, hidden), torch.float32, x.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    gemm(inter, bd.sorted_pairs, bd.block_expert, bd.total_rows, w.w2_packed.contiguous(), w.w2_scale.contiguous(),
         w.w2_gs.float().contiguous(), tw, pair_out, bd.num_pairs, top_k, False)
    return pair_out.view(n, top_k, hidden).sum(1).to(x.dtype)
