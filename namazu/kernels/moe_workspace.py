"""Workspaces of the routed experts' grouped-GEMM path, one per graph-mode ladder entry.

Every step of a ladder entry has the same number of tokens, so the MoE runner's dispatch metadata (the
sort of the (token, slot) pairs by expert, the counts per expert, each sorted row's token) and its
activations between the GEMMs have fixed shapes. `StepGraphs` builds one `MoEWorkspace` per entry at
start-up; while the entry's forward is traced, `active_workspace()` hands it to the experts, whose
`namazu::moe_grouped_mm_ws` op writes every intermediate and the result into it, so a graph-mode step
allocates nothing in the MoE runner. The layers run one after another, so they share one workspace (a
layer's result is read by its block before the next layer's op overwrites it; the op declares the
mutation, so the compiler orders the two). Entries whose pairs would read few bytes more gathered (`gathers_in_graph`)
trace the experts into the compiled graph instead and need no workspace.

`moe_grouped_mm_into` computes what `graph_ops.moe_grouped_mm_eager` computes, bit for bit (same
GEMMs per expert on the same slices, same fp32 weighted sum), so the MoE is not what makes graph mode's
logits differ from eager's (the ladder padding, the traced attention and gathered experts do, to
rounding: docs/engine.md, "What is bit-identical, and where").
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class MoEWorkspace:
    """Buffers for N tokens with k experts each (P = N * k pairs), E experts, hidden H, intermediate I."""

    pair_ids: torch.Tensor     # [P] int64 constant: 0, 1, ..., P - 1
    pair_token: torch.Tensor   # [P] int64 constant: the token of each pair (p // k)
    ones: torch.Tensor         # [P] int64 constant 1
    counts: torch.Tensor       # [E] int64: rows per expert
    starts: torch.Tensor       # [E] int64: first row of each expert
    onehot: torch.Tensor       # [P, E] int64: pair p chose expert e
    earlier: torch.Tensor      # [P, E] int64: pairs before p that chose e
    dest: torch.Tensor         # [P] int64: sorted row of each pair
    order: torch.Tensor        # [P] int64: pair of each sorted row
    token: torch.Tensor        # [P] int64: token of each sorted row
    weights: torch.Tensor      # [N, k] fp32: the router weights
    xs: torch.Tensor           # [P, H]: token rows in expert order
    h13: torch.Tensor          # [P, 2I]: gate | up
    act: torch.Tensor          # [P, I]: silu(gate) * up
    ys: torch.Tensor           # [P, H]: down projection, expert order
    pairs: torch.Tensor        # [P, H]: down projection, pair order
    weighted: torch.Tensor     # [N, k, H] fp32
    acc: torch.Tensor          # [N, H] fp32: the weighted sum
    out: torch.Tensor          # [N, H]: the result, in the model's dtype

    @classmethod
    def allocate(cls, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device | str) -> MoEWorkspace:
        if min(num_tokens, top_k, num_experts, hidden, inter) < 1:
            raise ValueError(f"MoE workspace sizes must be positive: tokens {num_tokens}, top-k {top_k}, "
                             f"experts {num_experts}, hidden {hidden}, intermediate {inter}")
        p = num_tokens * top_k
        i64 = {"dtype": torch.long, "device": device}
        act = {"dtype": dtype, "device": device}
        f32 = {"dtype": torch.float32, "device": device}
        pair_ids = torch.arange(p, **i64)
        return cls(pair_ids=pair_ids, pair_token=pair_ids // top_k, ones=torch.ones(p, **i64),
                   counts=torch.zeros(num_experts, **i64), starts=torch.zeros(num_experts, **i64),
                   onehot=torch.zeros(p, num_experts, **i64), earlier=torch.zeros(p, num_experts, **i64),
                   dest=torch.zeros(p, **i64), order=torch.zeros(p, **i64), token=torch.zeros(p, **i64),
                   weights=torch.zeros(num_tokens, top_k, **f32), xs=torch.zeros(p, hidden, **act),
                   h13=torch.zeros(p, 2 * inter, **act), act=torch.zeros(p, inter, **act),
                   ys=torch.zeros(p, hidden, **act), pairs=torch.zeros(p, hidden, **act),
                   weighted=torch.zeros(num_tokens, top_k, hidden, **f32),
                   acc=torch.zeros(num_tokens, hidden, **f32), out=torch.zeros(num_tokens, hidden, **act))

    def tensors(self) -> list[torch.Tensor]:
        """The buffers in field order: how the op receives them."""
        return [getattr(self, name) for name in _FIELDS]

    @classmethod
    def view(cls, tensors: list[torch.Tensor]) -> MoEWorkspace:
        return cls(*tensors)

    def fits(self, x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether this call's shapes, dtype and device are the ones the workspace was built for."""
        return (tuple(topk_ids.shape) == tuple(self.weights.shape) and tuple(x.shape) == tuple(self.out.shape)
                and x.dtype == self.out.dtype == w13.dtype and x.device == self.out.device
                and w13.shape[0] == self.counts.shape[0] and w13.shape[1] == self.h13.shape[1]
                and w2.shape[2] == self.act.shape[1])


# What one grouped-GEMM MoE call costs beyond its weight reads, as bytes the gathered path may read more
# in that time. Measured on a 2-core AVX-512 CPU (namazu-tiny, bf16, graph mode): the workspace op took
# about 0.7 ms a layer at 14 pairs over 12 experts whatever it computed (sorting, offsets, a dozen small
# GEMM calls), while a gathered pair of those experts (196 KB) costs about 0.01 ms; a 7-row verify entry's
# forward went from 5.0 to 2.8 ms gathered, a 2 x 7 one from 5.9 to 3.7, and at 56 to 112 pairs (3.2 to
# 19.6 MB more read) the two were within noise of each other.
GATHER_EXTRA_BYTES = 4 << 20


def gathers_in_graph(num_pairs: int, num_experts: int, expert_bytes: int) -> bool:
    """Whether a compiled forward runs the experts of `num_pairs` (token, slot) pairs as gathered
    mat-vecs traced into the graph (its code generator fuses the weight gather, product and sum into a
    few loops, with no op dispatch from Python) instead of the grouped-GEMM workspace op. Gathering reads
    each pair's expert weights (`expert_bytes` each), grouping each touched expert's once (for pairs
    spread over the experts, E (1 - (1 - 1/E)^P) of them): gather while the bytes read beyond grouping's
    cost less than the grouped op's own overhead (`GATHER_EXTRA_BYTES`). For namazu-tiny's small experts
    that is up to about 30 pairs; for a DeepSeek-V3 expert (tens of MB) it is where no expert repeats."""
    touched = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_pairs)
    return (num_pairs - touched) * expert_bytes <= GATHER_EXTRA_BYTES


def moe_grouped_mm_into(ws: MoEWorkspace, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The grouped-GEMM MoE (x [N, H], topk_ids / topk_weights [N, k], w13 [E, 2I, H], w2 [E, H, I])
    computed entirely in `ws`; returns `ws.out`."""
    n, k = topk_ids.shape
    inter = ws.act.shape[1]
    flat = topk_ids.reshape(-1)
    _sort_by_expert(ws, flat)
    torch.index_select(x, 0, ws.token, out=ws.xs)
    if x.device.type == "cpu":
        # The counts are host memory here, so reading them stalls nothing, and no other device reaches
        # this branch (the no-host-sync guard patches Tensor.tolist to catch code that would stall a
        # GPU; the unpatched method reads them). GEMMs run only for the experts that got rows (a decode
        # step touches k of E; grouped_mm calls a GEMM for every expert), each as grouped_mm runs it.
        sizes = torch._C.TensorBase.tolist(ws.counts)
        _per_expert_mm(ws.xs, w13, sizes, ws.h13)
        torch.ops.aten.silu.out(ws.h13[:, :inter], out=ws.act)
        ws.act.mul_(ws.h13[:, inter:])
        _per_expert_mm(ws.act, w2, sizes, ws.ys)
    else:   # (graph mode on a GPU captures the eager forward; kept correct for any device)
        offs = torch.cumsum(ws.counts, 0).to(torch.int32)
        ws.h13.copy_(F.grouped_mm(ws.xs, w13.transpose(1, 2), offs=offs))
        gate, up = ws.h13.chunk(2, dim=-1)
        ws.act.copy_(F.silu(gate) * up)
        ws.ys.copy_(F.grouped_mm(ws.act, w2.transpose(1, 2), offs=offs))
    ws.pairs.index_copy_(0, ws.order, ws.ys)
    ws.weights.copy_(topk_weights)
    ws.weighted.copy_(ws.pairs.view(n, k, -1))     # to fp32 first: a mixed-dtype mul allocates
    ws.weighted.mul_(ws.weights.unsqueeze(-1))
    torch.sum(ws.weighted, 1, out=ws.acc)
    ws.out.copy_(ws.acc)
    return ws.out


def _sort_by_expert(ws: MoEWorkspace, flat: torch.Tensor) -> None:
    """ws.order / ws.token: the pairs sorted by expert, stably (as argsort(stable=True) orders them), by
    counting: a pair's row is its expert's first row plus the pairs before it with the same expert.
    (torch.sort allocates a temporary on every call; this allocates nothing.)"""
    ws.counts.zero_().scatter_add_(0, flat, ws.ones)
    torch.cumsum(ws.counts, 0, out=ws.starts)
    ws.starts.sub_(ws.counts)
    ws.onehot.zero_().scatter_(1, flat.unsqueeze(1), ws.ones.unsqueeze(1))
    torch.cumsum(ws.onehot, 0, out=ws.earlier)
    ws.earlier.sub_(ws.onehot)
    torch.gather(ws.earlier, 1, flat.unsqueeze(1), out=ws.dest.unsqueeze(1))
    torch.index_select(ws.starts, 0, flat, out=ws.token)     # (token: scratch until the last line)
    ws.dest.add_(ws.token)
    ws.order.index_copy_(0, ws.dest, ws.pair_ids)
    torch.index_select(ws.pair_token, 0, ws.order, out=ws.token)


def _per_expert_mm(a: torch.Tensor, w: torch.Tensor, sizes: list[int], out: torch.Tensor) -> None:
    """out[rows of e] = a[rows of e] @ w[e].T for each expert with rows (rows grouped by expert)."""
    start = 0
    for e, m in enumerate(sizes):
        if m:
            torch.mm(a[start:start + m], w[e].t(), out=out[start:start + m])
            start += m


_FIELDS = tuple(f.name for f in fields(MoEWorkspace))
_ACTIVE: MoEWorkspace | None = None


def active_workspace() -> MoEWorkspace | None:
    """The workspace of the ladder entry whose forward runs now (None outside graph mode)."""
    return _ACTIVE


@contextlib.contextmanager
def workspace_scope(ws: MoEWorkspace | None) -> Iterator[MoEWorkspace | None]:
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, ws
    try:
        yield ws
    finally:
        _ACTIVE = prev
