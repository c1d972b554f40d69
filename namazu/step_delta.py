"""The step's wire format: only what changed since the last step, and the state at both ends it refers to.

The engine builds a full `StepBatch` each step; most of it the worker already knows or can derive.
`StepEncoder` (engine side, one per executor) turns a batch into a message of:

- per scheduled sequence: id, first position, known and draft token counts, assumed drafts, whether it
  samples, and its block table as a change (entries of the worker's copy to keep, then the ids to append:
  usually none, one when a block boundary was crossed; a whole table only for a new or preempted one);
- the step's input token values (one per decode, PENDING where only the worker knows it);
- a sequence's prompt length the first time it is scheduled, and its sampling settings (temperature,
  top-p, min-p, penalties, top-k, seed) the first time it samples; after that only its output counter;
- grammar bitmask rows, prompt-logprob rows, the few step-wide flags, and the ids the worker forgets.

So a running decode costs a fixed number of bytes per sequence, whatever its context length or block
table width (tests/test_step_delta.py). `StepDecoder` (each rank's worker) keeps the other half: each
sequence's block table in a slot-indexed array, prompt length and settings, and rebuilds the exact
`StepBatch` the engine built (positions, attention layout, logit rows, per-row sampling arrays, row
layout), so the runner and the graph buffers see the same batch as before. Both ends change their
state in the same order (forget, then apply the step), and every rank decodes the same bytes.

Layout: an int64 header (magic, the step-wide scalars, every field's element count), then each field's
raw bytes in `_FIELDS` order, 8-byte aligned. No pickling: the worker reads arrays straight out of the
bytes with `np.frombuffer`.
"""
from __future__ import annotations

import numpy as np

from namazu.step_batch import (
    AttentionInputs,
    PromptLogprobInputs,
    SamplingInputs,
    SeqInputs,
    SpecInputs,
    StepBatch,
)

_MAGIC = 0x4E415A5544454C31   # "NAZUDEL1"
_I64, _F32, _I32, _BOOL = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.int32), np.dtype(bool)
_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("seq_ids", _I64), ("starts", _I64), ("num_new", _I64), ("num_drafts", _I64), ("assumed_drafts", _I64),
    ("samples", _BOOL), ("input_ids", _I64),
    ("table_keep", _I64), ("table_added", _I64), ("table_ids", _I64),     # per sequence; ids flat
    ("new_seq_ids", _I64), ("new_prompt_lens", _I64),
    ("param_seq_ids", _I64), ("param_floats", _F32), ("param_ints", _I64),   # [P, 6] and [P, 2] flat
    ("counters", _I64), ("return_drafts", _BOOL),                           # per sampling sequence
    ("bitmask", _I32),                                                       # [R, W] flat
    ("plp_rows", _I64), ("plp_targets", _I64), ("finished", _I64),
)
MAGIC_BYTES = np.int64(_MAGIC).tobytes()   # a step message starts with these (a pickle never does)
_SCALARS = ("num_logprobs", "max_drafts_next", "plp_num", "flags", "bitmask_width")
_HEADER = 1 + len(_SCALARS) + len(_FIELDS)
_FLAGS = ("any_penalty", "any_repetition_penalty", "any_top_k_top_p", "any_min_p", "all_greedy")
_PARAM_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class StepFormatError(ValueError):
    """Bytes that are not a step message of this format (or refer to a sequence the worker never saw)."""


def _pack(scalars: list[int], arrays: list[np.ndarray]) -> bytes:
    header = np.empty(_HEADER, dtype=np.int64)
    header[0] = _MAGIC
    header[1:1 + len(_SCALARS)] = scalars
    chunks = [b""]
    for j, ((name, dtype), a) in enumerate(zip(_FIELDS, arrays, strict=True)):
        a = np.ascontiguousarray(a, dtype=dtype)
        header[1 + len(_SCALARS) + j] = a.size
        raw = a.tobytes()
        chunks.append(raw + bytes(-len(raw) % 8))
    chunks[0] = header.tobytes()
    return b"".join(chunks)


def _unpack(buf) -> tuple[list[int], dict[str, np.ndarray]]:
    if len(buf) < _HEADER * 8:
        raise StepFormatError(f"step message of {len(buf)} bytes: shorter than its header")
    header = np.frombuffer(buf, dtype=np.int64, count=_HEADER)
    if int(header[0]) != _MAGIC:
        raise StepFormatError("not a step message (bad magic)")
    scalars = header[1:1 + len(_SCALARS)].tolist()
    counts = header[1 + len(_SCALARS):].tolist()
    offset, fields = _HEADER * 8, {}
    for (name, dtype), n in zip(_FIELDS, counts):
        size = n * dtype.itemsize
        if n < 0 or offset + size > len(buf):
            raise StepFormatError(f"step message truncated at field {name}")
        fields[name] = np.frombuffer(buf, dtype=dtype, count=n, offset=offset)
        offset += size + (-size % 8)
    return scalars, fields


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StepEncoder:
    """Engine side: remembers what the worker holds (each sequence's block table, whose settings it has)."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._has_params: set[int] = set()

    @property
    def num_known(self) -> int:
        return len(self._tables)

    def encode(self, b: StepBatch) -> bytes:
        for sid in b.finished_seq_ids:
            self._tables.pop(sid, None)
            self._has_params.discard(sid)
        sq, sp, spec = b.seqs, b.sampling, b.spec
        seq_ids = sq.seq_ids.tolist()
        lens = sq.num_blocks.tolist()
        keep: list[int] = []
        added: list[int] = []
        ids: list[int] = []
        new_ids: list[int] = []
        new_plens: list[int] = []
        tables = b.attn.block_tables
        prompt_lens = sq.prompt_lens.tolist()
        for i, sid in enumerate(seq_ids):
            old = self._tables.get(sid)
            n = lens[i]
            if old is None:
                new_ids.append(sid)
                new_plens.append(prompt_lens[i])
                k = 0
                cur = tables[i, :n].tolist()
            elif n >= len(old) and (len(old) == 0 or tables[i, len(old) - 1] == old[-1]) \
                    and tables[i, :len(old)].tolist() == old:
                k = len(old)
                cur = old + tables[i, k:n].tolist() if n > k else old
            else:   # shrunk (rejected drafts' blocks freed) or replaced (preempted, then scheduled again)
                cur = tables[i, :n].tolist()
                k = _common_prefix(old, cur)
            keep.append(k)
            added.append(n - k)
            ids += cur[k:]
            self._tables[sid] = cur
        samplers = spec.batch_index.tolist()
        first_rows = spec.row_layout[:, 0] if len(samplers) else np.zeros(0, np.int64)
        p_ids: list[int] = []
        p_rows: list[int] = []
        for s, i in enumerate(samplers):
            sid = seq_ids[i]
            if sid not in self._has_params:
                self._has_params.add(sid)
                p_ids.append(sid)
                p_rows.append(int(first_rows[s]))
        floats = np.stack([getattr(sp, f)[p_rows] for f in _PARAM_FLOATS], axis=1) if p_rows \
            else np.zeros((0, 6), np.float32)
        ints = np.stack([sp.top_k[p_rows], sp.seeds[p_rows]], axis=1) if p_rows else np.zeros((0, 2), np.int64)
        flags = sum(1 << j for j, f in enumerate(_FLAGS) if getattr(sp, f))
        mask = sp.bitmask
        scalars = [sp.num_logprobs, spec.max_drafts_next, b.prompt_lp.num, flags,
                   -1 if mask is None else mask.shape[1]]
        arrays = [sq.seq_ids, sq.starts, sq.num_new, sq.num_drafts, sq.assumed_drafts, sq.samples,
                  b.attn.input_ids, keep, added, ids, new_ids, new_plens, p_ids, floats, ints,
                  sp.counters[first_rows], spec.return_drafts,
                  np.zeros(0, np.int32) if mask is None else mask,
                  b.prompt_lp.rows, b.prompt_lp.targets, b.finished_seq_ids]
        return _pack(scalars, arrays)


class StepDecoder:
    """Worker side (every rank): each sequence's block table, prompt length and sampling settings, in
    arrays indexed by a slot per sequence, so a step's per-sequence parts are a few fancy indexings."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._tables = np.zeros((8, 8), np.int64)      # [slots, width]; 0 past each table's end (padding)
        self._lens = np.zeros(8, np.int64)
        self._prompt_lens = np.zeros(8, np.int64)
        self._floats = np.zeros((8, len(_PARAM_FLOATS)), np.float32)
        self._ints = np.zeros((8, 2), np.int64)         # top_k, seed

    @property
    def num_known(self) -> int:
        return len(self._slot)

    def _new_slot(self, sid: int) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._slot)
            if slot >= len(self._lens):
                grow = len(self._lens)
                self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
                for name in ("_lens", "_prompt_lens", "_floats", "_ints"):
                    a = getattr(self, name)
                    setattr(self, name, np.concatenate([a, np.zeros((grow, *a.shape[1:]), a.dtype)]))
        self._slot[sid] = slot
        return slot

    def _slots(self, seq_ids: list[int]) -> np.ndarray:
        try:
            return np.fromiter((self._slot[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as e:
            raise StepFormatError(f"step refers to sequence {e.args[0]}, which this worker never received") from None

    def decode(self, buf) -> StepBatch:
        if not isinstance(buf, bytearray):
            # The runner corrects some inputs in place (the arrays are views of `buf`: it must be writable),
            # and a buffer shared with the sender (shared memory) must not be aliased.
            buf = bytearray(buf)
        (num_logprobs, max_drafts_next, plp_num, flags, mask_width), f = _unpack(buf)
        finished = f["finished"].tolist()
        for sid in finished:
            slot = self._slot.pop(sid, None)
            if slot is not None:
                self._tables[slot, :self._lens[slot]] = 0
                self._lens[slot] = 0
                self._free.append(slot)
        for sid, plen in zip(f["new_seq_ids"].tolist(), f["new_prompt_lens"].tolist()):
            if sid in self._slot:
                raise StepFormatError(f"sequence {sid} sent as new twice")
            slot = self._new_slot(sid)      # first: it may grow the arrays
            self._prompt_lens[slot] = plen
        seq_ids = f["seq_ids"].tolist()
        slots = self._slots(seq_ids)
        self._apply_tables(slots, f["table_keep"], f["table_added"], f["table_ids"])
        p_slots = self._slots(f["param_seq_ids"].tolist())
        if len(p_slots):
            self._floats[p_slots] = f["param_floats"].reshape(-1, len(_PARAM_FLOATS))
            self._ints[p_slots] = f["param_ints"].reshape(-1, 2)
        starts, num_new, num_drafts, samples = f["starts"], f["num_new"], f["num_drafts"], f["samples"]
        lens = self._lens[slots]
        width = max(int(lens.max()) if len(lens) else 0, 1)
        seqs = SeqInputs(seq_ids=f["seq_ids"], starts=starts, num_new=num_new, num_drafts=num_drafts,
                         assumed_drafts=f["assumed_drafts"], prompt_lens=self._prompt_lens[slots],
                         samples=samples, num_blocks=lens)
        attn = _attention(f["input_ids"], starts, num_new, num_drafts, samples, self._tables[slots, :width])
        batch_index = np.flatnonzero(samples).astype(np.int64)
        reps = num_drafts[batch_index] + 1
        kmax = int(reps.max()) - 1 if len(reps) else 0
        first = np.cumsum(reps) - reps
        cols = np.arange(kmax + 1)
        row_layout = np.where(cols[None, :] < reps[:, None], first[:, None] + cols[None, :], first[:, None])
        spec = SpecInputs(row_layout=row_layout.astype(np.int64).reshape(len(reps), kmax + 1),
                          batch_index=batch_index, return_drafts=f["return_drafts"],
                          max_drafts_next=max_drafts_next)
        row_slots = np.repeat(slots[batch_index], reps)
        rows = len(row_slots)
        counters = np.repeat(f["counters"], reps) + (np.arange(rows) - np.repeat(first, reps))
        fl = self._floats[row_slots]
        sampling = SamplingInputs(
            **{name: np.ascontiguousarray(fl[:, j]) for j, name in enumerate(_PARAM_FLOATS)},
            top_k=self._ints[row_slots, 0], seeds=self._ints[row_slots, 1], counters=counters.astype(np.int64),
            bitmask=None if mask_width < 0 else f["bitmask"].reshape(rows, mask_width),
            num_logprobs=num_logprobs, **{name: bool(flags >> j & 1) for j, name in enumerate(_FLAGS)})
        plp = PromptLogprobInputs(f["plp_rows"], f["plp_targets"], plp_num)
        return StepBatch(attn=attn, seqs=seqs, sampling=sampling, spec=spec, prompt_lp=plp,
                         finished_seq_ids=finished)

    def _apply_tables(self, slots: np.ndarray, keep: np.ndarray, added: np.ndarray, ids: np.ndarray) -> None:
        changed = np.flatnonzero((added > 0) | (keep != self._lens[slots]))
        if not len(changed):
            return
        ends = np.cumsum(added)
        need = int((keep + added).max())
        if need > self._tables.shape[1]:
            width = self._tables.shape[1]
            while width < need:
                width *= 2
            grown = np.zeros((self._tables.shape[0], width), np.int64)
            grown[:, :self._tables.shape[1]] = self._tables
            self._tables = grown
        for i in changed.tolist():
            slot, k, n = int(slots[i]), int(keep[i]), int(added[i])
            old = int(self._lens[slot])
            if k > old:
                raise StepFormatError(f"step keeps {k} blocks of a table of {old}")
            self._tables[slot, k:max(old, k + n)] = 0
            self._tables[slot, k:k + n] = ids[int(ends[i]) - n:int(ends[i])]
            self._lens[slot] = k + n


def _attention(input_ids: np.ndarray, starts: np.ndarray, num_new: np.ndarray, num_drafts: np.ndarray,
               samples: np.ndarray, block_tables: np.ndarray) -> AttentionInputs:
    """The attention layout `batch_builder.build_attention` lays out, from the per-sequence counts."""
    n = num_new + num_drafts
    count = len(n)
    tq = max(int(n.max()) if count else 0, 1)
    flat0 = np.cumsum(n) - n
    seq_of = np.repeat(np.arange(count), n)
    j = np.arange(len(seq_of)) - flat0[seq_of]
    positions = starts[seq_of] + j
    q_index = np.zeros((count, tq), np.int64)
    q_pos = np.full((count, tq), -1, np.int64)
    q_index[seq_of, j] = np.arange(len(seq_of))
    q_pos[seq_of, j] = positions
    logit_rows = np.flatnonzero(samples[seq_of] & (j >= num_new[seq_of] - 1)).astype(np.int64)
    return AttentionInputs(input_ids=input_ids, positions=positions.astype(np.int64), block_tables=block_tables,
                           q_index=q_index, q_pos=q_pos, out_index=(seq_of * tq + j).astype(np.int64),
                           logit_rows=logit_rows)
