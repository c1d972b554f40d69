"""The scheduler's plan -> a StepBatch of flat numpy arrays, one part per function.

Grammar bitmask rows are not built here: `namazu/structured/bitmask.py` fills them for the sampling
rows this module lays out.
"""
from __future__ import annotations

import numpy as np

from namazu.scheduler.scheduler import ScheduledSeq
from namazu.step.batch import (
    PENDING,
    AttentionInputs,
    PromptLogprobInputs,
    SamplingInputs,
    SeqInputs,
    SpecInputs,
    StepBatch,
    attention_layout,
    sampled_row_layout,
)


def _pad(rows: list[list[int]], fill: int) -> np.ndarray:
    width = max(max((len(r) for r in rows), default=0), 1)
    # Padded as lists and converted once: a numpy row assignment per sequence costs more than the data.
    return np.asarray([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64).reshape(len(rows), width)


def _i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def build_step_batch(scheduled: list[ScheduledSeq], vocab_size: int, finished_seq_ids: list[int] | None = None
                     ) -> tuple[StepBatch, list[ScheduledSeq], list[tuple[ScheduledSeq, int]]]:
    """Returns the batch (without grammar bitmask), the sampling sequences in row order, and
    (item, prompt position) per prompt-logprob row."""
    seqs = build_seq_inputs(scheduled)
    attn = build_attention(scheduled, seqs)
    samplers = [item for item in scheduled if item.samples]
    spec = build_spec(scheduled, samplers)
    batch = StepBatch(attn=attn, seqs=seqs, sampling=build_sampling(samplers, vocab_size),
                      spec=spec, prompt_lp=PromptLogprobInputs(np.zeros(0, np.int64), np.zeros(0, np.int64), -1),
                      finished_seq_ids=list(finished_seq_ids or []))
    plp_items = build_prompt_logprobs(batch, scheduled)
    return batch, samplers, plp_items


def build_attention(scheduled: list[ScheduledSeq], seqs: SeqInputs) -> AttentionInputs:
    """Token values (PENDING where only the worker knows one, and for drafts) and block tables; the layout
    is `step_batch.attention_layout`, the one the worker rebuilds from the same counts."""
    input_ids: list[int] = []
    for item in scheduled:
        known = item.seq.token_ids[item.start:item.start + item.num_new_tokens]
        pending = item.num_new_tokens - len(known)
        # Only a decode's single input can be pending: prompt tokens are always known.
        assert pending == 0 or (pending == 1 and item.num_new_tokens == 1), "pending prompt token"
        input_ids += known + [PENDING] * (pending + item.num_drafts)
    return attention_layout(_i64(input_ids), seqs.starts, seqs.num_new, seqs.num_drafts, seqs.samples,
                            _pad([item.seq.block_table for item in scheduled], 0))


def build_seq_inputs(scheduled: list[ScheduledSeq]) -> SeqInputs:
    return SeqInputs(
        seq_ids=_i64([it.seq.seq_id for it in scheduled]), starts=_i64([it.start for it in scheduled]),
        num_new=_i64([it.num_new_tokens for it in scheduled]), num_drafts=_i64([it.num_drafts for it in scheduled]),
        assumed_drafts=_i64([it.assumed_drafts for it in scheduled]),
        prompt_lens=_i64([it.seq.num_prompt_tokens for it in scheduled]),
        samples=np.asarray([it.samples for it in scheduled], dtype=bool),
        num_blocks=_i64([len(it.seq.block_table) for it in scheduled]))


def build_sampling(samplers: list[ScheduledSeq], vocab_size: int) -> SamplingInputs:
    # One row tuple per sampled row, converted once: per-column lists and per-array numpy reductions
    # were a tenth of a batch-1 step's engine-side time.
    floats: list[tuple[float, ...]] = []
    ints: list[tuple[int, int, int]] = []
    biased: list[tuple[int, np.ndarray, np.ndarray]] = []     # (first row, token ids, biases)
    for item in samplers:
        seq, p = item.seq, item.seq.params
        row = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        top_k, seed, counter = (p.top_k if p.top_k > 0 else vocab_size), seq.seed, seq.num_output_tokens
        if p.logit_bias:
            for j in range(item.num_drafts + 1):      # every row of a verify samples under the same bias
                biased.append((len(floats) + j, *p.logit_bias_arrays()))
        for j in range(item.num_drafts + 1):
            floats.append(row)
            ints.append((top_k, seed, counter + j))
    temperature, top_p, min_p, presence, frequency, rep = np.asarray(floats, dtype=np.float32).reshape(-1, 6).T.copy()
    top_k, seeds, counters = np.asarray(ints, dtype=np.int64).reshape(-1, 3).T.copy()
    max_lp = max((it.seq.params.logprobs for it in samplers if it.seq.params.logprobs is not None), default=-1)
    # Flags from the float32 values the sampler will see (a temperature that rounds to 0 is greedy there).
    any_rep = bool((rep != 1).any())
    return SamplingInputs(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=rep, seeds=seeds, counters=counters, bitmask=None,
        any_penalty=bool(any_rep or (presence != 0).any() or (frequency != 0).any()),
        any_repetition_penalty=any_rep,
        any_top_k_top_p=bool((top_k < vocab_size).any() or (top_p < 1).any()),
        any_min_p=bool((min_p > 0).any()), all_greedy=bool((temperature == 0).all()),
        num_logprobs=max_lp, **_bias_coordinates(biased))


def _bias_coordinates(biased: list[tuple[int, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray | None]:
    if not biased:
        return {"bias": None, "bias_values": None}
    rows = np.concatenate([np.full(len(ids), r, np.int64) for r, ids, _ in biased])
    ids = np.concatenate([ids for _, ids, _ in biased])
    return {"bias": np.stack([rows, ids]), "bias_values": np.concatenate([v for _, _, v in biased])}


def build_spec(scheduled: list[ScheduledSeq], samplers: list[ScheduledSeq]) -> SpecInputs:
    index = {id(item): b for b, item in enumerate(scheduled)}
    return SpecInputs(row_layout=sampled_row_layout(_i64([it.num_drafts for it in samplers])),
                      batch_index=_i64([index[id(it)] for it in samplers]),
                      return_drafts=np.asarray([it.seq.grammar is not None and it.seq.grammar.depends_on_values
                                                for it in samplers], dtype=bool))


def build_prompt_logprobs(batch: StepBatch, scheduled: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, int]]:
    rows: list[int] = []
    targets: list[int] = []
    items: list[tuple[ScheduledSeq, int]] = []
    num = -1
    flat0 = 0
    for item in scheduled:
        seq = item.seq
        if seq.params.prompt_logprobs is not None and seq.wants_prompt_logprobs:
            num = max(num, seq.params.prompt_logprobs)
            have = len(seq.prompt_logprobs)   # entries 0..have-1 are done (entry 0 is None)
            for j in range(item.num_new_tokens):
                p = item.start + j
                if have <= p + 1 < seq.num_prompt_tokens:
                    rows.append(flat0 + j)
                    targets.append(seq.token_ids[p + 1])
                    items.append((item, p + 1))
        flat0 += item.num_query_tokens
    batch.prompt_lp = PromptLogprobInputs(_i64(rows), _i64(targets), num)
    return items
