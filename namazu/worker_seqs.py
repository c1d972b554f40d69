"""The worker's own copy of each sequence: the token values it has seen or sampled, and the outcome of
its last verify.

This is what lets the engine send little and plan early. An input the engine marked PENDING (sampled
by a step whose result it has not read yet) is filled in here; penalty rows get their token history
from here; and when async scheduling planned a step as if the previous verify accepted all its
drafts, the positions and sampler counters are moved back here by the drafts that were rejected.
The worker runs steps in order, so by the time a batch arrives every earlier step's outcome is known.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from namazu.step_batch import PENDING, StepBatch


@dataclass
class WorkerSeq:
    slot: int                     # its row in the draft buffer
    prompt_len: int
    tokens: list[int] = field(default_factory=list)   # values of positions 0..len-1
    last_planned: int = 0         # drafts its last verify was planned with
    last_accepted: int = 0        # drafts that verify accepted


@dataclass
class PreparedStep:
    """Host-side facts of one step the runner needs beyond the batch (all indexed like the batch)."""

    slot_mapping: np.ndarray      # [N] cache slot of each query token (after corrections)
    slots: np.ndarray             # [S] draft-buffer slot of each sampling sequence
    draft_flat: np.ndarray        # [D] flat query positions that take a draft from the buffer
    draft_src: np.ndarray         # [D] slot * K_buffer + j: which buffered draft
    num_drafts: np.ndarray        # [S] drafts actually verified (at most the planned count)
    histories: list[list[int]]    # [S] known tokens (prompt + outputs) before this step's samples
    verify_from: np.ndarray       # [S] position of each sampling sequence's first sampled row


class WorkerSeqTable:
    def __init__(self) -> None:
        self.seqs: dict[int, WorkerSeq] = {}
        self._free_slots: list[int] = []
        self.num_slots = 0

    def forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            ws = self.seqs.pop(sid, None)
            if ws is not None:
                self._free_slots.append(ws.slot)

    def _get(self, sid: int, prompt_len: int) -> WorkerSeq:
        ws = self.seqs.get(sid)
        if ws is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot, self.num_slots = self.num_slots, self.num_slots + 1
            ws = self.seqs[sid] = WorkerSeq(slot, prompt_len)
        return ws

    def prepare(self, b: StepBatch, block_size: int, buffer_width: int, available: dict[int, int]
                ) -> PreparedStep:
        """Fills pending inputs, applies async corrections in place, and returns what the runner needs.
        `available[slot]` is how many drafts the buffer holds for a slot."""
        self.forget(b.finished_seq_ids)
        a, sq = b.attn, b.seqs
        flat0 = 0
        draft_flat: list[int] = []
        draft_src: list[int] = []
        first_row_pos = np.zeros(len(sq.seq_ids), dtype=np.int64)
        deltas = np.zeros(len(sq.seq_ids), dtype=np.int64)
        actual = np.zeros(len(sq.seq_ids), dtype=np.int64)
        for i in range(len(sq.seq_ids)):
            ws = self._get(int(sq.seq_ids[i]), int(sq.prompt_lens[i]))
            new, k = int(sq.num_new[i]), int(sq.num_drafts[i])
            n = new + k
            delta = 0
            if sq.assumed_drafts[i]:
                if int(sq.assumed_drafts[i]) != ws.last_planned:
                    raise AssertionError(f"seq {sq.seq_ids[i]}: plan assumed {sq.assumed_drafts[i]} drafts, "
                                         f"its last verify had {ws.last_planned}")
                delta = ws.last_planned - ws.last_accepted
            deltas[i] = delta
            if delta:
                a.positions[flat0:flat0 + n] -= delta
                row = a.q_pos[i]
                row[row >= 0] -= delta
            start = int(a.positions[flat0]) if n else 0
            del ws.tokens[start:]   # anything past the first position computed now is superseded
            for j in range(new):
                v = int(a.input_ids[flat0 + j])
                if v == PENDING:
                    raise AssertionError(f"seq {sq.seq_ids[i]}: pending input at position {start + j} "
                                         f"the worker never saw")
                ws.tokens.append(v)
            if k:
                have = available.get(ws.slot, 0)
                actual[i] = min(k, have)
                for j in range(k):
                    draft_flat.append(flat0 + new + j)
                    # Missing drafts (the proposer had fewer) read slot row 0: harmless filler, never accepted.
                    draft_src.append(ws.slot * buffer_width + j if j < have else 0)
            first_row_pos[i] = start + new - 1
            flat0 += n
        slot_mapping = _slot_mapping(a.positions, a.block_tables, a.out_index, a.q_index.shape[1], block_size)
        samplers = b.spec.batch_index
        for s, i in enumerate(samplers):
            if deltas[i]:   # sampler counters (output indices) move back with the positions
                b.sampling.counters[np.unique(b.spec.row_layout[s])] -= deltas[i]
        seqs = [self.seqs[int(sq.seq_ids[i])] for i in samplers]
        slots = np.asarray([ws.slot for ws in seqs], dtype=np.int64)
        return PreparedStep(slot_mapping, slots, np.asarray(draft_flat, dtype=np.int64),
                            np.asarray(draft_src, dtype=np.int64), actual[samplers],
                            [ws.tokens for ws in seqs], first_row_pos[samplers])

    def fill_pending(self, b: StepBatch) -> None:
        """Replaces PENDING inputs (the last sampled token of a decode) with the worker's value. Runs
        before `prepare`, which then treats every new input as known."""
        a, sq = b.attn, b.seqs
        flat0 = 0
        for i in range(len(sq.seq_ids)):
            new, k = int(sq.num_new[i]), int(sq.num_drafts[i])
            for j in range(new):
                if a.input_ids[flat0 + j] == PENDING:
                    ws = self.seqs.get(int(sq.seq_ids[i]))
                    if ws is None or not ws.tokens:
                        raise AssertionError(f"seq {sq.seq_ids[i]}: pending input but no sampled token")
                    a.input_ids[flat0 + j] = ws.tokens[-1]
            flat0 += new + k

    def record(self, b: StepBatch, prep: PreparedStep, tokens: np.ndarray, accepted: np.ndarray) -> None:
        """After the step: each sampling sequence's emitted tokens join its history."""
        sq = b.seqs
        for s, i in enumerate(b.spec.batch_index):
            ws = self.seqs[int(sq.seq_ids[i])]
            n = int(accepted[s])
            del ws.tokens[int(prep.verify_from[s]) + 1:]
            ws.tokens.extend(int(t) for t in tokens[s, :n + 1])
            ws.last_planned, ws.last_accepted = int(sq.num_drafts[i]), n


def _slot_mapping(positions: np.ndarray, tables: np.ndarray, out_index: np.ndarray, tq: int,
                  block_size: int) -> np.ndarray:
    b = out_index // max(tq, 1)
    return tables[b, positions // block_size] * block_size + positions % block_size
