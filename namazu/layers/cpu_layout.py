"""CPU GEMM layout: linear weights stored K-major, i.e. transposed in memory.

On x86 CPUs in fp32, `F.linear(x, W)` with W [out, in] stored row by row takes a slower path than with
the same W stored column by column (strides (1, out)), for every shape namazu-tiny has: a verify step's
7-row lm_head product (12288 x 256) takes 1.39 ms row-major and 0.58 ms K-major, one thread; its
32-row one 1.99 and 1.44 ms; the attention and MLP projections gain 20-50%. Only the storage order
changes: the weight keeps its shape [out, in] and its values, so loaders, views and every reader see the
same tensor. GPUs need none of this (cuBLAS takes either layout at full speed), and bf16 on this CPU
gains nothing, so the layout is applied to fp32 CPU weights only.

In bf16 the lm_head gets a packed copy instead (`use_packed_lm_head`; kernels/small_gemm.py `pack`): a
decode or verify step's few rows against 12288 columns ran at half the speed the products allow, the
per-column reduction of the weight's [N, K] order costing as much as the products.
"""
from __future__ import annotations

import torch
from torch import nn

from namazu.kernels import small_gemm


def k_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix with its storage transposed (a no-op where it already is)."""
    if weight.dim() != 2 or weight.stride(0) == 1:
        return weight
    return weight.t().contiguous().t()


def wants_k_major(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def use_k_major_linears(model: nn.Module) -> int:
    """Relays every fp32 CPU `nn.Linear` weight of `model` K-major, in place; returns how many.

    A weight shared with an embedding (tied word embeddings) is left row-major: an embedding lookup reads
    whole rows."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and wants_k_major(m.weight) and id(m.weight) not in embedded:
            if m.weight.stride(0) != 1:
                m.weight.data = k_major(m.weight.data)
            n += 1
    return n


def use_packed_lm_head(model: nn.Module) -> bool:
    """Packs `model.lm_head`'s weight for few-row products where the kernel applies (bf16, CPU, AVX512_BF16);
    returns whether it did. Call it once the weights are final: the copy does not follow later changes."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "packed"):
        return False
    head.packed = small_gemm.pack(head.weight.detach())
    return head.packed is not None
