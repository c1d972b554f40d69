"""The model runner: one rank's model, paged KV cache, sampler and proposer; executes a StepBatch.

One step, in order: the worker's sequence table fills pending inputs and applies async corrections
(host, `worker_seqs.py`); the batch goes to the device; the target's forward; logits of the sampled
rows; sampling; the acceptance rule over the drafts proposed last step (`spec/verify.py`); a device
proposer drafts from this forward's hidden states; results are packed by `step_batch.RESULT_FIELDS`
and copied to the host once; a host proposer (n-gram) drafts from the updated histories; drafts go
into the device draft buffer for the next step. Between the batch's arrival and the one host read
nothing syncs: `--debug-no-host-sync` wraps that span in the guard that turns any read into an error.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from namazu.engine_config import EngineConfig, graph_backend, graph_mode, sampled_drafting_off
from namazu.kernels.backends import resolve_moe_runtime
from namazu.layers.cpu_layout import use_k_major_linears, use_packed_lm_head
from namazu.layers.forward_context import forward_context
from namazu.layers.sampler import (
    SamplingTensors,
    gather_logprobs,
    leaves_logits_raw,
    process_logits,
    sample_from_processed,
)
from namazu.layers.weight_loading import TPShard
from namazu.models.loader import load_model
from namazu.quant import nvfp4_experts as _nvfp4_experts  # noqa: F401  (registers the NVFP4 experts format)
from namazu.spec.proposer import Proposal, Proposer
from namazu.spec.shadow import shadow_for_rank
from namazu.spec.speculator import DraftSite, Speculator
from namazu.step.batch import StepBatch, StepResult, pack, result_layout, unpack
from namazu.worker.cpu_threads import apply_threads
from namazu.worker.drafted_graph import DraftedTails
from namazu.worker.graph_mode import GraphEntry, StepGraphs
from namazu.worker.host_sync_guard import no_host_sync
from namazu.worker.paged_kv_cache import (
    PagedAttentionContext,
    PagedAttentionMetadata,
    PagedLatentCache,
    kv_bytes_per_block,
)
from namazu.worker.seq_table import PreparedStep, WorkerSeqTable

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this torch build or machine has no CUDA device")
    return torch.device(name)


@dataclass
class StepTiming:
    """One step on the worker (perf_counter seconds): arrival, host preparation done, the one host read
    done, end; `device_s` is the device time of the compute span (CUDA events; None on CPU)."""

    arrive: float
    prepared: float
    computed: float
    end: float
    num_tokens: int
    graph: bool
    device_s: float | None = None


@dataclass
class StepInputs:
    """A step's device inputs: the flat ones of an eager forward (or of a device proposer), the graph entry
    and its padded row of each flat token in graph mode, and what sampling and verification index by."""

    logit_rows: torch.Tensor                     # [R] the step's own sampled rows (flat, unpadded)
    row_layout: torch.Tensor                     # [S, K+1] sampled row of each sequence's positions
    slot_index: torch.Tensor | None = None       # [S] draft-buffer slots (speculation on)
    meta: PagedAttentionMetadata | None = None
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    num_drafts: torch.Tensor | None = None       # [S] drafts verified per sequence
    draft_flat: torch.Tensor | None = None       # [D] flat positions whose input is a held draft
    draft_src: torch.Tensor | None = None        # [D] which held draft
    plp_rows: torch.Tensor | None = None         # prompt logprobs: rows and their target ids
    plp_targets: torch.Tensor | None = None
    entry: GraphEntry | None = None              # graph mode
    pad: torch.Tensor | None = None              # [N] padded row of each flat token
    width: int | None = None
    tail: bool = False                           # graph mode: the drafted step's compiled tail runs it
    write_context: bool = True                   # the drafter's context from this step's rows


@dataclass
class Forward:
    """What the target's forward produced, rows as sampling indexes them (padded in graph mode)."""

    hidden: torch.Tensor                         # [N, H] final-normed (the step's own rows)
    captured: dict[int, torch.Tensor]            # layer -> [N, H] for a device proposer
    input_ids: torch.Tensor                      # the forward's inputs, drafts in place
    logit_rows: torch.Tensor                     # [R] rows of the sampled positions
    all_logits: torch.Tensor | None = None       # graph mode: every row's logits
    greedy: torch.Tensor | None = None           # graph mode: every row's argmax
    context_written: bool = False                # graph mode: the drafter's context write was compiled in


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str | Path, rank: int = 0, world_size: int = 1,
                 proposer: Proposer | None = None):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(config.device)
        self.threads = apply_threads(config.threads, separate_engine_process=config.executor == "mp")
        logger.info("rank %d: %d CPU thread(s)%s", rank, self.threads,
                    "" if config.threads is not None else " (default: cores not busy elsewhere; --threads sets it)")
        # Resolved once, handed to the model's expert modules; "auto" leaves NAMAZU_MOE_BACKEND and
        # NAMAZU_NVFP4_MODE in charge.
        moe_runtime = resolve_moe_runtime(self.device, config.moe_backend, config.nvfp4_mode)
        dtype = config.dtype
        if dtype == "auto" and self.device.type == "cpu":
            # Half-precision matmuls on CPU are slow and less exact; serve bf16/fp16 checkpoints in fp32.
            dtype = "float32"
        self.model = load_model(model_path, dtype=dtype, device=self.device, progress=rank == 0, runtime=moe_runtime,
                                tp=TPShard(rank, world_size))
        if self.device.type == "cpu":
            use_k_major_linears(self.model)
            use_packed_lm_head(self.model)
        self.model_config = self.model.config
        if world_size > 1 and getattr(proposer, "whole_vocab", False):
            # Every rank, together: a DFlash drafter (and a shadow beside it) borrows the whole vocabulary.
            self.model.gather_whole_vocab()
        self.dtype = self.model.dtype
        self.block_size = config.block_size
        self.num_blocks = 0
        self.cache: PagedLatentCache | None = None
        # Under tensor parallelism the sampled tokens, the acceptance counts and a device proposer's drafts are
        # rank 0's, broadcast (`Speculator.shared`): every rank commits the same tokens even if its logits
        # differ in the last bit (tests switch `share_decisions` off to show what it prevents).
        self.spec = Speculator(proposer, config.num_speculative_tokens, self.model_config.vocab_size, self.device,
                               world_size > 1, world_size, config.speculative_tree_budget,
                               config.speculative_tree_candidates)
        self.seqs = WorkerSeqTable()
        # A shadow drafter (`--shadow-drafter`, rank 0 only): drafts beside the serving one, scored, never served.
        self.shadow = shadow_for_rank(config, rank, proposer, self.model_config)
        self._empty_i = torch.zeros(0, dtype=torch.long, device=self.device)
        self._empty_f = torch.zeros(0, device=self.device)
        # Per-step timestamps for bench/step_profile.py: a list turns recording on (None: off, free).
        self.profile: list[StepTiming] | None = None
        self.graphs: StepGraphs | None = None
        self.tails: DraftedTails | None = None
        self._eager_reasons: set[str] = set()
        self.graph_mode = graph_mode(config)

    @property
    def proposer(self) -> Proposer | None:
        return self.spec.proposer

    @property
    def share_decisions(self) -> bool:
        return self.spec.share_decisions

    @share_decisions.setter
    def share_decisions(self, on: bool) -> None:
        self.spec.share_decisions = on

    def swap_proposer(self, proposer: Proposer) -> None:
        """Serves `proposer` (attached already) from the next step on; graph mode's compiled drafted tails
        take it as an argument, so their next call checks their guards against it again (a drafter of the
        same shapes reuses the compiled code)."""
        self.spec.swap_proposer(proposer)
        if self.tails is not None:
            self.tails.use_proposer(proposer)

    def plan_kv_blocks(self) -> int:
        """How many KV blocks this rank could hold; the engine allocates the minimum over ranks."""
        return self._plan_kv_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = PagedLatentCache(self.model_config, num_blocks, self.block_size, self.dtype, self.device)
        logger.info("rank %d: KV cache %d blocks x %d tokens (%.1f MiB) on %s", self.rank, num_blocks,
                    self.block_size, self.cache.nbytes / 2**20, self.device)
        self.spec.attach(self.model, num_blocks, self.block_size, self.cache.kv)
        if self.shadow is not None:
            self.shadow.attach(self.model, num_blocks, self.block_size)
        if self.graph_mode:
            self._build_graphs()
        else:
            logger.info("rank %d: eager mode (%s)", self.rank, "--enforce-eager" if self.config.enforce_eager
                        else "the default on CPU; --no-enforce-eager compiles decode and verify steps")

    def _build_graphs(self) -> None:
        cfg = self.model_config
        want_hidden = self._capture_layers
        longest = cfg.max_position_embeddings + max(self.spec.k, self.spec.tree_budget)
        self.graphs = StepGraphs(self.model, self.cache, self.device, self.config.max_num_seqs,
                                 self.spec.k, min(self.num_blocks, -(-longest // self.block_size)),
                                 want_hidden, backend=graph_backend(),
                                 tree_nodes=self.spec.tree.num_nodes if self.spec.tree is not None else 0)
        seconds = self.graphs.warm_up(progress=self.rank == 0)
        if self.spec.kind is not None and self.spec.kind.has_context and not self.graphs.use_cuda_graphs:
            limit = self.config.speculative_disable_batch_size or self.config.max_num_seqs
            # The sampled variants only where sampled sequences may draft: each is a compile at start-up, and the
            # default policy keeps them from drafting in CPU graph mode (a step without its variant runs eagerly).
            sampled = not (self.config.speculative_adaptive and sampled_drafting_off(self.config))
            self.tails = DraftedTails(self.graphs, self.spec.proposer, self.model_config.vocab_size, limit,
                                      sampled=sampled)
            tail_s = self.tails.warm_up(progress=self.rank == 0)
            seconds += tail_s
            logger.info("rank %d: graph mode: drafted steps (sampling, acceptance, drafter) compiled for batch "
                        "sizes %s in %.1f s", self.rank, [e.bp for e in self.tails.entries], tail_s)
        what = "CUDA graphs captured" if self.graphs.use_cuda_graphs else f"forwards compiled ({self.graphs.backend})"
        mem = f", graph memory {self.graphs.graph_bytes / 2**20:.1f} MiB" if self.graphs.use_cuda_graphs else ""
        logger.info("rank %d: graph mode: %s for batch sizes %s x query tokens %s in %.1f s%s", self.rank, what,
                    self.graphs.batches, self.graphs.tqs, seconds, mem)

    def _graph_layout(self, b: StepBatch, prep: PreparedStep):
        """(entry, padded row of each flat token) when this step runs as a graph, else None: every
        sequence decodes or verifies (one known token, at most K drafts), no prompt logprobs."""
        g, sq = self.graphs, b.seqs
        if g is None or len(sq.seq_ids) == 0 or (b.prompt_lp.num >= 0 and len(b.prompt_lp.rows)):
            return None
        if not (np.all(sq.num_new == 1) and np.all(sq.samples)) or int(sq.num_drafts.max()) > g.max_drafts:
            return None
        plain = b.num_tokens == len(sq.seq_ids)     # a plain decode (no drafts)
        n_per = None if plain else sq.num_new + sq.num_drafts
        e = g.entry_for(len(sq.seq_ids), 1 if plain else int(n_per.max()))
        if e is None or b.attn.block_tables.shape[1] > g.max_width:
            return None
        if plain:                                    # token b is row b * Tq of the entry
            return e, np.arange(b.num_tokens) * e.tq
        starts = np.cumsum(n_per) - n_per
        seq_of = np.repeat(np.arange(len(n_per)), n_per)
        pad_index = seq_of * e.tq + (np.arange(len(seq_of)) - starts[seq_of])
        return e, pad_index

    def _plan_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        per_block += self.spec.kv_bytes_per_block(self.block_size, self.dtype)
        if self.shadow is not None:
            per_block += self.shadow.kv_bytes_per_block(self.block_size, self.dtype)
        if self.device.type == "cuda":
            # An engine this process closed earlier leaves its blocks in torch's caching allocator, which
            # the driver counts as used: hand them back first, or a second engine finds no room.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Headroom for activations: a step's hidden states and its sampled logits, generously.
            cfg = self.model_config
            act = self.config.max_num_batched_tokens * (24 * cfg.hidden_size + 4 * cfg.vocab_size) * 4
            budget = int(total * self.config.gpu_memory_utilization) - used - act
            if self.config.kv_cache_memory is not None:     # several engines in one process share the GPU
                budget = min(budget, self.config.kv_cache_bytes)
        else:
            budget = self.config.kv_cache_bytes
        blocks = budget // per_block
        if blocks < 1:
            raise RuntimeError(f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                               "raise --kv-cache-memory / --gpu-memory-utilization")
        return int(blocks)

    # -- the step -------------------------------------------------------------------------------------
    def _tensor(self, a: np.ndarray | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if a is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.to(self.device, dtype=dtype, non_blocking=True)

    def _penalty_tensors(self, b: StepBatch, prep: PreparedStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Output-token counts [R, V] and prompt-token masks [R, V] for the penalty rows, from the
        worker's own histories (row j of a verify also counts the drafts it follows: drafts[:j], or a tree
        node's path)."""
        sp = b.sampling
        if not sp.any_penalty:
            return None, None
        vocab = self.model_config.vocab_size
        rows = b.spec.row_layout
        outputs: list[list[int]] = [[] for _ in range(len(sp.temperature))]
        prompts: list[list[int]] = [[] for _ in range(len(sp.temperature))]
        for s, i in enumerate(b.spec.batch_index):
            hist, plen = prep.histories[s], int(b.seqs.prompt_lens[i])
            done = hist[plen:int(prep.verify_from[s]) + 1]
            drafts = self.spec.drafts.host_drafts(int(prep.slots[s]))
            penalized = sp.presence_penalty[rows[s, 0]] != 0 or sp.frequency_penalty[rows[s, 0]] != 0 \
                or sp.repetition_penalty[rows[s, 0]] != 1
            if not penalized:
                continue
            for j in range(int(b.seqs.num_drafts[i]) + 1):
                outputs[rows[s, j]] = done + self.spec.drafts_before(int(prep.slots[s]), drafts, j)
                if sp.repetition_penalty[rows[s, 0]] != 1:
                    prompts[rows[s, j]] = hist[:plen]

        def to_counts(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            ids = np.full((len(lists), width), -1, dtype=np.int64)
            for r, x in enumerate(lists):
                ids[r, :len(x)] = x
            t = self._tensor(ids)
            return torch.zeros(t.shape[0], vocab, device=self.device).scatter_add_(1, t.clamp(min=0), (t >= 0).float())

        counts = to_counts(outputs)
        mask = to_counts(prompts) > 0 if sp.any_repetition_penalty else None
        return counts, mask

    def _sampling_tensors(self, b: StepBatch, prep: PreparedStep) -> SamplingTensors:
        T, sp = self._tensor, b.sampling
        counts, prompt_mask = self._penalty_tensors(b, prep)
        return SamplingTensors(
            temperature=T(sp.temperature), top_k=T(sp.top_k), top_p=T(sp.top_p), min_p=T(sp.min_p),
            presence_penalty=T(sp.presence_penalty), frequency_penalty=T(sp.frequency_penalty),
            repetition_penalty=T(sp.repetition_penalty), seeds=T(sp.seeds), counters=T(sp.counters),
            output_counts=counts, prompt_mask=prompt_mask, bitmask=T(sp.bitmask), bias=T(sp.bias),
            bias_values=T(sp.bias_values), any_penalty=sp.any_penalty,
            any_top_k_top_p=sp.any_top_k_top_p, any_min_p=sp.any_min_p, all_greedy=sp.all_greedy,
            num_logprobs=-1)

    # -- the step: forward -> sample / verify -> propose ----------------------------------------------
    @torch.inference_mode()
    def execute(self, b: StepBatch) -> StepResult:
        t_arrive = time.perf_counter()
        self._forget_finished(b.finished_seq_ids)
        if self.shadow is not None:
            self.shadow.note(b)
        planned = b.seqs.num_drafts
        b = self.spec.verify_held_drafts_only(b, self.seqs)
        prep = self.seqs.prepare(b, self.block_size, self.spec.drafts.width, self.spec.drafts.count)
        self.spec.drafts.ensure(self.seqs.num_slots)
        inp = self._inputs(b, prep)
        t0 = time.perf_counter()
        events = None
        if self.profile is not None and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        drafter_t0 = self.spec.draft_seconds
        with no_host_sync(self.config.debug_no_host_sync):
            fwd = self._forward(inp)
            if inp.tail:
                values = self._drafted_tail(b, prep, inp, fwd)
            else:
                st = self._sampling_tensors(b, prep)
                site = self._draft_site(b, inp) if self.spec.on_device else None
                if not fwd.context_written and inp.write_context:
                    self.spec.extend_context(b, fwd.hidden, fwd.captured, site)
                if self.shadow is not None and site is not None:
                    self.shadow.extend_context(b, site.positions, site.slot_mapping, fwd.captured)
                entry = self._prefill_tail_entry(b, inp) if site is not None else None
                if entry is not None:
                    values = self._prefill_tail(b, prep, inp, fwd, entry)
                else:
                    values = self._sample_and_verify(b, prep, inp, fwd, st, site) if len(b.attn.logit_rows) else {}
                values.update(self._prompt_logprobs(b, inp, fwd))
            layout_out = result_layout(b)
            flat_i, flat_f = pack(layout_out, values, torch.cat, self._empty_i, self._empty_f)
            flat_f = flat_f.float()
        if events is not None:
            events[1].record()
        # The step's one host read.
        result = unpack(layout_out, flat_i.cpu().numpy(), flat_f.cpu().numpy())
        t_computed = time.perf_counter()
        if result.tokens is not None:
            self.seqs.record(b, prep, result.tokens, result.accepted, self.spec.max_accepted(planned))
            self.spec.after_read(b, prep, result, self.seqs)
            if self.shadow is not None:
                result.shadow = self.shadow.after_read(self.seqs)
        t_end = time.perf_counter()
        if self.profile is not None:
            self.profile.append(StepTiming(t_arrive, t0, t_computed, t_end, b.num_tokens, inp.entry is not None,
                                           events[0].elapsed_time(events[1]) / 1e3 if events else None))
        result.drafter_seconds = self.spec.draft_seconds - drafter_t0
        logger.debug("step: %d tokens, %d sampled rows, %.1f ms", b.num_tokens, len(b.attn.logit_rows),
                     1e3 * (t_end - t0))
        return result

    def skip(self, b: StepBatch) -> None:
        """A step dropped before it ran: its sequences had all finished. Only the finished sequences it names
        are forgotten, as `execute` would first (there `seqs.prepare` forgets their table entries)."""
        self._forget_finished(b.finished_seq_ids)
        self.seqs.forget(b.finished_seq_ids)

    def _forget_finished(self, finished: list[int]) -> None:
        """The drafts, trees and shadow state of finished sequences (before their slots are released)."""
        self.spec.forget_finished(self.seqs, finished)
        if self.shadow is not None:
            self.shadow.forget(finished, self.seqs)

    def _inputs(self, b: StepBatch, prep: PreparedStep) -> StepInputs:
        T, a = self._tensor, b.attn
        # A draft tree's step (`spec/tree_step.py`): its rows' rotary positions and in-block mask are its own,
        # in the eager forward's inputs or a tree entry's buffers (graph mode).
        tree = self.spec.plan_tree(b, prep, T)
        layout = self._graph_layout(b, prep)
        inp = StepInputs(logit_rows=T(a.logit_rows), row_layout=T(b.spec.row_layout),
                         slot_index=T(prep.slots) if self.spec.k else None)
        # A step with a shadowed sequence skips the compiled tail: the shadow reads what the tail keeps inside.
        inp.write_context = b.spec.write_context
        inp.tail = layout is not None and self._tail_covers(b, layout[0]) \
            and not (self.shadow is not None and self.shadow.wants(b))
        # Each input costs a host-to-device copy (on CPU, a tensor wrapper: still a few microseconds): a graph
        # step reads its inputs from the entry's buffers, so the flat ones are built only for an eager
        # forward or a device proposer; speculation-only inputs only when the step verifies.
        if layout is None or (self.spec.on_device and not inp.tail):
            inp.meta = PagedAttentionMetadata(slot_mapping=T(prep.slot_mapping), block_tables=T(a.block_tables),
                                              q_index=T(a.q_index), q_pos=T(a.q_pos), out_index=T(a.out_index))
            inp.input_ids, inp.positions = T(a.input_ids), T(a.positions)
            if tree is not None:
                inp.meta.tree_mask, inp.positions = tree.tree_mask, tree.rope_positions
        if b.prompt_lp.num >= 0 and len(b.prompt_lp.rows):
            inp.plp_rows, inp.plp_targets = T(b.prompt_lp.rows), T(b.prompt_lp.targets)
        if b.spec.max_drafts:
            inp.num_drafts = T(prep.num_drafts)
        if len(prep.draft_flat):
            inp.draft_flat, inp.draft_src = T(prep.draft_flat), T(prep.draft_src)
        if layout is not None:
            inp.entry, pad_index = layout
            inp.width = self.graphs.load(inp.entry, pad_index, a.input_ids, a.positions, prep.slot_mapping,
                                         a.block_tables, *((tree.host_rope, tree.host_mask) if tree is not None
                                                           else ()))
            inp.pad = T(pad_index)
        return inp

    def _forward(self, inp: StepInputs) -> Forward:
        """The target's forward over the step's tokens, with the held drafts as the verify rows' inputs: a
        graph entry's compiled / captured forward (padded rows) or the eager model."""
        want_hidden = self._capture_layers
        drafts_in = self.spec.verify_inputs(inp.draft_src)
        if inp.entry is not None:
            entry, pad = inp.entry, inp.pad
            if drafts_in is not None:
                entry.input_ids.index_put_((pad[inp.draft_flat],), drafts_in)
            all_logits, hidden, captured = self.graphs.launch(entry, inp.width)
            written = self.tails is not None and self.world_size == 1 and self.tails.writes_context(entry)
            if written and inp.write_context and not inp.tail:     # (a plain entry's tail writes it itself)
                t0 = time.perf_counter()
                self.tails.write_context(entry, captured)
                self.spec.proposer.draft_seconds += time.perf_counter() - t0
            if want_hidden and not inp.tail:   # the eager drafter reads the step's own rows, as positions are
                hidden, captured = hidden[pad], {i: h[pad] for i, h in captured.items()}
            return Forward(hidden, captured, entry.input_ids, pad[inp.logit_rows], all_logits, entry.greedy,
                           context_written=written)
        input_ids = inp.input_ids
        if drafts_in is not None:
            input_ids = input_ids.index_put((inp.draft_flat,), drafts_in)
        with forward_context(PagedAttentionContext(self.cache, inp.meta)):
            hidden, captured = self.model(input_ids, inp.positions, capture_layers=want_hidden)
        return Forward(hidden, captured, input_ids, inp.logit_rows)

    @property
    def _capture_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the forward captures: the serving drafter's and a shadow's."""
        layers = self.spec.hidden_layers
        if self.shadow is not None:
            layers = tuple(sorted(set(layers) | set(self.shadow.hidden_layers)))
        return layers

    def _tail_covers(self, b: StepBatch, entry: GraphEntry) -> bool:
        """Whether this graph step runs the drafted step's compiled tail; a reason it does not is logged once."""
        if self.tails is None:
            return False
        why = self.tails.eligible(b, entry, self.world_size)
        if why is not None and why not in self._eager_reasons:
            self._eager_reasons.add(why)
            logger.info("rank %d: graph mode: steps with %s sample, verify and draft eagerly after the compiled "
                        "forward", self.rank, why)
        return why is None

    def _drafted_tail(self, b: StepBatch, prep: PreparedStep, inp: StepInputs, fwd: Forward) -> dict[str, torch.Tensor]:
        """Sampling, acceptance and the drafter's next block in the entry's compiled tail; the draft buffer's
        gather (q) and write around it are the step's only other device ops."""
        return self._tail_values(b, prep, inp, inp.entry, inp.width, fwd.all_logits, fwd.greedy, fwd.captured)

    def _tail_values(self, b: StepBatch, prep: PreparedStep, inp: StepInputs, entry: GraphEntry, width: int,
                     logits: torch.Tensor, greedy: torch.Tensor, captured: dict[int, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
        sp = b.sampling
        sampled, filtered = not sp.all_greedy, sp.any_top_k_top_p or sp.any_min_p
        t = self.tails.inputs(b, entry, prep.num_drafts, prep.slots, self.spec.drafts, inp.slot_index, sampled)
        tokens, accepted, ids, counts, probs = self.tails.run(entry, width, logits, greedy, captured, t, sampled,
                                                              filtered)
        s, k = len(prep.slots), b.spec.max_drafts
        values = {"tokens": tokens[:s, :k + 1], "accepted": accepted[:s], "num_drafts": t.num_drafts[:s]}
        proposal = Proposal(ids[:s], counts=counts[:s], probs=probs[:s] if probs is not None else None)
        values.update(self.spec.store_proposal(proposal, inp.slot_index, b.spec.max_drafts_next))
        return values

    def _prefill_tail_entry(self, b: StepBatch, inp: StepInputs) -> GraphEntry | None:
        """The plain entry whose compiled tail drafts after this eager step, or None: graph mode, a step that
        verifies nothing (prefills, a request's last prompt chunk sampling its first token) and drafts after
        it, for every sequence the tail covers (greedy, no logprobs, penalties or trees, one rank)."""
        if self.tails is None or inp.entry is not None or b.spec.max_drafts or not b.spec.max_drafts_next:
            return None
        if self.shadow is not None and self.shadow.wants(b):
            return None
        if b.attn.block_tables.shape[1] > self.graphs.max_width:
            return None
        entry = self.graphs.entry_for(len(b.attn.logit_rows), 1)
        if entry is None or self.tails.eligible(b, entry, self.world_size) is not None:
            return None
        return entry

    def _prefill_tail(self, b: StepBatch, prep: PreparedStep, inp: StepInputs, fwd: Forward,
                      entry: GraphEntry) -> dict[str, torch.Tensor]:
        """After an eager step that prefills, the sample and the next block from the plain entry's compiled tail
        (as the step after a plain probe drafts), over the sampled rows loaded as that entry's decode rows: its
        last prompt token, position, cache slot and block table per sequence. The drafter's context of the
        whole chunk was written eagerly; the tail writes the last row's again, to the same values. Eagerly
        the proposal cost about 2 ms of a request's first step at batch 1 (bf16), three compiled tails."""
        a, rows = b.attn, b.attn.logit_rows
        s, bp = len(rows), entry.bp
        width = self.graphs.load(entry, np.arange(s), a.input_ids[rows], a.positions[rows],
                                 prep.slot_mapping[rows], a.block_tables[b.spec.batch_index])
        logits = fwd.hidden.new_zeros((bp, self.model_config.vocab_size), dtype=torch.float32)
        logits[:s] = self.model.compute_logits(fwd.hidden[inp.logit_rows])
        captured = {}
        for i, h in fwd.captured.items():
            captured[i] = h.new_zeros((bp, h.shape[-1]))
            captured[i][:s] = h[inp.logit_rows]
        return self._tail_values(b, prep, inp, entry, width, logits, logits.argmax(dim=-1), captured)

    def _draft_site(self, b: StepBatch, inp: StepInputs) -> DraftSite:
        return DraftSite(positions=inp.positions, slot_mapping=inp.meta.slot_mapping,
                         block_tables=inp.meta.block_tables, batch_index=self._tensor(b.spec.batch_index))

    def _sample(self, b: StepBatch, fwd: Forward, st: SamplingTensors, row_layout: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(logits [R, V] fp32 or None, processed logits, the target's sample at every row [S, K+1])."""
        # Graph mode computed every row's argmax in the compiled forward. It is each greedy row's sample only
        # where nothing changes the logits first (T = 0 and no penalty, bitmask, bias or allowed-token set).
        greedy = fwd.greedy[fwd.logit_rows] if fwd.greedy is not None and leaves_logits_raw(st) else None
        logits = None
        if greedy is None or b.spec.max_drafts or b.sampling.num_logprobs >= 0:
            logits = fwd.all_logits[fwd.logit_rows] if fwd.all_logits is not None else \
                self.model.compute_logits(fwd.hidden[fwd.logit_rows])
        processed = logits if greedy is not None else process_logits(logits, st)
        target = (greedy if greedy is not None else sample_from_processed(processed, st))[row_layout]
        return logits, processed, target

    def _sample_and_verify(self, b: StepBatch, prep: PreparedStep, inp: StepInputs, fwd: Forward,
                           st: SamplingTensors, site: DraftSite | None) -> dict[str, torch.Tensor]:
        """Sample every row, decide how many drafts each sequence keeps, let a device proposer draft the
        next block from the accepted position, and gather logprobs: the result's device values."""
        k, row_layout = b.spec.max_drafts, inp.row_layout
        logits, processed, target = self._sample(b, fwd, st, row_layout)
        if k == 0:
            num_drafts = torch.zeros_like(target[:, 0])
            tokens, accepted = self.spec.shared(target, num_drafts)
        else:
            # Draft j of a sequence is the input right after its first sampled row, plus j.
            at = fwd.logit_rows[row_layout[:, :1]] + 1 + torch.arange(k, device=self.device)
            draft_ids = fwd.input_ids[at.clamp(max=fwd.input_ids.shape[0] - 1)]
            num_drafts = inp.num_drafts
            tokens, accepted = self.spec.accept(processed, target, draft_ids, num_drafts, st, row_layout, prep,
                                                inp.slot_index)
        if self.shadow is not None and processed is not None:
            self.shadow.score_on_device(b, prep, processed, draft_ids if k else None, num_drafts, row_layout)
        values = {"tokens": tokens, "accepted": accepted, "num_drafts": num_drafts}
        if site is not None and b.spec.max_drafts_next:     # the engine's decision: draft now
            values.update(self.spec.propose_on_device(b, prep, fwd.hidden, fwd.captured, inp.logit_rows[row_layout],
                                                      tokens, accepted, site, st, row_layout, inp.slot_index))
            if self.shadow is not None:
                self.shadow.propose(b, inp.logit_rows[row_layout], tokens, accepted, site, st, row_layout)
        if b.sampling.num_logprobs >= 0:
            lp, top_ids, top_lp = gather_logprobs(logits[self.spec.emitted_rows(row_layout)].flatten(0, 1),
                                                  tokens.reshape(-1),
                                                  b.sampling.num_logprobs)
            shape = tuple(row_layout.shape)
            values["logprobs"] = lp.view(shape)
            if top_ids is not None:
                values.update(top_ids=top_ids.view(*shape, -1), top_logprobs=top_lp.view(*shape, -1))
        return values

    def _prompt_logprobs(self, b: StepBatch, inp: StepInputs, fwd: Forward) -> dict[str, torch.Tensor]:
        if inp.plp_rows is None:
            return {}
        lp, top_ids, top_lp = gather_logprobs(self.model.compute_logits(fwd.hidden[inp.plp_rows]), inp.plp_targets,
                                              b.prompt_lp.num)
        values = {"prompt_logprobs": lp}
        if top_ids is not None:
            values.update(prompt_top_ids=top_ids, prompt_top_logprobs=top_lp)
        return values
