"""The worker's own copy of each sequence: the token values it has seen or sampled, and the outcome of
its last verify.

This is what lets the engine send little and plan early. An input the engine marked PENDING (sampled
by a step whose result it has not read yet) is filled in here; penalty rows get their token history
from here; and when async scheduling planned a step as if the previous verify accepted all its
drafts, the positions and sampler counters are moved back here by the drafts that were rejected.
The worker runs steps in order, so by the time a batch arrives every earlier step's outcome is known.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from namazu.step.batch import PENDING, StepBatch


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

    def slot_of(self, seq_id: int) -> int | None:
        """The sequence's slot (its row in the draft buffer), None if this worker has not seen it."""
        ws = self.seqs.get(seq_id)
        return ws.slot if ws is not None else None

    def tokens_of(self, seq_id: int) -> list[int]:
        """The sequence's known tokens (prompt and committed outputs), as of the last recorded step."""
        return self.seqs[seq_id].tokens

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

    def prepare(self, b: StepBatch, block_size: int, buffer_width: int, available: Callable[[int], int]
                ) -> PreparedStep:
        """Fills pending inputs (the last sampled token of a decode) with this worker's value, applies
        async corrections in place, records the step's known inputs, and returns what the runner needs.
        `available(slot)` is how many drafts the buffer holds for a slot. Draft positions stay PENDING in
        the batch: the runner reads them from the device draft buffer."""
        self.forget(b.finished_seq_ids)
        a, sq = b.attn, b.seqs
        # Python lists once: per-element numpy access would dominate a small step's host time.
        seq_ids, prompt_lens = sq.seq_ids.tolist(), sq.prompt_lens.tolist()
        num_new, num_drafts, assumed = sq.num_new.tolist(), sq.num_drafts.tolist(), sq.assumed_drafts.tolist()
        inputs = a.input_ids.tolist()
        positions = a.positions
        flat0 = 0
        draft_flat: list[int] = []
        draft_src: list[int] = []
        count = len(seq_ids)
        first_row_pos = [0] * count
        deltas = [0] * count
        actual = [0] * count
        for i in range(count):
            ws = self._get(seq_ids[i], prompt_lens[i])
            new, k = num_new[i], num_drafts[i]
            n = new + k
            if assumed[i]:
                if assumed[i] != ws.last_planned:
                    raise AssertionError(f"seq {seq_ids[i]}: plan assumed {assumed[i]} drafts, "
                                         f"its last verify had {ws.last_planned}")
                deltas[i] = delta = ws.last_planned - ws.last_accepted
                if delta:
                    positions[flat0:flat0 + n] -= delta
                    row = a.q_pos[i]
                    row[row >= 0] -= delta
            start = int(positions[flat0]) if n else 0
            known = inputs[flat0:flat0 + new]
            if PENDING in known:
                # Only a decode's single input can be pending: the token this worker sampled last.
                if new != 1 or not ws.tokens:
                    raise AssertionError(f"seq {seq_ids[i]}: pending input at position "
                                         f"{start + known.index(PENDING)} the worker never saw")
                known = [ws.tokens[-1]]
                a.input_ids[flat0] = known[0]
            del ws.tokens[start:]   # anything past the first position computed now is superseded
            ws.tokens.extend(known)
            if k:
                have = available(ws.slot)
                actual[i] = min(k, have)
                for j in range(k):
                    draft_flat.append(flat0 + new + j)
                    # Missing drafts (the proposer had fewer) read slot row 0: harmless filler, never accepted.
                    draft_src.append(ws.slot * buffer_width + j if j < have else 0)
            first_row_pos[i] = start + new - 1
            flat0 += n
        slot_mapping = _slot_mapping(positions, a.block_tables, a.out_index, a.q_index.shape[1], block_size)
        samplers = b.spec.batch_index.tolist()
        for s, i in enumerate(samplers):
            if deltas[i]:   # sampler counters (output indices) move back with the positions
                b.sampling.counters[np.unique(b.spec.row_layout[s])] -= deltas[i]
        seqs = [self.seqs[seq_ids[i]] for i in samplers]
        return PreparedStep(slot_mapping, np.asarray([ws.slot for ws in seqs], dtype=np.int64),
                            np.asarray(draft_flat, dtype=np.int64), np.asarray(draft_src, dtype=np.int64),
                            np.asarray([actual[i] for i in samplers], dtype=np.int64),
                            [ws.tokens for ws in seqs], np.asarray([first_row_pos[i] for i in samplers],
                                                                   dtype=np.int64))

    def record(self, b: StepBatch, prep: PreparedStep, tokens: np.ndarray, accepted: np.ndarray,
               planned: np.ndarray | None = None) -> None:
        """After the step: each sampling sequence's emitted tokens join its history. `planned`: the drafts
        the engine assumed accepted per scheduled sequence (all it planned for a chain, where the runner
        verified fewer, `step_batch.trim_drafts`; a tree's depth, `Speculator.max_accepted`); the next plan's
        positions assume all of those."""
        seq_ids = b.seqs.seq_ids.tolist()
        planned = (b.seqs.num_drafts if planned is None else planned).tolist()
        rows, acc, frm = tokens.tolist(), accepted.tolist(), prep.verify_from.tolist()
        for s, i in enumerate(b.spec.batch_index.tolist()):
            ws = self.seqs[seq_ids[i]]
            n = acc[s]
            del ws.tokens[frm[s] + 1:]
            ws.tokens.extend(rows[s][:n + 1])
            ws.last_planned, ws.last_accepted = planned[i], n


def _slot_mapping(positions: np.ndarray, tables: np.ndarray, out_index: np.ndarray, tq: int,
                  block_size: int) -> np.ndarray:
    b = out_index // max(tq, 1)
    return tables[b, positions // block_size] * block_size + positions % block_size
