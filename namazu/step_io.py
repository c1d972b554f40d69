"""What crosses the engine <-> worker boundary each step: the batch (host-built) and its results.

The engine turns the scheduler's plan into flat numpy arrays once (`build_step_batch`); every worker
rank receives the same StepBatch, copies it to its device and runs the step without reading anything
back; rank 0 returns a StepResult of plain lists, the one host read of the step.

Layout: N query tokens (prefill chunks, decodes, verify rows: last token + drafts) flat; B sequences
padded to [B, Tq] for attention; R rows whose logits are sampled (1 per decode/prefill end, 1 + k per
verify); S sampling sequences, each owning rows row_layout[s, :1 + k_s].

Async scheduling: a decode whose input token is still pending (sampled by the step in flight) reads it
on the device: `relay_index` names the sampling sequence of the previous step that produced it, and
`relay_count_index` adds it to the penalty counts of the rows that need it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from namazu.scheduler.scheduler import ScheduledSeq


@dataclass
class StepBatch:
    input_ids: np.ndarray          # [N]
    positions: np.ndarray          # [N]
    slot_mapping: np.ndarray       # [N]
    block_tables: np.ndarray       # [B, M]
    q_index: np.ndarray            # [B, Tq]
    q_pos: np.ndarray              # [B, Tq]
    out_index: np.ndarray          # [N]
    logit_rows: np.ndarray         # [R] indices into N
    relay_index: np.ndarray        # [N] previous step's sampling sequence whose last token is this input, or -1
    # -- sampling, per row ----------------------------------------------------------------------------
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    output_tokens: np.ndarray | None   # [R, Lo] generated tokens (+ earlier drafts), -1 padded
    prompt_tokens: np.ndarray | None   # [R, Lp] prompt tokens, -1 padded (repetition penalty)
    bitmask: np.ndarray | None         # [R, W] int32
    relay_count_index: np.ndarray | None  # [R] pending token to add to output_tokens' counts, or -1
    any_penalty: bool
    any_top_k_top_p: bool
    any_min_p: bool
    all_greedy: bool
    num_logprobs: int                  # -1 = no logprobs at all
    # -- verify ---------------------------------------------------------------------------------------
    row_layout: np.ndarray             # [S, K+1] indices into R (padding repeats row 0 of the sequence)
    num_drafts: np.ndarray             # [S]
    draft_ids: np.ndarray              # [S, K]
    draft_probs: np.ndarray | None     # [S, K, V] or None (deterministic drafts)
    # -- prompt logprobs ------------------------------------------------------------------------------
    prompt_lp_rows: np.ndarray         # [P] indices into N
    prompt_lp_targets: np.ndarray      # [P] the next prompt token at each of those rows
    num_prompt_logprobs: int           # -1 = none

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepResult:
    tokens: list[list[int]]                       # [S][K+1]; a sequence emits tokens[s][:accepted[s] + 1]
    accepted: list[int]                           # [S]
    logprobs: list[list[float]] | None = None     # [S][K+1] raw logprob of each emitted token
    top_ids: list[list[list[int]]] | None = None  # [S][K+1][n]
    top_logprobs: list[list[list[float]]] | None = None
    prompt_logprobs: list[float] | None = None    # [P]
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


def _pad(rows: list[list[int]], fill: int = -1) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def build_step_batch(scheduled: list[ScheduledSeq], block_size: int, vocab_size: int, stop_ids: list[int],
                     prev_rows: dict[int, int] | None = None
                     ) -> tuple[StepBatch, list[ScheduledSeq], list[tuple[ScheduledSeq, int]]]:
    """Returns the batch, the sampling sequences in row order, and (item, position) per prompt-logprob row.

    `stop_ids` are the end-of-sequence tokens, banned through the bitmask while min_tokens is unmet.
    `prev_rows` maps seq_id -> sampling row of the step in flight, for sequences with a pending token."""
    prev_rows = prev_rows or {}
    input_ids: list[int] = []
    relay: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_rows: list[list[int]] = []
    q_pos_rows: list[list[int]] = []
    out_index: list[int] = []
    tables = []
    logit_rows: list[int] = []
    samplers: list[ScheduledSeq] = []
    layouts: list[list[int]] = []
    drafts: list[list[int]] = []
    plp_rows: list[int] = []
    plp_targets: list[int] = []
    plp_items: list[tuple[ScheduledSeq, int]] = []
    num_plp = -1
    tq = max(item.num_query_tokens for item in scheduled)
    # Per sampled row.
    row_params: list[tuple] = []
    row_outputs: list[list[int]] = []
    row_prompts: list[list[int]] = []
    row_allowed: list[list[int] | None] = []      # allowed_token_ids
    row_banned: list[list[int]] = []              # end tokens while min_tokens is unmet
    row_relay: list[int] = []                     # pending token to count for penalties
    any_draft_probs = any(item.draft_probs is not None for item in scheduled)

    for b, item in enumerate(scheduled):
        seq = item.seq
        start = item.start
        toks = seq.token_ids[start:start + item.num_new_tokens]
        pending = item.num_new_tokens - len(toks)
        # Only a decode's single input can be pending: prefill tokens are always known.
        assert pending == 0 or (pending == 1 and item.num_new_tokens == 1), "pending prompt token"
        relay += [-1] * len(toks) + ([prev_rows[seq.seq_id]] if pending else [])
        relay += [-1] * len(item.draft_token_ids)
        toks = toks + [0] * pending + item.draft_token_ids
        flat0 = len(input_ids)
        pos = list(range(start, start + len(toks)))
        input_ids += toks
        positions += pos
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        q_rows.append(list(range(flat0, flat0 + len(toks))))
        q_pos_rows.append(pos)
        out_index += [b * tq + j for j in range(len(toks))]
        tables.append(table)
        params = seq.params
        if params.prompt_logprobs is not None and seq.wants_prompt_logprobs:
            num_plp = max(num_plp, params.prompt_logprobs)
            have = len(seq.prompt_logprobs)   # entries 0..have-1 are done (entry 0 is None)
            for j, p in enumerate(pos[:item.num_new_tokens]):
                if have <= p + 1 < seq.num_prompt_tokens:
                    plp_rows.append(flat0 + j)
                    plp_targets.append(seq.token_ids[p + 1])
                    plp_items.append((item, p + 1))
        if not item.samples:
            continue
        k = len(item.draft_token_ids)
        first = len(logit_rows)
        logit_rows += list(range(flat0 + item.num_new_tokens - 1, flat0 + len(toks)))
        layouts.append(list(range(first, first + k + 1)))
        drafts.append(item.draft_token_ids)
        samplers.append(item)
        penalized = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        banned_ids = list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(stop_ids))
        for j in range(k + 1):
            n_out = seq.num_output_tokens + j
            row_params.append((params.temperature, params.top_k if params.top_k > 0 else vocab_size,
                               params.top_p, params.min_p, params.presence_penalty, params.frequency_penalty,
                               params.repetition_penalty, seq.seed, n_out))
            # Token histories only for rows that use them (copying every output each step is O(n^2)).
            row_outputs.append(seq.output_token_ids + item.draft_token_ids[:j] if penalized else [])
            row_relay.append(prev_rows[seq.seq_id] if seq.num_pending and penalized else -1)
            row_prompts.append(seq.prompt_token_ids if params.repetition_penalty != 1 else [])
            row_allowed.append(params.allowed_token_ids)
            row_banned.append(banned_ids if n_out < params.min_tokens else [])

    kmax = max((len(d) for d in drafts), default=0)
    row_layout = np.zeros((len(samplers), kmax + 1), dtype=np.int64)
    for i, lay in enumerate(layouts):
        row_layout[i, :] = lay[0]
        row_layout[i, :len(lay)] = lay
    draft_ids = np.zeros((len(samplers), kmax), dtype=np.int64)
    for i, d in enumerate(drafts):
        draft_ids[i, :len(d)] = d
    draft_probs = None
    if any_draft_probs and kmax:
        draft_probs = np.zeros((len(samplers), kmax, vocab_size), dtype=np.float32)
        for i, item in enumerate(samplers):
            k = len(item.draft_token_ids)
            if item.draft_probs is not None:
                draft_probs[i, :k] = np.asarray(item.draft_probs, dtype=np.float32)[:k]
            else:   # a deterministic draft inside a stochastic batch: q is one-hot
                draft_probs[i, np.arange(k), item.draft_token_ids] = 1.0

    params_arr = np.asarray(row_params, dtype=np.float64).reshape(-1, 9)
    temps = params_arr[:, 0].astype(np.float32)
    top_k = params_arr[:, 1].astype(np.int64)
    top_p = params_arr[:, 2].astype(np.float32)
    min_p = params_arr[:, 3].astype(np.float32)
    pres, freq, rep = (params_arr[:, i].astype(np.float32) for i in (4, 5, 6))
    seeds = np.asarray([p[7] for p in row_params], dtype=np.int64)
    counters = np.asarray([p[8] for p in row_params], dtype=np.int64)
    any_penalty = bool(np.any(pres != 0) or np.any(freq != 0) or np.any(rep != 1))
    bitmask = None
    if any(a is not None for a in row_allowed) or any(row_banned):
        words = -(-vocab_size // 32)
        allowed = np.ones((len(row_allowed), words * 32), dtype=bool)
        for i, (ids, banned) in enumerate(zip(row_allowed, row_banned)):
            if ids is not None:
                allowed[i] = False
                allowed[i, ids] = True
            allowed[i, banned] = False
        allowed[:, vocab_size:] = False
        # Bit j of word w is token 32w + j (xgrammar's layout): little-endian bits in little-endian words.
        bitmask = np.packbits(allowed, axis=-1, bitorder="little").view("<u4").view(np.int32)

    max_lp = max((it.seq.params.logprobs for it in samplers if it.seq.params.logprobs is not None), default=-1)
    return StepBatch(
        input_ids=np.asarray(input_ids, dtype=np.int64), positions=np.asarray(positions, dtype=np.int64),
        slot_mapping=np.asarray(slots, dtype=np.int64), block_tables=_pad(tables, 0),
        q_index=_pad(q_rows, 0), q_pos=_pad(q_pos_rows, -1), out_index=np.asarray(out_index, dtype=np.int64),
        logit_rows=np.asarray(logit_rows, dtype=np.int64), relay_index=np.asarray(relay, dtype=np.int64),
        temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=pres,
        frequency_penalty=freq, repetition_penalty=rep, seeds=seeds, counters=counters,
        output_tokens=_pad(row_outputs) if any_penalty else None,
        prompt_tokens=_pad(row_prompts) if any_penalty and np.any(rep != 1) else None,
        bitmask=bitmask, any_penalty=any_penalty,
        relay_count_index=(np.asarray(row_relay, dtype=np.int64)
                           if any_penalty and any(r >= 0 for r in row_relay) else None),
        any_top_k_top_p=bool(np.any(top_k < vocab_size) or np.any(top_p < 1)),
        any_min_p=bool(np.any(min_p > 0)), all_greedy=bool(np.all(temps == 0)), num_logprobs=max_lp,
        row_layout=row_layout, num_drafts=np.asarray([len(d) for d in drafts], dtype=np.int64),
        draft_ids=draft_ids, draft_probs=draft_probs,
        prompt_lp_rows=np.asarray(plp_rows, dtype=np.int64), prompt_lp_targets=np.asarray(plp_targets, dtype=np.int64),
        num_prompt_logprobs=num_plp,
    ), samplers, plp_items

