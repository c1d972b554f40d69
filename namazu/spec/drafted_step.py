"""The drafted step after the target's forward, as one static-shape function: sampling at every verify row,
the acceptance rule, the drafter's context update and its proposal of the next block. A plain entry's step
that drafts (drafting resumes after a step that did not draft) runs it too, greedy rows only: its one row
per sequence is the sample, nothing is verified.

Graph mode runs it per ladder entry of a verify step (Bp sequences x Tq = 1 + K rows, sequence b owning
rows [b * Tq, (b + 1) * Tq)) as a compiled graph (`worker/drafted_graph.py`) right after the entry's
compiled forward, over the forward's outputs and the entry's buffers: no host read, no Python branch on
a device value, no shape that depends on the step. What varies per step is data, never shape:
- a sequence verifying fewer than K drafts (a block that ended early, a trimmed verify) has its extra rows
  as padding (query position -1, the scratch cache slot) and `num_drafts` masks them out of the rule;
- sequences Bp - S .. Bp - 1 are padding: their rows write the scratch slot of both caches, their
  results are dropped;
- per-row sampling settings are tensors (temperature, top-k, top-p, min-p, seeds, counters), applied to
  every row whether or not a request set them (identity values where it did not);
- a grammar's allowed tokens are a bitmask row per verify row (filled by the engine along the drafts, as
  for an eager step), all bits set on the rows of sequences without a grammar and on padding.
Three variants are compiled: every sequence greedy (the forward's argmax is each row's sample, drafts walk
greedily), sampled, and sampled without top-k, top-p and min-p (no row of the batch sets them); each again
with a bitmask input for batches that hold a grammar sequence (greedy:
the argmax of the allowed tokens). The rule is `spec/verify.py`'s, per row: exact match against the target's own
seeded sample where the row is greedy, its request gave a seed, or its drafts came without q; the
lossless rejection rule with the drafter's q elsewhere; so eager and graph mode make the same decision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from namazu.layers.sampler import SamplingTensors, apply_bitmask, process_logits, sample_from_processed, seeded_rows
from namazu.spec.proposer import Proposal, ProposerInput
from namazu.spec.verify import verify_deterministic, verify_stochastic


@dataclass
class TailInputs:
    """One step's per-sequence values, padded to the entry's Bp sequences (device tensors)."""

    num_drafts: torch.Tensor        # [Bp] drafts verified (0 for padding)
    temperature: torch.Tensor       # [Bp] fp32
    top_k: torch.Tensor             # [Bp] int64 (vocab size: off)
    top_p: torch.Tensor             # [Bp] fp32 (1: off)
    min_p: torch.Tensor             # [Bp] fp32 (0: off)
    seeds: torch.Tensor             # [Bp] int64
    counters: torch.Tensor          # [Bp, Tq] int64: output index of each row's token
    has_q: torch.Tensor | None      # [Bp] bool: the held drafts came with their distribution
    q: torch.Tensor | None          # [Bp, K, V] fp32 (sampled variant with a drawing drafter)
    # [Bp * Tq, ceil(V / 32)] int32 allowed-token bits per row (a grammar's, all set elsewhere), or None: the
    # variants compiled with a mask (a batch with a grammar sequence) and those without.
    bitmask: torch.Tensor | None = None


def drafted_tail(proposer, logits: torch.Tensor, greedy: torch.Tensor, captured: dict[int, torch.Tensor],
                 input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, t: TailInputs, sampled: bool, k_next: int, filtered: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens [Bp, Tq], accepted [Bp], next draft ids [Bp, k_next], next draft counts [Bp], next q
    [Bp, k_next, V] or None) of a verify entry (Tq = 1 + K) or of a plain entry (Tq = 1: nothing to verify,
    the step's sample and the next block). `logits` [N, V] fp32 and `greedy` [N] (their argmax) are the
    forward's, over every padded row; `input_ids` holds the verified drafts at rows b * Tq + 1 + j.
    filtered=False leaves out top-k, top-p and min-p, for batches none of whose rows sets them: top-k / top-p
    sorts every row over the vocabulary (4.6 of a sampled tail's 5 ms at 7 rows of 12,288, one thread)."""
    bp, tq = t.counters.shape
    k = tq - 1
    v = logits.shape[-1]
    rows = torch.arange(bp * tq, device=logits.device).view(bp, tq)
    draft_ids = input_ids.view(bp, tq)[:, 1:]
    if t.bitmask is not None and not sampled:
        # A grammar's rows: the greedy sample is the argmax of the allowed tokens, not the forward's.
        greedy = apply_bitmask(logits, t.bitmask).argmax(-1)
    if k == 0 and not sampled:
        tokens, accepted = greedy.view(bp, 1), torch.zeros(bp, dtype=torch.long, device=logits.device)
    elif not sampled:
        target = greedy.view(bp, tq)
        tokens, accepted = verify_deterministic(target, draft_ids, t.num_drafts)
    else:
        st = SamplingTensors(
            temperature=t.temperature.repeat_interleave(tq), top_k=t.top_k.repeat_interleave(tq),
            top_p=t.top_p.repeat_interleave(tq), min_p=t.min_p.repeat_interleave(tq),
            presence_penalty=t.temperature.new_zeros(bp * tq), frequency_penalty=t.temperature.new_zeros(bp * tq),
            repetition_penalty=t.temperature.new_ones(bp * tq), seeds=t.seeds.repeat_interleave(tq),
            counters=t.counters.reshape(-1), any_top_k_top_p=filtered, any_min_p=filtered, bitmask=t.bitmask)
        processed = process_logits(logits, st)
        target = sample_from_processed(processed, st).view(bp, tq)
        deterministic = t.temperature == 0
        if t.q is None:
            q = torch.nn.functional.one_hot(draft_ids, v).float()
            deterministic = torch.ones_like(deterministic)
        else:
            q = torch.where(t.has_q.view(-1, 1, 1), t.q, torch.nn.functional.one_hot(draft_ids, v).float())
            deterministic = deterministic | ~t.has_q
        tokens, accepted = verify_stochastic(processed.view(bp, tq, v), target, draft_ids, q, t.num_drafts,
                                             deterministic, t.seeds, t.counters, seeded=seeded_rows(t.seeds))
    proposer.write_context(captured, positions, slot_mapping)
    inp = ProposerInput(seq_ids=[], prompt_lens=[], histories=[], hidden=captured, final_hidden=None, rows=rows,
                        tokens=tokens, accepted=accepted, positions=positions, slot_mapping=slot_mapping,
                        block_tables=block_tables, batch_index=torch.arange(bp, device=logits.device),
                        temperature=t.temperature if sampled else None, seeds=t.seeds if sampled else None,
                        counters=t.counters if sampled else None, all_greedy=not sampled)
    proposal: Proposal = proposer.draft(inp, k_next)
    ids = proposal.ids
    counts = proposal.counts if proposal.counts is not None else torch.full_like(accepted, ids.shape[1])
    return tokens, accepted, ids, counts, proposal.probs

