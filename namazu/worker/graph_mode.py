"""Graph-mode steps: the decode / verify forward over persistent static-shape buffers, compiled with
torch.compile (inductor) on CPU or captured as a CUDA graph on GPU, one per ladder entry.

A step is graph-eligible when every scheduled sequence computes one known token plus at most K drafts
(decode and verify steps; prefill chunks stay eager). Its tokens are laid out again, sequence b owning
the flat rows [b * Tq, (b + 1) * Tq) of a ladder entry (Bp sequences, Tq = 1 or 1 + K query tokens
each), so the attention layout (q_index, out_index) is a constant of the entry and only token ids,
positions, cache slots, query positions and the block table change per step. These are written into
the entry's buffers (never reallocated); the block table is a prefix of the entry's table of the
largest width, cut at a ladder of widths (powers of two blocks).

Draft trees (`--speculative-tree-budget N`, spec/tree_step.py): every drafted block is a tree of one static
topology, so the verify entries are tree entries of Tq = 1 + N rows whose buffers also hold the step's
in-block mask [Bp, Tq, Tq] (`GraphEntry.tree_mask`, bool: a tree sequence's rows see their ancestors; other
rows, sequences that verify nothing and padding keep all True, the causal rule alone). A tree row's rotary
position (the root's plus its depth) goes to `positions`, while its query position (the causal limit) and
cache slot stay the chain's (node i at the root's slot + i). Both are written per step like the other
buffers, so the compiled graph (or CUDA graph) serves every step. The acceptance over the tree, the
accepted path's move and the next tree's drafting run eagerly after the compiled forward (the drafted
step's compiled tail, worker/drafted_graph.py, is the chain's rule and serves no tree entry).

Padding: a padded token has query position -1 (it sees no key, so its attention is finite and
unused), position 0, and writes its latent to a scratch slot outside the blocks the engine hands out
(`PagedLatentCache.scratch_slot`), so it never touches a sequence's cache. Padded rows are computed and
dropped; the rows the step samples are gathered from the real ones.

On CPU each entry is one torch.compile of the forward (plus the logits of every row and their argmax,
inductor's C++ wrapper calling the kernels); the block-table width is a dynamic dimension there, so an
entry compiles once, and after warm-up its compiled graph is called directly (`worker/direct_call.py`). Attention
is traced into the graph (one softmax over the padded table) where the gathered keys stay small, else it
is the paged_mla op; the routed experts run traced (few pairs per expert) or in the entry's MoE
workspace (kernels/moe_workspace.py).
On GPU an entry is captured per (Bp, width) with torch.cuda.graph over the same buffers and replayed
with no host synchronisation; a step outside the ladder runs eagerly.
"""
from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from namazu.kernels import small_gemm
from namazu.kernels.moe_workspace import MoEWorkspace, gathers_in_graph, workspace_scope
from namazu.kernels.paged_mla import paged_latent_attention
from namazu.layers.experts import TorchExperts
from namazu.layers.forward_context import forward_context
from namazu.worker.direct_call import DirectCall, GraphRecorder
from namazu.worker.host_sync_guard import HostSyncError, no_host_sync
from namazu.worker.paged_kv_cache import PagedAttentionContext, PagedAttentionMetadata, PagedLatentCache

# Largest [Bp, width * block_size, r + dr] gather of keys (fp32) an entry's traced attention may make at
# the ladder's widest table; wider ladders keep the tiled paged_mla op.
TRACED_ATTENTION_BYTES = 256 * 2**20

logger = logging.getLogger(__name__)


def batch_ladder(max_num_seqs: int) -> list[int]:
    """Sequence counts with a graph: powers of two below max_num_seqs, and max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def width_for(blocks: int, max_width: int) -> int:
    """The ladder width (a power of two, at least 2, at most max_width) holding `blocks` blocks."""
    w = 2
    while w < blocks:
        w *= 2
    return min(w, max_width)


class GraphEntry:
    """Persistent buffers of one (Bp, Tq) ladder entry and its compiled or captured forward."""

    def __init__(self, bp: int, tq: int, max_width: int, cache: PagedLatentCache, device: torch.device,
                 moe_workspace: MoEWorkspace | None = None, tree: bool = False):
        n = bp * tq
        self.bp, self.tq = bp, tq
        i64 = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)      # rotary positions (a tree row's: root + depth)
        self.slot_mapping = torch.full((n,), cache.scratch_slot, **i64)
        self.block_tables = torch.zeros(bp, max_width, **i64)
        self.q_pos = torch.full((bp, tq), -1, **i64)  # causal limits (a tree row's: the chain's position)
        self.q_index = torch.arange(n, **i64).view(bp, tq)
        self.out_index = torch.arange(n, **i64)
        # A tree entry's in-block attention mask [Bp, Tq, Tq] (`PagedAttentionMetadata.tree_mask`): all True
        # (the causal rule alone) but on the rows of sequences that verify a tree this step.
        self.tree_mask = torch.ones(bp, tq, tq, dtype=torch.bool, device=device) if tree else None
        self.cache = cache
        self.moe_workspace = moe_workspace
        # What `load` writes a step into: on CPU the buffers themselves (numpy views of their memory: no
        # staging arrays, no copy dispatch per buffer), elsewhere host arrays copied over after each load.
        bufs = (self.input_ids, self.positions, self.slot_mapping, self.q_pos.view(-1), self.block_tables)
        if tree:
            bufs += (self.tree_mask,)
        self.host_is_buffers = device.type == "cpu"
        self.host = tuple(t.numpy() if self.host_is_buffers else
                          np.zeros(t.shape, dtype=bool if t.dtype == torch.bool else np.int64) for t in bufs)
        self.compiled: Callable | None = None
        self.direct: DirectCall | None = None
        self.greedy: torch.Tensor | None = None   # [Bp * Tq] the last launch's argmax of every row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}   # width -> (graph, outputs)

    def context(self, width: int, traced_attention: bool = False, table: torch.Tensor | None = None
                ) -> PagedAttentionContext:
        table = self.block_tables[:, :width] if table is None else table
        meta = PagedAttentionMetadata(slot_mapping=self.slot_mapping, block_tables=table,
                                      q_index=self.q_index, q_pos=self.q_pos, out_index=self.out_index,
                                      tree_mask=self.tree_mask)
        return (_TracedAttentionContext if traced_attention else PagedAttentionContext)(self.cache, meta)


class _TracedAttentionContext(PagedAttentionContext):
    """Attention traced into the compiled graph (CPU graph mode) instead of called as the paged_mla op:
    the compiler fuses the gather, masking and softmax around the two matmuls, and no op dispatch runs
    from Python. One softmax over the whole padded table (the width is a dynamic dimension; a loop over
    tiles would be control flow over it), so StepGraphs uses it only where the table's gathered keys
    stay small (`TRACED_ATTENTION_BYTES`).

    The latent write is traced too, as one index_put_ into the whole cache tensor (layer, block, offset):
    the compiler turns a mutation of a graph input into an in-place scatter, where the write_latents op
    cost a Python dispatch per layer (about a sixth of a batch-1 step). It must index the cache itself:
    a mutation through a view of it (kv[layer], a flattened view) is functionalized into a copy of the
    whole cache on every step."""

    def attend(self, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
               k_pe: torch.Tensor) -> torch.Tensor:
        cache, m = self.cache.kv, self.meta
        bs, slots = cache.shape[2], m.slot_mapping
        cache.index_put_((torch.full_like(slots, layer.layer_idx), slots // bs, slots % bs),
                         torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype))
        kv = cache[layer.layer_idx]
        o_lat = paged_latent_attention(layer.absorb_q(q_nope), q_pe, kv, m.block_tables, m.q_index, m.q_pos,
                                       m.out_index, layer.kv_lora_rank, layer.softmax_scale, tile_tokens=None,
                                       tree_mask=m.tree_mask)
        return layer.absorb_out(o_lat)


class StepGraphs:
    """The ladder of graph-mode forwards of one model runner."""

    def __init__(self, model: torch.nn.Module, cache: PagedLatentCache, device: torch.device,
                 max_num_seqs: int, num_speculative_tokens: int, max_blocks_per_seq: int,
                 capture_layers: Sequence[int] = (), backend: str = "inductor", tree_nodes: int = 0):
        self.model, self.cache, self.device = model, cache, device
        self.capture_layers = tuple(capture_layers)
        self.k = num_speculative_tokens
        # With a draft tree of N nodes (`--speculative-tree-budget`) every drafted block is a tree: the verify
        # entries are tree entries of 1 + N rows (the chain's 1 + K are never verified).
        self.tree_nodes = tree_nodes if num_speculative_tokens else 0
        # A power of two (tables wider than it run eagerly): inductor compiled the dynamic width over
        # [2, 2^k]; over [2, 257] (namazu-tiny's 4096 positions plus drafts) it added a guard width <= 256,
        # which the declared range forbids, and start-up failed.
        self.max_width = 1 << (max(2, max_blocks_per_seq).bit_length() - 1)
        self.batches = batch_ladder(max_num_seqs)
        self.tqs = [1] + ([1 + (self.tree_nodes or self.k)] if self.k else [])
        self.backend = backend
        self.use_cuda_graphs = device.type == "cuda"
        # The compiled (CPU) forward's MoE runs in a workspace per entry; a CUDA graph captures the
        # eager forward, whose allocations the graph's private memory pool makes static.
        self.entries = {(bp, tq): GraphEntry(bp, tq, self.max_width, cache, device,
                                             None if self.use_cuda_graphs else _moe_workspace(model, bp * tq),
                                             tree=tq > 1 and self.tree_nodes > 0)
                        for tq in self.tqs for bp in self.batches}
        self.graph_bytes = 0

    # -- the forward an entry compiles or captures ---------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(logits [Bp * Tq, V] fp32, final hidden, each row's argmax, the captured layers' hidden in
        capture_layers order): flat, so that a direct call of the compiled graph returns the same list."""
        hidden, captured = self.model(input_ids, positions, capture_layers=self.capture_layers)
        logits = self.model.compute_logits(hidden)
        # Every row's greedy token, fused after lm_head (an eager argmax over [Bp * Tq, V] costs tens of
        # microseconds at batch 1 and a third of a millisecond at 32): the sample of a greedy row with no
        # penalty or grammar mask (sampler.leaves_logits_raw).
        return (logits, hidden, logits.argmax(dim=-1), *(captured[i] for i in self.capture_layers))

    @property
    def max_drafts(self) -> int:
        """The most drafts a sequence of a graph step verifies (a chain's K, a tree's N)."""
        return self.tqs[-1] - 1

    def entry_for(self, num_seqs: int, tq: int) -> GraphEntry | None:
        if tq > self.tqs[-1]:
            return None
        tq = 1 if tq == 1 else self.tqs[-1]
        for bp in self.batches:
            if bp >= num_seqs:
                return self.entries.get((bp, tq))
        return None

    # -- start-up --------------------------------------------------------------------------------------
    @torch.inference_mode()   # as the runner's steps: the compiled code is guarded on the grad mode
    def warm_up(self, progress: bool = True) -> float:
        """Compiles (CPU) or captures (GPU) every entry; returns the seconds it took."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        if not self.use_cuda_graphs:
            # Bound to its own name: `import torch._dynamo` here would make `torch` a local of this
            # function, unbound on the CUDA-graph path below.
            from torch import _dynamo
            _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 4 * len(self.entries))
        todo = list(self.entries.values())
        widths = self._widths() if self.use_cuda_graphs else [2]
        bar = tqdm(total=len(todo) * len(widths), desc="graph mode: " + ("capturing CUDA graphs" if
                   self.use_cuda_graphs else "compiling forwards"), disable=not progress)
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.use_cuda_graphs else 0
        for e in todo:
            for w in widths:
                if self.use_cuda_graphs:
                    self._capture(e, w)
                else:
                    self._compile(e)
                bar.update(1)
        bar.close()
        if self.use_cuda_graphs:
            torch.cuda.synchronize(self.device)
            self.graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        return time.perf_counter() - t0

    def _widths(self) -> list[int]:
        out, w = [], 2
        while w < self.max_width:
            out.append(w)
            w *= 2
        return out + [self.max_width]

    def _compile(self, e: GraphEntry) -> None:
        recorder = GraphRecorder(compile_backend(self.backend))
        e.compiled = torch.compile(self._entry_forward(e), backend=recorder, dynamic=False, fullgraph=True)
        table = e.block_tables[:, :2]
        with recorder.record():
            ref = self._run_compiled(e, 2, table=table)   # the first call compiles; padding rows only
        # Every input but the table's view at the step's width is the same tensor on every call (the entry's
        # buffers, the parameters, the cache).
        e.direct = DirectCall.learn(recorder.last, {"table": table}, 2, ref)
        if e.direct is None:
            logger.warning("graph mode: entry (%d, %d) is called through torch.compile's frame (its compiled "
                           "graph did not reproduce the traced call)", e.bp, e.tq)

    def _entry_forward(self, e: GraphEntry) -> Callable:
        """`_forward` under a code object of the entry's own (`own_code`)."""
        return types.MethodType(own_code(StepGraphs._forward, f"_forward_b{e.bp}_q{e.tq}"), self)

    def _traces_attention(self, e: GraphEntry) -> bool:
        kv = self.cache.kv
        return e.bp * self.max_width * kv.shape[2] * kv.shape[3] * 4 <= TRACED_ATTENTION_BYTES

    def _run_compiled(self, e: GraphEntry, width: int, check_guards: bool = True, table: torch.Tensor | None = None):
        if e.direct is not None:
            with _disable_current_modes():   # (as below)
                return e.direct({"table": e.block_tables[:, :width]}, width)
        ctx = e.context(width, traced_attention=self._traces_attention(e), table=table)
        torch._dynamo.mark_dynamic(ctx.meta.block_tables, 1, min=2, max=max(3, self.max_width))
        # torch.compile does not run under a dispatch mode, which is how --debug-no-host-sync watches
        # eager ops; the compiled forward needs no watching: it was traced with fullgraph=True, which
        # refuses every host read (item, data-dependent shapes) inside it instead of breaking the graph.
        # After warm-up an entry's inputs are always its own buffers, of fixed shapes but for the dynamic
        # width: the guards torch.compile checks before each call (every parameter, buffer and context
        # attribute, every entry of the ladder in turn) cannot fail, so a step evaluates only those that
        # tell the entries apart.
        stance = contextlib.nullcontext() if check_guards else \
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        with _disable_current_modes(), forward_context(ctx), workspace_scope(e.moe_workspace), stance:
            return e.compiled(e.input_ids, e.positions)

    def _capture(self, e: GraphEntry, width: int) -> None:
        # Warm-up on a side stream first (lazy initialisations must not happen inside the capture).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), forward_context(e.context(width)):
            # The first run under the host-sync guard: a host read inside the forward would invalidate the
            # capture with a bare CUDA error and leave the process's CUDA RNG unusable for every later
            # engine; caught here, it stops start-up with a message that names the read.
            try:
                with no_host_sync():
                    self._forward(e.input_ids, e.positions)
            except HostSyncError as exc:
                raise RuntimeError(f"graph mode: the step's forward reads a device value on the host ({exc}); "
                                   "it cannot be captured as a CUDA graph (--enforce-eager runs it eagerly)") from exc
            self._forward(e.input_ids, e.positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), forward_context(e.context(width)):
            outputs = self._forward(e.input_ids, e.positions)
        e.graphs[width] = (graph, outputs)

    # -- a step ---------------------------------------------------------------------------------------
    def load(self, e: GraphEntry, pad_index: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
             slot_mapping: np.ndarray, block_tables: np.ndarray, rope_positions: np.ndarray | None = None,
             tree_mask: np.ndarray | None = None) -> int:
        """Writes a step into the entry's buffers; returns the block-table width to launch with.
        `pad_index[f]` is the padded row of flat token f; the other arrays are the batch's (flat
        tokens, [B, M] block tables). A step that verifies draft trees (`TreeStep.plan`) gives its rows'
        rotary positions (`positions` stay the causal limits) and its in-block mask [B, t, t] (t: the step's
        rows per sequence, at most the entry's Tq); a tree entry's other rows and sequences keep all True."""
        if block_tables.shape[1] > self.max_width:
            raise AssertionError(f"block table of {block_tables.shape[1]} blocks; the graph ladder holds "
                                 f"{self.max_width}")
        b, m = block_tables.shape
        ids, pos, slots, q_pos, table = e.host[:5]
        ids.fill(0)
        ids[pad_index] = input_ids
        pos.fill(0)
        pos[pad_index] = positions if rope_positions is None else rope_positions
        slots.fill(self.cache.scratch_slot)
        slots[pad_index] = slot_mapping
        q_pos.fill(-1)
        q_pos[pad_index] = positions
        width = width_for(m, self.max_width)
        table[:, :width] = 0
        table[:b, :m] = block_tables
        if e.tree_mask is not None:
            mask = e.host[5]
            mask.fill(True)
            if tree_mask is not None:
                t = tree_mask.shape[1]
                mask[:tree_mask.shape[0], :t, :t] = tree_mask
        elif tree_mask is not None:
            raise AssertionError(f"a step that verifies draft trees, loaded into entry ({e.bp}, {e.tq}) that has "
                                 "no tree mask")
        if e.host_is_buffers:
            return width
        _write(e.input_ids, ids)
        _write(e.positions, pos)
        _write(e.slot_mapping, slots)
        _write(e.q_pos.view(-1), q_pos)
        _write(e.block_tables[:, :width], table[:, :width])
        if e.tree_mask is not None:
            _write(e.tree_mask, e.host[5])
        return width

    def launch(self, e: GraphEntry, width: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Runs the entry's forward over its buffers: (logits [Bp * Tq, V] fp32, final hidden, captured);
        each padded row's argmax is `e.greedy` until the next launch."""
        if self.use_cuda_graphs:
            graph, outputs = e.graphs[width]
            graph.replay()
        else:
            outputs = self._run_compiled(e, width, check_guards=False)
        e.greedy = outputs[2]
        return outputs[0], outputs[1], dict(zip(self.capture_layers, outputs[3:]))


def compile_backend(name: str, cpp_wrapper: bool = True) -> Callable:
    """A torch.compile backend that compiles with `name` ("inductor", or any dynamo backend such as the tests'
    "eager"); `direct_call.GraphRecorder` wraps it to call the graph directly later."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if name == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            # The C++ wrapper: the compiled step calls its ~50 kernels and GEMMs from generated C++
            # instead of a Python function (batch 1: 1.68 vs 1.89 ms a step, CPU time, 1 thread); it
            # costs a longer cold compile, which inductor's cache keeps for the next start. It cannot call
            # a tensor-parallel rank's collectives (their process-group argument has no C++ type there),
            # so such a graph keeps the Python wrapper.
            with inductor_config.patch(cpp_wrapper=cpp_wrapper and not has_collectives(gm)):
                fn = compile_fx(gm, example_inputs)
        else:
            fn = torch._dynamo.lookup_backend(name)(gm, example_inputs)
        return fn

    return backend


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph calls collectives (dynamo traces torch.distributed's as functional ops)."""
    return any(n.op == "call_function" and str(n.target).startswith(("_c10d_functional.", "c10d_functional."))
               for n in gm.graph.nodes)


def own_code(fn: Callable, name: str) -> types.FunctionType:
    """`fn` under a code object of its own. torch.compile caches compiled code per code object: with one
    shared by every ladder entry, each call walked the whole ladder's cache entries (about 55 us a step at
    batch 1, even with guard evaluation skipped); one each, a call finds its own."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _moe_workspace(model: torch.nn.Module | None, num_tokens: int) -> MoEWorkspace | None:
    """A workspace for the grouped-GEMM experts of `model` (None without them: NVFP4 experts and kernel
    backends run their own kernels). Every MoE layer of a model has the same shapes."""
    for m in model.modules() if model is not None else ():
        if isinstance(m, TorchExperts):
            top_k = model.config.num_experts_per_tok
            if gathers_in_graph(num_tokens * top_k, m.num_experts, m.expert_bytes) or \
                    small_gemm.moe_applies(m.w13.dtype, m.w13.device, num_tokens * top_k):
                return None
            return MoEWorkspace.allocate(num_tokens, top_k, m.num_experts,
                                         m.hidden_size, m.intermediate_size, m.w13.dtype, m.w13.device)
    return None


def _write(buf: torch.Tensor, host: np.ndarray) -> None:
    buf.copy_(torch.from_numpy(host), non_blocking=True)
