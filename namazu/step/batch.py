"""What crosses the engine -> worker boundary each step (StepBatch, in named parts) and back (StepResult).

Layout: N query tokens flat (prefill chunks, decodes, verify rows: last token + k drafts); B scheduled
sequences padded to [B, Tq] for attention; R rows whose logits are sampled (1 per decode or prefill
end, 1 + k per verify); S sampling sequences, each owning rows row_layout[s, :1 + k_s].

The worker keeps its own copy of every running sequence (`namazu/worker/seq_table.py`): the token values it
has seen or sampled, and the drafts its proposer made. So the engine sends only what it knows and
plans: an input whose value is still on the worker (async scheduling) is sent as PENDING, draft
tokens are never sent (the batch says how many of the worker's drafts to verify), and penalty rows
say that they need the history, not the history itself.

`RESULT_FIELDS` is the one declaration of the result: the runner packs the device tensors in that
order into one int64 and one float32 tensor (one device -> host copy), `unpack` reads them back.

A step does not travel as a StepBatch: `namazu/step/delta.py` sends what changed since the last step and
the worker rebuilds the batch. A StepResult pickles (worker -> engine pipe) as one byte blob holding every
array plus a small tuple of the other values (`__reduce__`): pickling two dozen small numpy arrays one by
one cost about 250 us per step in pickle and unpickle.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

PENDING = -1    # an input token whose value only the worker knows


@dataclass
class AttentionInputs:
    input_ids: np.ndarray          # [N] token values, PENDING where the worker supplies it
    positions: np.ndarray          # [N] as planned by the engine (see SeqInputs.assumed_drafts)
    block_tables: np.ndarray       # [B, M]
    q_index: np.ndarray            # [B, Tq] flat token of each (sequence, column)
    q_pos: np.ndarray              # [B, Tq] its position, -1 for padding
    out_index: np.ndarray          # [N] column of each flat token in B * Tq
    logit_rows: np.ndarray         # [R] indices into N


@dataclass
class SeqInputs:
    """Per scheduled sequence (B rows, the batch order)."""

    seq_ids: np.ndarray            # [B]
    starts: np.ndarray             # [B] first position computed this step
    num_new: np.ndarray            # [B] known (non-draft) tokens computed this step
    num_drafts: np.ndarray         # [B] worker drafts verified this step (at most; fewer if it has fewer)
    # Async scheduling plans a step before the previous verify's acceptance is known, as if all of its
    # drafts were accepted; assumed_drafts[b] is that verify's draft count (0: the plan is exact). The
    # worker, which knows the acceptance, moves positions and counters back by the rejected drafts.
    assumed_drafts: np.ndarray     # [B]
    prompt_lens: np.ndarray        # [B]
    samples: np.ndarray            # [B] bool: the step ends at the sequence's last token (it samples)
    num_blocks: np.ndarray         # [B] entries of block_tables[b] that are the sequence's (the rest pad)


@dataclass
class SamplingInputs:
    """Per sampled row (R)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray           # output index each row samples (as planned; corrected like positions)
    bitmask: np.ndarray | None     # [R, W] int32 allowed-token bits, from the requests' grammars
    any_penalty: bool
    any_repetition_penalty: bool
    any_top_k_top_p: bool
    any_min_p: bool
    all_greedy: bool
    num_logprobs: int              # top-N logprobs per sampled token; -1 = no logprobs at all
    # Logit bias as coordinates: [2, E] (sampled row, token id) and [E] the bias added there (OpenAI
    # `logit_bias`); None when no row of the step has one.
    bias: np.ndarray | None = None
    bias_values: np.ndarray | None = None


@dataclass
class SpecInputs:
    """Per sampling sequence (S)."""

    row_layout: np.ndarray         # [S, K+1] indices into R (padding repeats the sequence's first row)
    batch_index: np.ndarray        # [S] its row in SeqInputs
    return_drafts: np.ndarray      # [S] bool: send the next drafts' ids back (the engine checks them
                                   # against the sequence's grammar before planning their verify)
    max_drafts_next: int = 0       # a device proposer's draft count per sequence (0: none, or a host proposer)
    write_context: bool = True     # the drafter's context from this step's rows (off: no sequence of the
                                   # step will draft, engine/draft_policy.py's dormant buckets)

    @property
    def max_drafts(self) -> int:
        return self.row_layout.shape[1] - 1


@dataclass
class PromptLogprobInputs:
    rows: np.ndarray               # [P] indices into N
    targets: np.ndarray            # [P] the next prompt token at each of those rows
    num: int                       # top-N; -1 = none


@dataclass
class StepBatch:
    attn: AttentionInputs
    seqs: SeqInputs
    sampling: SamplingInputs
    spec: SpecInputs
    prompt_lp: PromptLogprobInputs
    finished_seq_ids: list[int] = field(default_factory=list)   # the worker forgets these first
    shadow_seq_ids: list[int] = field(default_factory=list)     # sequences a shadow drafter drafts for from now on

    @property
    def num_tokens(self) -> int:
        return len(self.attn.input_ids)

    @property
    def num_sampling(self) -> int:
        return len(self.spec.row_layout)


_ALIGN = 8   # every array starts 8-byte aligned in the blob (unaligned views are slow to compute on)
_dtype = functools.cache(np.dtype)


def attention_layout(input_ids: np.ndarray, starts: np.ndarray, num_new: np.ndarray, num_drafts: np.ndarray,
                     samples: np.ndarray, block_tables: np.ndarray) -> AttentionInputs:
    """The attention layout of the module docstring from the per-sequence counts: sequence b's tokens are
    flat rows flat0_b .. flat0_b + n_b - 1 (n_b = known + drafts), at positions starts_b + j; column j of
    its [B, Tq] row; sampled from its last known token on. The one definition, used by the engine's batch
    builder and by the worker's decoder of the step wire format (step_delta.py)."""
    n = num_new + num_drafts
    count = len(n)
    if count and n.min() == n.max() == 1:     # one token each (decodes): the identity layout, cheaply
        index = np.arange(count, dtype=np.int64)
        return AttentionInputs(input_ids=input_ids, positions=starts.astype(np.int64), block_tables=block_tables,
                               q_index=index.reshape(count, 1), q_pos=starts.astype(np.int64).reshape(count, 1),
                               out_index=index.copy(), logit_rows=np.flatnonzero(samples).astype(np.int64))
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


def sampled_row_layout(num_drafts: np.ndarray) -> np.ndarray:
    """[S, 1 + max k] row_layout: sampling sequence s owns logit rows first_s .. first_s + k_s (its drafts'
    count k_s), the rest of its row padded with first_s."""
    if not num_drafts.any():
        return np.arange(len(num_drafts), dtype=np.int64).reshape(-1, 1)
    reps = num_drafts + 1
    kmax = int(reps.max()) - 1
    first = np.cumsum(reps) - reps
    cols = np.arange(kmax + 1)
    return np.where(cols[None, :] < reps[:, None], first[:, None] + cols[None, :],
                    first[:, None]).astype(np.int64).reshape(len(reps), kmax + 1)


def trim_drafts(b: StepBatch, keep: np.ndarray) -> StepBatch:
    """The batch with scheduled sequence i verifying only its first keep[i] <= planned drafts: the rows of
    the others are dropped (tokens, sampled rows and their settings, bitmask rows), the layout rebuilt by
    `attention_layout`, prompt-logprob rows re-indexed. The worker calls this when its proposer held fewer
    drafts than the engine planned (async scheduling plans before the count is known), so a short draft
    block costs a short verify. `assumed_drafts` and everything else the engine planned stay as they are:
    to the engine a dropped row is a rejected draft. `b` is not modified."""
    sq, a = b.seqs, b.attn
    drop = sq.num_drafts - keep
    if (drop < 0).any() or (keep < 0).any():
        raise ValueError(f"trim_drafts: keep {keep.tolist()} outside [0, planned {sq.num_drafts.tolist()}]")
    n = sq.num_new + sq.num_drafts
    flat0 = np.cumsum(n) - n
    seq_of = np.repeat(np.arange(len(n)), n)
    kept = (np.arange(len(seq_of)) - flat0[seq_of]) < (sq.num_new + keep)[seq_of]     # [N] flat tokens kept
    new_index = np.cumsum(kept) - 1
    attn = attention_layout(a.input_ids[kept], sq.starts, sq.num_new, keep, sq.samples, a.block_tables)
    row_kept = kept[a.logit_rows]                                                       # [R] sampled rows kept
    sp = b.sampling
    per_row = {f: getattr(sp, f)[row_kept] for f in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                                                     "frequency_penalty", "repetition_penalty", "seeds", "counters")}
    if sp.bias is not None:
        keep_entry = row_kept[sp.bias[0]]
        new_row = np.cumsum(row_kept) - 1
        per_row.update(bias=np.stack([new_row[sp.bias[0][keep_entry]], sp.bias[1][keep_entry]]),
                       bias_values=sp.bias_values[keep_entry])
    sampling = dataclasses.replace(sp, bitmask=None if sp.bitmask is None else sp.bitmask[row_kept], **per_row)
    spec = dataclasses.replace(b.spec, row_layout=sampled_row_layout(keep[b.spec.batch_index]))
    plp = dataclasses.replace(b.prompt_lp, rows=new_index[b.prompt_lp.rows])
    seqs = dataclasses.replace(sq, num_drafts=keep.astype(np.int64))
    return StepBatch(attn=attn, seqs=seqs, sampling=sampling, spec=spec, prompt_lp=plp,
                     finished_seq_ids=b.finished_seq_ids, shadow_seq_ids=b.shadow_seq_ids)


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _encode(parts: tuple) -> tuple:
    """The fields of dataclass instances `parts` as (values with every array replaced by None,
    [(value index, dtype, shape)], one blob of the arrays' bytes)."""
    values: list = []
    arrays: list[tuple[int, str, tuple[int, ...]]] = []
    chunks: list[bytes] = []
    for part in parts:
        for name in _names(type(part)):
            v = getattr(part, name)
            if isinstance(v, np.ndarray):
                arrays.append((len(values), v.dtype.str, v.shape))
                raw = np.ascontiguousarray(v).tobytes()
                chunks.append(raw + bytes(-len(raw) % _ALIGN))
                v = None
            values.append(v)
    return tuple(values), tuple(arrays), b"".join(chunks)


def _decode(classes: tuple[type, ...], values: tuple, arrays: tuple, blob: bytes) -> list:
    values = list(values)
    # A bytearray, so that the arrays are writable: the worker corrects positions and fills inputs in place.
    raw = np.frombuffer(bytearray(blob), dtype=np.uint8)
    offset = 0
    for i, dtype, shape in arrays:
        dt = _dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        values[i] = raw[offset:offset + n].view(dt).reshape(shape)
        offset += n + (-n % _ALIGN)
    parts, start = [], 0
    for cls in classes:
        n = len(_names(cls))
        parts.append(cls(*values[start:start + n]))
        start += n
    return parts


def _decode_result(values: tuple, arrays: tuple, blob: bytes) -> StepResult:
    return _decode((StepResult,), values, arrays, blob)[0]


@dataclass
class StepResult:
    tokens: np.ndarray | None = None            # [S, K+1]; a sequence emits tokens[s, :accepted[s] + 1]
    accepted: np.ndarray | None = None          # [S] drafts accepted
    num_drafts: np.ndarray | None = None        # [S] drafts verified
    logprobs: np.ndarray | None = None          # [S, K+1] raw logprob of each emitted token
    top_ids: np.ndarray | None = None           # [S, K+1, n]
    top_logprobs: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None   # [P]
    prompt_top_ids: np.ndarray | None = None    # [P, n]
    prompt_top_logprobs: np.ndarray | None = None
    # Filled by the worker after the step: its proposer's drafts for each sampling sequence.
    next_num_drafts: np.ndarray | None = None   # [S]
    next_draft_ids: list[list[int]] | np.ndarray | None = None   # [S][k_s], only where spec.return_drafts
    drafter_seconds: float = 0.0                # the proposer's wall time in this step (host clock)
    shadow: dict | None = None                  # a shadow drafter's tallies of this step (`spec/shadow.py`)

    def __reduce__(self):
        return _decode_result, _encode((self,))


@dataclass(frozen=True)
class ResultField:
    name: str
    kind: str                                           # "i" (int64) or "f" (float32)
    shape: Callable[[StepBatch], tuple[int, ...] | None]   # None: not in this step's result


def _sampled(b: StepBatch) -> bool:
    return b.num_sampling > 0


def _s_k1(b: StepBatch) -> tuple[int, int]:
    return tuple(b.spec.row_layout.shape)


def _device_drafts(b: StepBatch) -> bool:
    return _sampled(b) and b.spec.max_drafts_next > 0


def _lp(b: StepBatch) -> bool:
    return _sampled(b) and b.sampling.num_logprobs >= 0


def _top(b: StepBatch) -> bool:
    return _sampled(b) and b.sampling.num_logprobs > 0


def _plp(b: StepBatch) -> bool:
    return b.prompt_lp.num >= 0 and len(b.prompt_lp.rows) > 0


RESULT_FIELDS: tuple[ResultField, ...] = (
    ResultField("tokens", "i", lambda b: _s_k1(b) if _sampled(b) else None),
    ResultField("accepted", "i", lambda b: (b.num_sampling,) if _sampled(b) else None),
    ResultField("num_drafts", "i", lambda b: (b.num_sampling,) if _sampled(b) else None),
    ResultField("next_num_drafts", "i", lambda b: (b.num_sampling,) if _device_drafts(b) else None),
    ResultField("next_draft_ids", "i",
                lambda b: (b.num_sampling, b.spec.max_drafts_next) if _device_drafts(b) else None),
    ResultField("logprobs", "f", lambda b: _s_k1(b) if _lp(b) else None),
    ResultField("top_ids", "i", lambda b: (*_s_k1(b), b.sampling.num_logprobs) if _top(b) else None),
    ResultField("top_logprobs", "f", lambda b: (*_s_k1(b), b.sampling.num_logprobs) if _top(b) else None),
    ResultField("prompt_logprobs", "f", lambda b: (len(b.prompt_lp.rows),) if _plp(b) else None),
    ResultField("prompt_top_ids", "i",
                lambda b: (len(b.prompt_lp.rows), b.prompt_lp.num) if _plp(b) and b.prompt_lp.num > 0 else None),
    ResultField("prompt_top_logprobs", "f",
                lambda b: (len(b.prompt_lp.rows), b.prompt_lp.num) if _plp(b) and b.prompt_lp.num > 0 else None),
)


ResultLayout = tuple[tuple[ResultField, tuple[int, ...]], ...]


def result_layout(batch: StepBatch) -> ResultLayout:
    """The fields this batch's result holds, with their shapes (computed once per step, used by both
    `pack` and `unpack`)."""
    layout = []
    for f in RESULT_FIELDS:
        shape = f.shape(batch)
        if shape is not None:
            layout.append((f, shape))
    return tuple(layout)


def pack(layout: ResultLayout, values: dict, cat: Callable, empty_int, empty_float) -> tuple:
    """Flattens the step's result tensors, in declaration order, into one int and one float tensor.
    `values` must hold exactly the fields the layout declares (a mismatch is a bug, raised here)."""
    ints, floats = [], []
    for f, shape in layout:
        t = values[f.name]
        if tuple(t.shape) != shape:
            raise AssertionError(f"result field {f.name}: shape {tuple(t.shape)}, declared {shape}")
        (ints if f.kind == "i" else floats).append(t.reshape(-1))
    return (cat(ints) if ints else empty_int), (cat(floats) if floats else empty_float)


def unpack(layout: ResultLayout, ints: np.ndarray, floats: np.ndarray) -> StepResult:
    """The inverse of `pack`, on the host."""
    res = StepResult()
    oi = of = 0
    for f, shape in layout:
        n = math.prod(shape)
        if f.kind == "i":
            setattr(res, f.name, ints[oi:oi + n].reshape(shape))
            oi += n
        else:
            setattr(res, f.name, floats[of:of + n].reshape(shape))
            of += n
    return res
