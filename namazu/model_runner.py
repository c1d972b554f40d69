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
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from namazu.context import forward_context
from namazu.cpu_threads import apply_threads
from namazu.distributed.decisions import share_decision, share_device_proposal
from namazu.engine_config import EngineConfig
from namazu.kernels.backends import resolve_moe_runtime
from namazu.kv_cache_paged import PagedAttentionContext, PagedAttentionMetadata, PagedLatentCache, kv_bytes_per_block
from namazu.layers.cpu_layout import use_k_major_linears
from namazu.layers.sampler import (
    SamplingTensors,
    gather_logprobs,
    leaves_logits_raw,
    process_logits,
    sample_from_processed,
)
from namazu.layers.weight_loading import TPShard
from namazu.models.loader import load_model
from namazu.nosync import no_host_sync
from namazu.spec.proposer import DraftBuffer, Proposer, ProposerInput
from namazu.spec.verify import verify_deterministic, verify_stochastic
from namazu.step_batch import StepBatch, StepResult, pack, result_layout, trim_drafts, unpack
from namazu.step_graphs import StepGraphs
from namazu.worker_seqs import PreparedStep, WorkerSeqTable

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
        # Under tensor parallelism the sampled tokens, the acceptance counts and a device proposer's
        # drafts are rank 0's, broadcast: every rank commits the same tokens even if its logits differ
        # in the last bit (tests switch this off to show what it prevents).
        self.share_decisions = world_size > 1
        self.model_config = self.model.config
        self.dtype = self.model.dtype
        self.block_size = config.block_size
        self.num_blocks = 0
        self.cache: PagedLatentCache | None = None
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens if proposer is not None else 0
        self.drafts = DraftBuffer(self.num_speculative_tokens, self.model_config.vocab_size, self.device)
        self.seqs = WorkerSeqTable()
        self._empty_i = torch.zeros(0, dtype=torch.long, device=self.device)
        self._empty_f = torch.zeros(0, device=self.device)
        # Per-step timestamps for bench/step_profile.py: a list turns recording on (None: off, free).
        self.profile: list[StepTiming] | None = None
        self.graphs: StepGraphs | None = None
        self.graph_mode = not config.enforce_eager if config.enforce_eager is not None else self.device.type == "cuda"
        self._device_stochastic = False     # the device proposer's last drafts came with q

    def plan_kv_blocks(self) -> int:
        """How many KV blocks this rank could hold; the engine allocates the minimum over ranks."""
        return self._plan_kv_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = PagedLatentCache(self.model_config, num_blocks, self.block_size, self.dtype, self.device)
        logger.info("rank %d: KV cache %d blocks x %d tokens (%.1f MiB) on %s", self.rank, num_blocks,
                    self.block_size, self.cache.nbytes / 2**20, self.device)
        if hasattr(self.proposer, "attach"):
            self.proposer.attach(self.model, num_blocks, self.block_size)
        if self.graph_mode:
            self._build_graphs()
        else:
            logger.info("rank %d: eager mode (%s)", self.rank, "--enforce-eager" if self.config.enforce_eager
                        else "the default on CPU; --no-enforce-eager compiles decode and verify steps")

    def _build_graphs(self) -> None:
        cfg = self.model_config
        longest = cfg.max_position_embeddings + self.num_speculative_tokens
        want_hidden = self.proposer.hidden_layers if self.proposer is not None and self.proposer.on_device else ()
        # NAMAZU_GRAPH_BACKEND: torch.compile backend on CPU (tests use "eager": the same fullgraph trace over
        # the same buffers, without inductor's minutes of code generation).
        self.graphs = StepGraphs(self.model, self.cache, self.device, self.config.max_num_seqs,
                                 self.num_speculative_tokens, min(self.num_blocks, -(-longest // self.block_size)),
                                 want_hidden, backend=os.environ.get("NAMAZU_GRAPH_BACKEND", "inductor"))
        seconds = self.graphs.warm_up(progress=self.rank == 0)
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
        if not (np.all(sq.num_new == 1) and np.all(sq.samples)) or int(sq.num_drafts.max()) > g.k:
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
        if hasattr(self.proposer, "kv_bytes_per_block"):     # a drafter's context cache shares the blocks
            per_block += self.proposer.kv_bytes_per_block(self.block_size, self.dtype)
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
        worker's own histories (row j of a verify also counts drafts[:j])."""
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
            drafts = self.drafts.host_ids.get(int(prep.slots[s]), [])
            penalized = sp.presence_penalty[rows[s, 0]] != 0 or sp.frequency_penalty[rows[s, 0]] != 0 \
                or sp.repetition_penalty[rows[s, 0]] != 1
            if not penalized:
                continue
            for j in range(int(b.seqs.num_drafts[i]) + 1):
                outputs[rows[s, j]] = done + drafts[:j]
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

    def _draft_probs(self, prep: PreparedStep, draft_ids: torch.Tensor) -> torch.Tensor | None:
        """q [S, K, V] when any sequence's drafts came with a distribution (one-hot for the others)."""
        flags = [self.drafts.has_probs.get(int(slot), False) for slot in prep.slots]
        if not any(flags) or draft_ids.shape[1] == 0 or self.drafts.probs is None:
            return None
        k = draft_ids.shape[1]
        q = self.drafts.probs[self._tensor(prep.slots), :k]
        onehot = torch.nn.functional.one_hot(draft_ids, self.model_config.vocab_size).float()
        has = self._tensor(np.asarray(flags)).view(-1, 1, 1)
        return torch.where(has, q, onehot)

    @torch.inference_mode()
    def execute(self, b: StepBatch) -> StepResult:
        t_arrive = time.perf_counter()
        freed = [self.seqs.seqs[sid].slot for sid in b.finished_seq_ids if sid in self.seqs.seqs]
        for slot in freed:
            self.drafts.forget(slot)
        planned = b.seqs.num_drafts
        b = self._verify_held_drafts_only(b)
        prep = self.seqs.prepare(b, self.block_size, self.drafts.width, self.drafts.counts)
        self.drafts.ensure(self.seqs.num_slots)
        T, a = self._tensor, b.attn
        device_proposer = self.proposer is not None and self.proposer.on_device
        layout = self._graph_layout(b, prep)
        # Each input costs a host-to-device copy (on CPU, a tensor wrapper: still a few microseconds): a graph
        # step reads its inputs from the entry's buffers, so the flat ones are built only for an eager
        # forward or a device proposer; speculation-only inputs only when the step verifies.
        meta = input_ids = positions = None
        if layout is None or device_proposer:
            meta = PagedAttentionMetadata(slot_mapping=T(prep.slot_mapping), block_tables=T(a.block_tables),
                                          q_index=T(a.q_index), q_pos=T(a.q_pos), out_index=T(a.out_index))
            input_ids, positions = T(a.input_ids), T(a.positions)
        logit_rows = real_rows = T(a.logit_rows)    # real_rows: the step's own rows, also in graph mode
        row_layout = T(b.spec.row_layout)
        plp_rows = plp_targets = None
        if b.prompt_lp.num >= 0 and len(b.prompt_lp.rows):
            plp_rows, plp_targets = T(b.prompt_lp.rows), T(b.prompt_lp.targets)
        has_drafts = len(prep.draft_flat) > 0
        num_drafts = T(prep.num_drafts) if b.spec.max_drafts else None
        draft_flat, draft_src = (T(prep.draft_flat), T(prep.draft_src)) if has_drafts else (None, None)
        want_hidden = self.proposer.hidden_layers if device_proposer else ()
        if layout is not None:
            entry, pad_index = layout
            width = self.graphs.load(entry, pad_index, a.input_ids, a.positions, prep.slot_mapping, a.block_tables)
            pad = T(pad_index)
        t0 = time.perf_counter()
        events = None
        if self.profile is not None and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        drafter_t0 = getattr(self.proposer, "draft_seconds", 0.0)
        values: dict[str, torch.Tensor] = {}
        with no_host_sync(self.config.debug_no_host_sync):
            st = self._sampling_tensors(b, prep)
            k = b.spec.max_drafts
            drafts_in = self.drafts.ids.view(-1)[draft_src] if has_drafts else None
            if layout is not None:
                # Graph mode: the entry's buffers hold the step (padded rows); drafts go in place.
                if drafts_in is not None:
                    entry.input_ids.index_put_((pad[draft_flat],), drafts_in)
                all_logits, hidden, captured = self.graphs.launch(entry, width)
                if want_hidden:     # a device proposer reads the step's own rows, as positions and slots are
                    hidden, captured = hidden[pad], {i: h[pad] for i, h in captured.items()}
                input_ids, logit_rows = entry.input_ids, pad[logit_rows]
            else:
                if drafts_in is not None:
                    # Verify inputs: the drafts proposed last step, read from the device buffer.
                    input_ids = input_ids.index_put((draft_flat,), drafts_in)
                with forward_context(PagedAttentionContext(self.cache, meta)):
                    hidden, captured = self.model(input_ids, positions, capture_layers=want_hidden)
            tokens = accepted = None
            where = None
            if device_proposer:
                where = dict(positions=positions, slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                             batch_index=T(b.spec.batch_index))
            if hasattr(self.proposer, "extend_context"):
                self.proposer.extend_context(self._proposer_input(b, hidden, captured, None, None, None, where))
            if len(a.logit_rows):
                # Graph mode computed every row's argmax in the compiled forward: the greedy rows' samples.
                greedy = entry.greedy[logit_rows] if layout is not None and leaves_logits_raw(st) else None
                logits = None if greedy is not None and k == 0 and b.sampling.num_logprobs < 0 else \
                    all_logits[logit_rows] if layout is not None else \
                    self.model.compute_logits(hidden[logit_rows])                 # [R, V] fp32
                processed = logits if greedy is not None else process_logits(logits, st)
                target = (greedy if greedy is not None else sample_from_processed(processed, st))[row_layout]
                if k == 0:
                    tokens, accepted = target, torch.zeros_like(target[:, 0])
                    num_drafts = accepted
                else:
                    # Draft j of a sequence is the input right after its first sampled row, plus j.
                    at = logit_rows[row_layout[:, :1]] + 1 + torch.arange(k, device=self.device)
                    draft_ids = input_ids[at.clamp(max=input_ids.shape[0] - 1)]
                    q = self._draft_probs(prep, draft_ids)
                    if q is None:
                        tokens, accepted = verify_deterministic(target, draft_ids, num_drafts)
                    else:
                        first = row_layout[:, 0]
                        tokens, accepted = verify_stochastic(
                            processed[row_layout], target, draft_ids, q, num_drafts,
                            st.temperature[first] == 0, st.seeds[first], st.counters[row_layout])
                if self.share_decisions:
                    tokens, accepted = share_decision(tokens, accepted, self.world_size)
                values.update(tokens=tokens, accepted=accepted, num_drafts=num_drafts)
                if device_proposer and b.spec.max_drafts_next:     # the engine's decision: draft now
                    where.update(all_greedy=bool(b.sampling.all_greedy))
                    if not b.sampling.all_greedy:      # what a proposer that draws reads
                        first = row_layout[:, 0]
                        where.update(temperature=st.temperature[first], seeds=st.seeds[first],
                                     counters=st.counters[row_layout])
                    values.update(self._propose_on_device(b, prep, hidden, captured, real_rows[row_layout],
                                                          tokens, accepted, where))
                if b.sampling.num_logprobs >= 0:
                    lp, top_ids, top_lp = gather_logprobs(logits[row_layout].flatten(0, 1), tokens.reshape(-1),
                                                          b.sampling.num_logprobs)
                    s_k1 = tuple(row_layout.shape)
                    values["logprobs"] = lp.view(s_k1)
                    if top_ids is not None:
                        values["top_ids"] = top_ids.view(*s_k1, -1)
                        values["top_logprobs"] = top_lp.view(*s_k1, -1)
            if b.prompt_lp.num >= 0 and len(b.prompt_lp.rows):
                plogits = self.model.compute_logits(hidden[plp_rows])
                lp, top_ids, top_lp = gather_logprobs(plogits, plp_targets, b.prompt_lp.num)
                values["prompt_logprobs"] = lp
                if top_ids is not None:
                    values.update(prompt_top_ids=top_ids, prompt_top_logprobs=top_lp)
            layout_out = result_layout(b)
            flat_i, flat_f = pack(layout_out, values, torch.cat, self._empty_i, self._empty_f)
            flat_f = flat_f.float()
        if events is not None:
            events[1].record()
        # The step's one host read.
        result = unpack(layout_out, flat_i.cpu().numpy(), flat_f.cpu().numpy())
        t_computed = time.perf_counter()
        if result.tokens is not None:
            self.seqs.record(b, prep, result.tokens, result.accepted, planned)
            self._propose(b, prep, result, hidden, captured, row_layout, tokens, accepted)
        t_end = time.perf_counter()
        if self.profile is not None:
            self.profile.append(StepTiming(t_arrive, t0, t_computed, t_end, b.num_tokens, layout is not None,
                                           events[0].elapsed_time(events[1]) / 1e3 if events else None))
        result.drafter_seconds = getattr(self.proposer, "draft_seconds", 0.0) - drafter_t0
        logger.debug("step: %d tokens, %d sampled rows, %.1f ms", b.num_tokens, len(a.logit_rows),
                     1e3 * (t_end - t0))
        return result

    def _verify_held_drafts_only(self, b: StepBatch) -> StepBatch:
        """The batch without the verify rows of drafts the proposer did not make: async scheduling plans a
        verify of all k before the step that drafts them has returned, and a block may end early
        (`--speculative-min-confidence`) or not be drafted at all. Those rows could never be accepted;
        scoring them would cost as much as real drafts. Every rank must trim alike (their collectives need
        the same shapes): the counts are rank 0's wherever decisions are shared, so without sharing (a
        test's switch) the planned batch runs as it is."""
        if not b.spec.max_drafts or (self.world_size > 1 and not self.share_decisions):
            return b
        sq = b.seqs
        held = np.asarray([self.drafts.counts.get(self.seqs.seqs[sid].slot, 0) if sid in self.seqs.seqs else 0
                           for sid in sq.seq_ids.tolist()], dtype=np.int64)
        keep = np.minimum(sq.num_drafts, held)
        return b if np.array_equal(keep, sq.num_drafts) else trim_drafts(b, keep)

    def _proposer_input(self, b: StepBatch, hidden: torch.Tensor | None, captured: dict[int, torch.Tensor],
                        rows: torch.Tensor | None, tokens: torch.Tensor | None, accepted: torch.Tensor | None,
                        where: dict | None = None) -> ProposerInput:
        """`where` given: a device proposer's call, inside the step, where the histories are not updated yet
        and a device proposer works from tensors: none are collected."""
        sq, idx = b.seqs, b.spec.batch_index
        return ProposerInput(
            seq_ids=[int(sq.seq_ids[i]) for i in idx], prompt_lens=[int(sq.prompt_lens[i]) for i in idx],
            histories=[] if where is not None else [self.seqs.seqs[int(sq.seq_ids[i])].tokens for i in idx],
            hidden=captured, final_hidden=hidden, rows=rows, tokens=tokens, accepted=accepted, **(where or {}))

    def _propose_on_device(self, b: StepBatch, prep: PreparedStep, hidden: torch.Tensor,
                           captured: dict[int, torch.Tensor], rows: torch.Tensor, tokens: torch.Tensor,
                           accepted: torch.Tensor, where: dict) -> dict[str, torch.Tensor]:
        """A device proposer drafts from this forward's hidden states before the host read; its ids stay
        in the draft buffer and only their counts (and grammar sequences' ids) join the result."""
        inp = self._proposer_input(b, hidden, captured, rows, tokens, accepted, where)
        proposal = self.proposer.propose(inp, self.num_speculative_tokens)
        if self.share_decisions:
            proposal = share_device_proposal(proposal, self.world_size)
        self._device_stochastic = proposal.probs is not None
        ids = proposal.ids
        counts = proposal.counts if proposal.counts is not None else torch.full(
            (ids.shape[0],), ids.shape[1], dtype=torch.long, device=self.device)
        self.drafts.write_device(self._tensor(prep.slots), proposal)
        width = b.spec.max_drafts_next
        if ids.shape[1] != width:       # the result declares [S, max_drafts_next]
            padded = torch.zeros(ids.shape[0], width, dtype=torch.long, device=self.device)
            padded[:, :ids.shape[1]] = ids[:, :width]
            ids = padded
        return {"next_num_drafts": counts, "next_draft_ids": ids}

    def _propose(self, b: StepBatch, prep: PreparedStep, result: StepResult, hidden: torch.Tensor,
                 captured: dict[int, torch.Tensor], row_layout: torch.Tensor, tokens: torch.Tensor,
                 accepted: torch.Tensor) -> None:
        """Drafts for the next step, into the draft buffer; the engine learns how many (and, for grammar
        sequences, which)."""
        if self.proposer is None:
            return
        if self.proposer.on_device:
            if result.next_num_drafts is None:
                # Told not to draft this step (too many sequences running): drafts held from an earlier
                # step must not be verified after this one's tokens.
                result.next_num_drafts = np.zeros(len(prep.slots), dtype=np.int64)
                result.next_draft_ids = np.zeros((len(prep.slots), 0), dtype=np.int64)
            self.drafts.note_device_counts(prep.slots, result.next_num_drafts, result.next_draft_ids,
                                           stochastic=self._device_stochastic)
        else:
            proposal = self.proposer.propose(self._proposer_input(b, None, {}, None, None, None),
                                             self.num_speculative_tokens)
            result.next_num_drafts = self.drafts.write(prep.slots, proposal)
        if b.spec.return_drafts.any():
            result.next_draft_ids = [self.drafts.host_ids[int(slot)] if b.spec.return_drafts[s] else []
                                     for s, slot in enumerate(prep.slots)]
        else:
            result.next_draft_ids = None
