"""The step's wire format: only what changed since the last step, and the state at both ends it refers to.

The engine builds a full `StepBatch` each step; most of it the worker already knows or can derive.
`StepEncoder` (engine side, one per executor) turns a batch into a message of:

- per scheduled sequence: id, first position, known and draft token counts, assumed drafts, whether it
  samples, and its block table as a change (entries of the worker's copy to keep, then the ids to append:
  usually none, one when a block boundary was crossed; a whole table only for a new or preempted one);
- the step's input token values (one per decode, PENDING where only the worker knows it);
- a sequence's prompt length the first time it is scheduled, and its sampling settings (temperature,
  top-p, min-p, penalties, top-k, seed) the first time it samples; after that only its output counter;
- grammar bitmask rows, prompt-logprob rows, the few step-wide flags, and the ids the worker forgets;
- logit-bias entries (row, token id, bias) of the rows that have one, every step (rare, and small).

So a running decode costs a fixed number of bytes per sequence, whatever its context length or block
table width (tests/step/test_step_delta.py). `StepDecoder` (each rank's worker) keeps the other half: each
sequence's block table in a slot-indexed array, prompt length and settings, and rebuilds the exact
`StepBatch` the engine built (positions, attention layout, logit rows, per-row sampling arrays, row
layout), so the runner and the graph buffers see the same batch as before. Both ends change their
state in the same order (forget, then apply the step), and every rank decodes the same bytes.

Layout: an int64 header (magic, the step-wide scalars, every field's element count), then each field's
raw bytes in `_FIELDS` order, 8-byte aligned. No pickling: the worker reads arrays straight out of the
bytes with `np.frombuffer`.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from namazu.step.batch import (
    AttentionInputs,
    PromptLogprobInputs,
    SamplingInputs,
    SeqInputs,
    SpecInputs,
    StepBatch,
    attention_layout,
    sampled_row_layout,
)

_MAGIC = 0x4E415A5544454C31   # "NAZUDEL1"
MAGIC_BYTES = np.int64(_MAGIC).tobytes()   # a step message starts with these (a pickle never does)
_I64, _F32, _I32 = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.int32)
# Per-sequence values travel as the rows of one [6, B] array: one field to cut instead of six.
_SEQ_ROWS = ("seq_ids", "starts", "num_new", "num_drafts", "assumed_drafts", "samples")
_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("seq", _I64),              # [6, B], rows _SEQ_ROWS
    ("input_ids", _I64),        # [N], PENDING where only the worker knows the value
    ("table_change", _I64),     # [3, C] for the C tables that changed: batch row, entries kept, entries appended
    ("table_ids", _I64),        # the appended block ids, sequence after sequence
    ("new", _I64),              # [2, n]: ids and prompt lengths of sequences scheduled for the first time
    ("param_ids", _I64),        # [P] sequences sampling for the first time, then their settings:
    ("param_floats", _F32),     # [P, 6] _PARAM_FLOATS
    ("param_ints", _I64),       # [P, 2] top_k, seed
    ("sampler", _I64),          # [2, S]: output counter of the first row, return_drafts
    ("bitmask", _I32),          # [R, W]
    ("prompt_lp", _I64),        # [2, P]: rows, targets
    ("finished", _I64),         # the worker forgets these first
    ("shadow", _I64),           # sequences a shadow drafter drafts for from now on (`spec/shadow.py`)
    ("bias", _I64),             # [2, E]: logit-bias entries' sampled rows and token ids, every step they apply
    ("bias_values", _F32),      # [E]
)
_SCALARS = ("num_logprobs", "max_drafts_next", "plp_num", "flags", "bitmask_width")
_HEADER = 1 + len(_SCALARS) + len(_FIELDS)
_FLAGS = ("any_penalty", "any_repetition_penalty", "any_top_k_top_p", "any_min_p", "all_greedy")
_PLAIN_DECODE = 1 << len(_FLAGS)    # flag: every sequence decodes one token without drafts and samples
_NO_CONTEXT = 1 << (len(_FLAGS) + 1)  # flag: the drafter's context is not written from this step
_PARAM_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class StepFormatError(ValueError):
    """Bytes that are not a step message of this format (or refer to a sequence the worker never saw)."""


def _pack(scalars: list[int], arrays: list) -> bytes:
    header = np.empty(_HEADER, dtype=np.int64)
    header[0] = _MAGIC
    header[1:1 + len(_SCALARS)] = scalars
    chunks = [b""]
    for j, ((_, dtype), a) in enumerate(zip(_FIELDS, arrays, strict=True)):
        raw = a.tobytes() if type(a) is np.ndarray and a.dtype == dtype else np.asarray(a, dtype=dtype).tobytes()
        header[1 + len(_SCALARS) + j] = len(raw) // dtype.itemsize
        chunks.append(raw)
        if len(raw) % 8:
            chunks.append(bytes(-len(raw) % 8))
    chunks[0] = header.tobytes()
    return b"".join(chunks)


def _unpack(buf: bytearray) -> tuple[list[int], list[np.ndarray]]:
    if len(buf) < _HEADER * 8:
        raise StepFormatError(f"step message of {len(buf)} bytes: shorter than its header")
    if len(buf) % 8:
        raise StepFormatError(f"step message of {len(buf)} bytes: not a whole number of 8-byte words")
    # One view of the whole message as int64: most fields are then a slice of it (cheaper than a view each).
    words = np.frombuffer(buf, dtype=np.int64)
    if int(words[0]) != _MAGIC:
        raise StepFormatError("not a step message (bad magic)")
    scalars = words[1:1 + len(_SCALARS)].tolist()
    at, fields = _HEADER, []
    for (name, dtype), n in zip(_FIELDS, words[1 + len(_SCALARS):_HEADER].tolist()):
        size = -(-n * dtype.itemsize // 8)     # in words
        if n < 0 or at + size > len(words):
            raise StepFormatError(f"step message truncated at field {name}")
        fields.append(words[at:at + n] if dtype is _I64 else words[at:at + size].view(dtype)[:n])
        at += size
    return scalars, fields


class _Tables:
    """Each known sequence's block table in a slot-indexed array (0 past a table's end: the padding the
    batch builder uses) plus per-slot columns; both ends keep one and change it the same way."""

    def __init__(self, columns: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.slot: dict[int, int] = {}
        self._free: list[int] = []
        self.tables = np.zeros((8, 8), np.int64)
        self.lens = np.zeros(8, np.int64)
        self.cols = {name: np.zeros((8, *shape), dtype) for name, (shape, dtype) in columns.items()}

    def add(self, sid: int) -> int:
        if sid in self.slot:
            raise StepFormatError(f"sequence {sid} sent as new twice")
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self.slot)
            if slot >= len(self.lens):
                self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
                self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
                self.cols = {k: np.concatenate([a, np.zeros_like(a)]) for k, a in self.cols.items()}
        self.slot[sid] = slot
        return slot

    def forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            slot = self.slot.pop(sid, None)
            if slot is not None:
                self.tables[slot, :self.lens[slot]] = 0
                self.lens[slot] = 0
                for a in self.cols.values():
                    a[slot] = 0
                self._free.append(slot)

    def slots_of(self, seq_ids: list[int]) -> np.ndarray:
        try:
            return np.fromiter((self.slot[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as e:
            raise StepFormatError(f"step refers to sequence {e.args[0]}, which this worker never received") from None

    def _fit(self, width: int) -> None:
        if width > self.tables.shape[1]:
            grown = np.zeros((self.tables.shape[0], max(width, 2 * self.tables.shape[1])), np.int64)
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables = grown

    def diff(self, slots: np.ndarray, tables: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([3, C] batch row, entries of the held table to keep, entries appended; the appended ids) for the
        C tables of `slots` that differ from `tables[b, :lens[b]]`: a vectorised comparison."""
        self._fit(tables.shape[1])
        held = self.tables[slots, :tables.shape[1]]
        old = self.lens[slots]
        # Past its end a held table is 0, like the batch's padding: equal rows and lengths are equal tables.
        if np.array_equal(held, tables) and np.array_equal(old, lens):
            return _NO_CHANGE, _NO_IDS
        mismatch = held != tables
        first = np.where(mismatch.any(axis=1), mismatch.argmax(axis=1), tables.shape[1])
        keep = np.minimum(first, np.minimum(old, lens))
        rows = np.flatnonzero((keep != old) | (keep != lens))
        keep, lens = keep[rows], lens[rows]
        cols = np.arange(tables.shape[1])
        ids = tables[rows][(cols >= keep[:, None]) & (cols < lens[:, None])]
        return np.stack([rows, keep, lens - keep]), ids

    def apply(self, slots: np.ndarray, change: np.ndarray, ids: np.ndarray) -> None:
        """Applies `diff`'s answer (a [3, C] change, the appended ids) to the tables of `slots`."""
        if not change.size:
            return
        rows, keep, added = change.reshape(3, -1)
        if rows.min() < 0 or rows.max() >= len(slots):
            raise StepFormatError("a table change names a sequence outside the step")
        slots = slots[rows]
        old = self.lens[slots]
        if (keep > old).any():
            raise StepFormatError("a step keeps more of a block table than was sent")
        new = keep + added
        if len(ids) != int(added.sum()):
            raise StepFormatError(f"{len(ids)} block ids for {int(added.sum())} appended entries")
        width = int(max(new.max(), old.max()))
        self._fit(width)
        cols = np.arange(width)
        rows, at = np.nonzero((cols >= keep[:, None]) & (cols < np.maximum(old, new)[:, None]))
        self.tables[slots[rows], at] = 0                    # a shrunk or replaced table's tail
        rows, at = np.nonzero((cols >= keep[:, None]) & (cols < new[:, None]))
        self.tables[slots[rows], at] = ids                  # row-major: each sequence's ids in order
        self.lens[slots] = new


_NO_CHANGE = np.zeros((3, 0), np.int64)
_NO_IDS = np.zeros(0, np.int64)
_NO_ROWS = np.zeros((2, 0), np.int64)
_NO_F32 = np.zeros(0, np.float32)


class StepEncoder:
    """Engine side: a copy of what the worker holds (each sequence's block table, whose settings it has)."""

    def __init__(self) -> None:
        self._t = _Tables({"has_params": ((), np.dtype(bool))})
        self._last: tuple[bytes, np.ndarray] | None = None   # the last plain decode's sequences and slots

    @property
    def num_known(self) -> int:
        return len(self._t.slot)

    def encode(self, b: StepBatch) -> bytes:
        t, sq, sp, spec = self._t, b.seqs, b.sampling, b.spec
        t.forget(b.finished_seq_ids)
        key = sq.seq_ids.tobytes()
        first_rows = spec.row_layout[:, 0]
        plain = len(first_rows) == len(sq.seq_ids) == b.num_tokens and not spec.max_drafts and sq.num_new.min() == 1
        new_at: list[int] = []
        if self._last is not None and self._last[0] == key and not b.finished_seq_ids:
            # The same sequences as the last step, every one of which sampled then: all known, settings sent.
            slots, p_rows = self._last[1], _NO_IDS
        else:
            seq_ids = sq.seq_ids.tolist()
            new_at = [i for i, sid in enumerate(seq_ids) if sid not in t.slot]
            for i in new_at:
                t.add(seq_ids[i])
            slots = t.slots_of(seq_ids)
            s_slots = slots[spec.batch_index]
            fresh = ~t.cols["has_params"][s_slots]
            p_rows = first_rows[fresh]
        self._last = (key, slots) if plain else None
        change, ids = t.diff(slots, b.attn.block_tables, sq.num_blocks)
        t.apply(slots, change, ids)
        if len(p_rows):
            t.cols["has_params"][s_slots] = True
            p_floats = np.stack([getattr(sp, f)[p_rows] for f in _PARAM_FLOATS], axis=1)
            p_ints = np.stack([sp.top_k[p_rows], sp.seeds[p_rows]], axis=1)
            p_ids = sq.seq_ids[spec.batch_index][fresh]
        else:
            p_floats = p_ints = p_ids = _NO_IDS
        plp = b.prompt_lp
        seq = np.empty((len(_SEQ_ROWS), len(slots)), np.int64)
        for j, name in enumerate(_SEQ_ROWS):
            seq[j] = getattr(sq, name)
        sampler = np.empty((2, len(first_rows)), np.int64)
        sampler[0] = sp.counters[first_rows]
        sampler[1] = spec.return_drafts
        flags = sum(1 << j for j, f in enumerate(_FLAGS) if getattr(sp, f))
        if plain:
            flags |= _PLAIN_DECODE
        if not spec.write_context:
            flags |= _NO_CONTEXT
        mask = sp.bitmask
        scalars = [sp.num_logprobs, spec.max_drafts_next, b.prompt_lp.num, flags,
                   -1 if mask is None else mask.shape[1]]
        arrays = [
            seq, b.attn.input_ids, change, ids,
            np.stack([sq.seq_ids[new_at], sq.prompt_lens[new_at]]) if new_at else _NO_ROWS,
            p_ids, p_floats, p_ints, sampler, _NO_IDS if mask is None else mask,
            np.stack([plp.rows, plp.targets]) if len(plp.rows) else _NO_ROWS, b.finished_seq_ids,
            b.shadow_seq_ids, _NO_ROWS if sp.bias is None else sp.bias,
            _NO_F32 if sp.bias_values is None else sp.bias_values]
        return _pack(scalars, arrays)


class _PlainParts(NamedTuple):
    index: np.ndarray           # [B] 0..B-1: flat token, logit row, output column and sampler of sequence b
    index2d: np.ndarray         # [B, 1] the same (q_index, row_layout)
    lens: np.ndarray
    tables: np.ndarray
    prompt_lens: np.ndarray
    floats: np.ndarray          # [6, B] _PARAM_FLOATS
    ints: np.ndarray            # [2, B] top_k, seed


class StepDecoder:
    """Worker side (every rank): each sequence's block table, prompt length and sampling settings, in
    arrays indexed by a slot per sequence, so a step's per-sequence parts are a few fancy indexings."""

    def __init__(self) -> None:
        self._t = _Tables({"prompt_len": ((), _I64), "floats": ((len(_PARAM_FLOATS),), _F32), "ints": ((2,), _I64)})
        self._plain: tuple[bytes, tuple] | None = None   # the last plain decode's sequences and lasting parts

    @property
    def num_known(self) -> int:
        return len(self._t.slot)

    def decode(self, buf: bytes | bytearray | memoryview) -> StepBatch:
        if not isinstance(buf, bytearray):
            # The runner corrects some inputs in place (the arrays are views of `buf`: it must be writable),
            # and a buffer shared with the sender (shared memory) must not be aliased.
            buf = bytearray(buf)
        (num_logprobs, max_drafts_next, plp_num, flags, mask_width), fields = _unpack(buf)
        (seq, input_ids, change, table_ids, new, p_ids, p_floats, p_ints, sampler, mask, plp, finished_arr,
         shadow_arr, bias, bias_values) = fields
        t = self._t
        finished = finished_arr.tolist()
        t.forget(finished)
        new = new.reshape(2, -1)
        for sid, plen in zip(*new.tolist()):
            slot = t.add(sid)       # first: it may grow the columns
            t.cols["prompt_len"][slot] = plen
        seq = seq.reshape(len(_SEQ_ROWS), -1)
        seq_ids, starts, num_new, num_drafts, assumed, samples_i = seq
        slots = t.slots_of(seq_ids.tolist())
        t.apply(slots, change, table_ids)
        if len(p_ids):
            p_slots = t.slots_of(p_ids.tolist())
            t.cols["floats"][p_slots] = p_floats.reshape(-1, len(_PARAM_FLOATS))
            t.cols["ints"][p_slots] = p_ints.reshape(-1, 2)
        if change.size or len(p_ids) or len(finished) or new.size:
            self._plain = None
        sampler = sampler.reshape(2, -1)
        if flags & _PLAIN_DECODE:
            key = seq_ids.tobytes()
            if self._plain is None or self._plain[0] != key:
                self._plain = (key, self._plain_parts(slots))
            c = self._plain[1]
            # Only what a plain decode step changes is new; the rest is the last step's (the runner and
            # the worker's sequence table write into positions, q_pos, counters and input_ids only).
            seqs = SeqInputs(seq_ids=seq_ids, starts=starts, num_new=num_new, num_drafts=num_drafts,
                             assumed_drafts=assumed, prompt_lens=c.prompt_lens, samples=samples_i.astype(bool),
                             num_blocks=c.lens)
            attn = AttentionInputs(input_ids=input_ids, positions=starts.copy(), block_tables=c.tables,
                                   q_index=c.index2d, q_pos=starts.reshape(-1, 1).copy(), out_index=c.index,
                                   logit_rows=c.index)
            spec = SpecInputs(row_layout=c.index2d, batch_index=c.index, return_drafts=sampler[1].astype(bool),
                              max_drafts_next=max_drafts_next)
            sampling = _sampling(c.floats, c.ints, sampler[0].copy(), mask, mask_width, num_logprobs, flags)
        else:
            seqs, attn, spec, sampling = self._general(slots, seq_ids, starts, num_new, num_drafts, assumed,
                                                       samples_i, input_ids, sampler, mask, mask_width,
                                                       num_logprobs, max_drafts_next, flags)
        if len(bias_values):
            sampling.bias, sampling.bias_values = bias.reshape(2, -1), bias_values
        plp = plp.reshape(2, -1)
        spec.write_context = not flags & _NO_CONTEXT
        return StepBatch(attn=attn, seqs=seqs, sampling=sampling, spec=spec,
                         prompt_lp=PromptLogprobInputs(plp[0], plp[1], plp_num), finished_seq_ids=finished,
                         shadow_seq_ids=shadow_arr.tolist())

    def _plain_parts(self, slots: np.ndarray) -> _PlainParts:
        """What a plain decode step of these sequences shares with the next while they stay the same: the
        identity layout, block tables, prompt lengths, sampling settings."""
        t = self._t
        lens = t.lens[slots]
        index = np.arange(len(slots))
        return _PlainParts(index, index.reshape(-1, 1), lens, t.tables[slots, :max(int(lens.max()), 1)],
                           t.cols["prompt_len"][slots], t.cols["floats"][slots].T.copy(),
                           t.cols["ints"][slots].T.copy())

    def _general(self, slots, seq_ids, starts, num_new, num_drafts, assumed, samples_i, input_ids, sampler, mask,
                 mask_width, num_logprobs, max_drafts_next, flags) -> tuple:
        """Any step: the attention layout, row layout and per-row sampling arrays rebuilt from the counts."""
        t = self._t
        lens = t.lens[slots]
        samples = samples_i.astype(bool)
        attn = attention_layout(input_ids, starts, num_new, num_drafts, samples,
                                t.tables[slots, :max(int(lens.max()), 1)])
        batch_index = np.flatnonzero(samples).astype(np.int64)
        row_layout = sampled_row_layout(num_drafts[batch_index])
        reps = num_drafts[batch_index] + 1
        first = row_layout[:, 0]
        row_slots = np.repeat(slots[batch_index], reps)
        counters = (np.repeat(sampler[0], reps) + (np.arange(len(row_slots)) - np.repeat(first, reps)))
        seqs = SeqInputs(seq_ids=seq_ids, starts=starts, num_new=num_new, num_drafts=num_drafts,
                         assumed_drafts=assumed, prompt_lens=t.cols["prompt_len"][slots], samples=samples,
                         num_blocks=lens)
        spec = SpecInputs(row_layout=row_layout, batch_index=batch_index, return_drafts=sampler[1].astype(bool),
                          max_drafts_next=max_drafts_next)
        # One row per setting, each contiguous.
        sampling = _sampling(t.cols["floats"][row_slots].T.copy(), t.cols["ints"][row_slots].T.copy(),
                             counters.astype(np.int64, copy=False), mask, mask_width, num_logprobs, flags)
        return seqs, attn, spec, sampling


def _sampling(floats: np.ndarray, ints: np.ndarray, counters: np.ndarray, mask: np.ndarray, mask_width: int,
              num_logprobs: int, flags: int) -> SamplingInputs:
    """Per-row sampling arrays from the settings ([6, R] _PARAM_FLOATS, [2, R] top_k and seed), the rows'
    counters, the grammar mask and the step-wide flags."""
    return SamplingInputs(
        temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
        frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seeds=ints[1], counters=counters,
        bitmask=None if mask_width < 0 else mask.reshape(len(counters), mask_width),
        num_logprobs=num_logprobs, **{name: bool(flags >> j & 1) for j, name in enumerate(_FLAGS)})
