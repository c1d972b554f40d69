"""The model runner: one rank's model, paged KV cache and sampler; executes a StepBatch.

Everything between receiving the batch and returning results runs on the device with no host
synchronisation: forward, sampling, acceptance of drafts, logprobs. The only host read is the final
copy of the results (two flat tensors). `--debug-no-host-sync` wraps the step in the guard that turns
any other read into an error.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from namazu.context import forward_context
from namazu.engine_config import EngineConfig
from namazu.kernels.backends import resolve_moe_runtime
from namazu.kv_cache_paged import PagedAttentionContext, PagedAttentionMetadata, PagedLatentCache, kv_bytes_per_block
from namazu.layers.sampler import SamplingTensors, gather_logprobs, process_logits, sample_from_processed
from namazu.models.loader import load_model
from namazu.nosync import no_host_sync
from namazu.spec.verify import verify_deterministic, verify_stochastic
from namazu.step_io import StepBatch, StepResult

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this torch build or machine has no CUDA device")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str | Path, rank: int = 0, world_size: int = 1):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(config.device)
        # Resolved once, handed to the model's expert modules; "auto" leaves NAMAZU_MOE_BACKEND and
        # NAMAZU_NVFP4_MODE in charge.
        moe_runtime = resolve_moe_runtime(self.device, config.moe_backend, config.nvfp4_mode)
        dtype = config.dtype
        if dtype == "auto" and self.device.type == "cpu":
            # Half-precision matmuls on CPU are slow and less exact; serve bf16/fp16 checkpoints in fp32.
            dtype = "float32"
        self.model = load_model(model_path, dtype=dtype, device=self.device, progress=rank == 0, runtime=moe_runtime)
        self.model_config = self.model.config
        self.dtype = self.model.dtype
        self.block_size = config.block_size
        self.num_blocks = self._plan_kv_blocks()
        self.cache = PagedLatentCache(self.model_config, self.num_blocks, self.block_size, self.dtype, self.device)
        # The last token each sampling sequence emitted in the previous step, kept on the device: the
        # next step's pending inputs (async scheduling) are read from here, never from the host.
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        logger.info("rank %d: KV cache %d blocks x %d tokens (%.1f MiB) on %s", rank, self.num_blocks,
                    self.block_size, self.cache.nbytes / 2**20, self.device)

    def _plan_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Headroom for activations: a step's hidden states and its sampled logits, generously.
            cfg = self.model_config
            act = self.config.max_num_batched_tokens * (24 * cfg.hidden_size + 4 * cfg.vocab_size) * 4
            budget = int(total * self.config.gpu_memory_utilization) - used - act
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

    def _sampling_tensors(self, b: StepBatch) -> SamplingTensors:
        T = self._tensor
        vocab = self.model_config.vocab_size
        counts = prompt_mask = None
        if b.output_tokens is not None:
            ids = T(b.output_tokens)
            counts = torch.zeros(ids.shape[0], vocab, device=self.device).scatter_add_(
                1, ids.clamp(min=0), (ids >= 0).float())
            if b.relay_count_index is not None:
                idx = T(b.relay_count_index)
                pending = self.last_tokens[idx.clamp(min=0)].unsqueeze(-1)
                counts.scatter_add_(1, pending, (idx >= 0).float().unsqueeze(-1))
        if b.prompt_tokens is not None:
            ids = T(b.prompt_tokens)
            prompt_mask = torch.zeros(ids.shape[0], vocab, device=self.device).scatter_add_(
                1, ids.clamp(min=0), (ids >= 0).float()) > 0
        return SamplingTensors(
            temperature=T(b.temperature), top_k=T(b.top_k), top_p=T(b.top_p), min_p=T(b.min_p),
            presence_penalty=T(b.presence_penalty), frequency_penalty=T(b.frequency_penalty),
            repetition_penalty=T(b.repetition_penalty), seeds=T(b.seeds), counters=T(b.counters),
            output_counts=counts, prompt_mask=prompt_mask, bitmask=T(b.bitmask), any_penalty=b.any_penalty,
            any_top_k_top_p=b.any_top_k_top_p, any_min_p=b.any_min_p, all_greedy=b.all_greedy,
            num_logprobs=-1)

    @torch.inference_mode()
    def execute(self, b: StepBatch) -> StepResult:
        T = self._tensor
        meta = PagedAttentionMetadata(slot_mapping=T(b.slot_mapping), block_tables=T(b.block_tables),
                                      q_index=T(b.q_index), q_pos=T(b.q_pos), out_index=T(b.out_index))
        input_ids, positions, logit_rows = T(b.input_ids), T(b.positions), T(b.logit_rows)
        row_layout, num_drafts, draft_ids = T(b.row_layout), T(b.num_drafts), T(b.draft_ids)
        draft_probs = T(b.draft_probs)
        plp_rows, plp_targets = T(b.prompt_lp_rows), T(b.prompt_lp_targets)
        t0 = time.perf_counter()
        with no_host_sync(self.config.debug_no_host_sync):
            if np.any(b.relay_index >= 0):   # host-side array: no sync
                relay = T(b.relay_index)
                input_ids = torch.where(relay >= 0, self.last_tokens[relay.clamp(min=0)], input_ids)
            st = self._sampling_tensors(b)
            with forward_context(PagedAttentionContext(self.cache, meta)):
                hidden, _ = self.model(input_ids, positions)
            ints, floats = [], []
            self.last_tokens = self.last_tokens[:0]
            if len(b.logit_rows):
                logits = self.model.compute_logits(hidden[logit_rows])           # [R, V] fp32
                processed = process_logits(logits, st)
                target = sample_from_processed(processed, st)[row_layout]         # [S, K+1]
                if draft_ids.shape[1] == 0:
                    tokens, accepted = target, torch.zeros_like(target[:, 0])
                elif draft_probs is None:
                    tokens, accepted = verify_deterministic(target, draft_ids, num_drafts)
                else:
                    first = row_layout[:, 0]
                    tokens, accepted = verify_stochastic(
                        processed[row_layout], target, draft_ids, draft_probs, num_drafts,
                        st.temperature[first] == 0, st.seeds[first], st.counters[row_layout])
                ints += [tokens.reshape(-1), accepted]
                self.last_tokens = tokens.gather(1, accepted.unsqueeze(-1)).squeeze(-1)
                if b.num_logprobs >= 0:
                    lp, top_ids, top_lp = gather_logprobs(logits[row_layout].flatten(0, 1), tokens.reshape(-1),
                                                          b.num_logprobs)
                    floats.append(lp)
                    if top_ids is not None:
                        ints.append(top_ids.reshape(-1))
                        floats.append(top_lp.reshape(-1))
            if b.num_prompt_logprobs >= 0 and len(b.prompt_lp_rows):
                plogits = self.model.compute_logits(hidden[plp_rows])
                lp, top_ids, top_lp = gather_logprobs(plogits, plp_targets, b.num_prompt_logprobs)
                floats.append(lp)
                if top_ids is not None:
                    ints.append(top_ids.reshape(-1))
                    floats.append(top_lp.reshape(-1))
            flat_i = torch.cat(ints) if ints else torch.zeros(0, dtype=torch.long, device=self.device)
            flat_f = torch.cat([f.float() for f in floats]) if floats else torch.zeros(0, device=self.device)
        # The step's one host read.
        host_i, host_f = flat_i.cpu().numpy(), flat_f.cpu().numpy()
        logger.debug("step: %d tokens, %d sampled rows, %.1f ms", b.num_tokens, len(b.logit_rows),
                     1e3 * (time.perf_counter() - t0))
        return _unpack(b, host_i, host_f)


def _unpack(b: StepBatch, ints: np.ndarray, floats: np.ndarray) -> StepResult:
    """Splits the two flat host arrays back into per-sequence lists (inverse of the packing above)."""
    s, k1 = b.row_layout.shape
    res = StepResult(tokens=[], accepted=[])
    io = fo = 0
    if len(b.logit_rows):
        res.tokens = ints[: s * k1].reshape(s, k1).tolist()
        res.accepted = ints[s * k1: s * k1 + s].tolist()
        io = s * k1 + s
        if b.num_logprobs >= 0:
            res.logprobs = floats[: s * k1].reshape(s, k1).tolist()
            fo = s * k1
            if b.num_logprobs > 0:
                n = b.num_logprobs
                res.top_ids = ints[io: io + s * k1 * n].reshape(s, k1, n).tolist()
                res.top_logprobs = floats[fo: fo + s * k1 * n].reshape(s, k1, n).tolist()
                io += s * k1 * n
                fo += s * k1 * n
    if b.num_prompt_logprobs >= 0 and len(b.prompt_lp_rows):
        p = len(b.prompt_lp_rows)
        res.prompt_logprobs = floats[fo: fo + p].tolist()
        fo += p
        if b.num_prompt_logprobs > 0:
            n = b.num_prompt_logprobs
            res.prompt_top_ids = ints[io: io + p * n].reshape(p, n).tolist()
            res.prompt_top_logprobs = floats[fo: fo + p * n].reshape(p, n).tolist()
    return res
