"""Graph mode's drafted step: `spec/drafted_step.drafted_tail` compiled per verify entry of the ladder, run
right after the entry's compiled forward, so that a step that verifies and drafts has no eager op between
its inputs and its packed result but the draft buffer's gather and write. A plain decode entry gets the
drafter's context write compiled the same way: it runs on every step, drafting or not (the drafter reads
the context of every position once drafting resumes), and eagerly it was about 20 small ops, an eighth of
a compiled plain step at batch 1.

A tree entry (`--speculative-tree-budget`: Bp x 1 + N rows, a tree mask among its buffers) has no tail:
`drafted_tail` is the chain's rule, so a tree step's acceptance (`TreeStep.accept`), path move
(`commit_path`) and next tree (`Speculator._propose_tree`) run eagerly after the compiled forward, as do a
plain step's that drafts a tree; the drafter's context write is compiled for both (`context_entries`).

Per verify entry (Bp sequences x 1 + K rows) up to the batch size at which the engine still drafts, three
compiled variants: every sequence greedy; sampled (temperature, top-k, top-p, min-p and seeds as per-row
tensors: masks, not recompiles); and sampled without top-k, top-p and min-p, for batches none of whose
rows sets them (their sort over the vocabulary is most of a sampled tail's time on CPU); and each of them
again with a grammar bitmask input, for steps whose batch holds a grammar sequence (the engine fills the
rows along the drafts, as for an eager step; the entry's bitmask buffer holds all bits set on every other
row). The block table's width is a dynamic
dimension, as in the forward, so each variant compiles once. A step the tail does not cover runs the
forward's graph and then the eager rest (`ModelRunner._sample_and_verify`): logprobs, penalties, logit
bias, a host proposer, tensor parallelism, or a batch above the drafting limit; `eligible` says which, and
the runner logs each reason once. After its first call each compiled function is called directly
(`worker/direct_call.py`): torch.compile's frame cost about 0.35 ms of a 1.3 ms tail.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from namazu.spec.drafted_step import TailInputs, drafted_tail
from namazu.step.batch import StepBatch
from namazu.worker.direct_call import DirectCall, GraphRecorder
from namazu.worker.graph_mode import GraphEntry, StepGraphs, compile_backend, own_code

logger = logging.getLogger(__name__)


class DraftedTails:
    """The compiled tails of one runner's verify entries."""

    def __init__(self, graphs: StepGraphs, proposer, vocab_size: int, max_batch: int, sampled: bool = True):
        self.graphs, self.proposer, self.vocab_size = graphs, proposer, vocab_size
        self.k = graphs.k
        self.device = graphs.device
        # The tail implements the chain's acceptance and drafting: a tree entry's step (and with a tree budget
        # a plain step that drafts: it drafts a tree) runs the eager rest after the compiled forward.
        self.trees = graphs.tree_nodes > 0
        self.entries = [e for (bp, tq), e in graphs.entries.items()
                        if tq == 1 + self.k and e.tree_mask is None and bp <= max_batch]
        self.max_batch = max((e.bp for e in self.entries), default=0)
        self.draws_q = bool(getattr(proposer, "sample_drafts", False))
        # Compiled functions by key: (bp, False) / (bp, True) the greedy / sampled tail of a verify entry,
        # (bp, PLAIN) the greedy tail of a plain entry whose step drafts (drafting resumes after a step
        # that did not draft: a probe of the draft policy, or a sequence it had paused), each with a grammar
        # bitmask under `masked(variant)`; (bp, None) a plain entry's context write.
        self.fns: dict[tuple[int, bool | str], Callable] = {}
        # Per compiled function: its recorder, and once a call through torch.compile was recorded, the
        # direct call of it (`worker/direct_call.py`).
        self._recorders: dict[tuple[int, bool | str | None], GraphRecorder] = {}
        self.direct: dict[tuple[int, bool | str | None], DirectCall] = {}
        self._zero_q: dict[int, torch.Tensor] = {}
        self._tail_buffers: dict[tuple[int, int], tuple[TailInputs, dict[str, np.ndarray]]] = {}
        self._bitmasks: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}
        self._padding = {name: vocab_size if pad is None else pad for name, (_, pad) in _HOST_FIELDS.items()}
        self._called: set[tuple[int, bool | str | None]] = set()
        # Steps each tail variant ran since the warm-up (its own calls not counted).
        self.calls: collections.Counter[tuple[int, bool | str]] = collections.Counter()
        self._not_direct: set[tuple[int, bool | str | None]] = set()
        # Every variant compiles under every backend. Inductor (CPU) once compiled the sampled ones into kernels
        # that stored past their buffers: the seeded noise's column offsets became an overflowing signed index
        # product that gcc optimised on (`layers/sampler.column_offsets` loads them from a table now).
        # sampled=False: the greedy variant only (sampled sequences do not draft; a step that does runs eagerly).
        self.variants = (False, True, UNFILTERED) if sampled else (False,)
        self.plain_entries = [e for (bp, tq), e in graphs.entries.items() if tq == 1]
        self.resume_entries = [] if self.trees else [e for e in self.plain_entries if e.bp <= self.max_batch]
        # The drafter's context write compiled per plain entry, and per tree entry (the tail that would write
        # it runs eagerly there; its rows' rotary positions are the entry's `positions`, as the eager write's).
        self.context_entries = self.plain_entries + [e for e in graphs.entries.values() if e.tree_mask is not None]
        self.context_fns: dict[tuple[int, int], Callable] = {}

    def use_proposer(self, proposer) -> None:
        self.proposer = proposer
        self.draws_q = bool(getattr(proposer, "sample_drafts", False))
        self._called.clear()
        # The direct calls hold the old drafter's parameters and cache: each learns again on its next call.
        self.direct.clear()

    def _compile(self, fn: Callable, key: tuple[int, bool | str | None]) -> Callable:
        self._recorders[key] = GraphRecorder(compile_backend(self.graphs.backend))
        return torch.compile(fn, backend=self._recorders[key], dynamic=False, fullgraph=True)

    def _call(self, key: tuple[int, bool | str | None], fn: Callable, args: tuple, per_call: dict, width: int):
        """`fn(*args)`: directly once a call of it was learnt, else through torch.compile (guards evaluated
        on the first call only: after it, inputs differ in values and the table's width alone), recording
        the call to learn from it."""
        direct = self.direct.get(key)
        if direct is not None:
            with _disable_current_modes():
                return direct(per_call, width)
        stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if key in self._called \
            else contextlib.nullcontext()
        recorder = self._recorders[key]
        with _disable_current_modes(), stance, recorder.record():
            out = fn(*args)
        self._called.add(key)
        with _disable_current_modes():
            learnt = DirectCall.learn(recorder.last, per_call, width, out)
        if learnt is not None:
            self.direct[key] = learnt
        elif key not in self._not_direct:
            self._not_direct.add(key)
            logger.warning("graph mode: the compiled %s of %d sequences is called through torch.compile's frame "
                           "(a direct call did not reproduce it)",
                           "context write" if key[1] in (None, TREE_CONTEXT) else f"tail ({key[1]})", key[0])
        return out

    @torch.inference_mode()   # as the runner's steps: the compiled code is guarded on the grad mode
    def warm_up(self, progress: bool = True) -> float:
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        todo = [(e, sampled) for e in self.entries for sampled in self.variants] + \
            [(e, PLAIN) for e in self.resume_entries]
        todo += [(e, masked(v)) for e, v in todo]
        for e, variant in tqdm(todo, desc="graph mode: compiling drafted steps", disable=not progress):
            sampled = unmasked(variant) in (True, UNFILTERED)
            name = {False: "greedy", True: "sampled", UNFILTERED: "unfiltered", PLAIN: "resume"}[unmasked(variant)] \
                + ("_masked" if variant in MASKED.values() else "")
            fn = own_code(drafted_tail, f"_drafted_tail_b{e.bp}_q{e.tq}_{name}")
            self.fns[(e.bp, variant)] = self._compile(fn, (e.bp, variant))
            # The entry's own forward outputs (padding rows only): a step passes these very tensors, so the
            # compiled tail's guards (shapes, strides) hold from its first real call on.
            logits, _, captured = self.graphs.launch(e, 2)
            t = self.padding_inputs(e.bp, e.tq, sampled, with_bitmask=variant in MASKED.values())
            self.run(e, 2, logits, e.greedy, captured, t, sampled, filtered=unmasked(variant) is not UNFILTERED)
        for e in tqdm(self.context_entries, desc="graph mode: compiling drafter context writes", disable=not progress):
            fn = own_code(_write_context, f"_write_context_b{e.bp}_q{e.tq}")
            self.context_fns[(e.bp, e.tq)] = self._compile(fn, _context_key(e))
            _, _, captured = self.graphs.launch(e, 2)
            self.write_context(e, captured)
        self.calls.clear()
        return time.perf_counter() - t0

    def writes_context(self, entry: GraphEntry) -> bool:
        return (entry.bp, entry.tq) in self.context_fns

    def write_context(self, e: GraphEntry, captured: dict[int, torch.Tensor]) -> None:
        """The drafter's context entries of every row of a plain or tree entry's forward (padding rows write the
        scratch slot, as in the target's cache)."""
        per_call = {f"captured{i}": h for i, h in captured.items()}
        self._call(_context_key(e), self.context_fns[(e.bp, e.tq)],
                   (self.proposer, captured, e.positions, e.slot_mapping), per_call, 0)

    def eligible(self, b: StepBatch, entry: GraphEntry, world_size: int) -> str | None:
        """None when the tail covers this graph step, else why not (for a once-per-reason log line)."""
        sp = b.sampling
        if not b.spec.max_drafts_next:
            return "a step that does not draft"
        if self.trees:
            return "draft trees (the compiled tail is the chain's rule; a tree's acceptance, path move and drafting)"
        if entry.tq == 1 and not sp.all_greedy:
            return "a sampled plain decode step that drafts"
        if entry.bp > self.max_batch:
            return f"batches above {self.max_batch} sequences (the engine stops drafting there)"
        if world_size > 1:
            return "tensor parallelism (the decision is broadcast between the graphs)"
        if sp.num_logprobs >= 0:
            return "logprobs"
        if sp.any_penalty or sp.bias is not None:
            return "penalties or logit bias"
        return None

    def padding_inputs(self, bp: int, tq: int, sampled: bool, with_bitmask: bool = False) -> TailInputs:
        """The entry's buffers holding padding only (identity settings, no drafts, every token allowed): the
        warm-up's inputs."""
        t, host = self._buffers(bp, tq)
        for name, a in host.items():
            a[...] = self._padding[name]
        q = self._q(bp) if sampled and self.draws_q else None
        bitmask = self._bitmask(bp, tq) if with_bitmask else None
        if bitmask is not None:
            bitmask[1].fill(-1)
        return dataclasses.replace(t, has_q=torch.zeros(bp, dtype=torch.bool, device=self.device)
                                   if q is not None else None, q=q,
                                   bitmask=bitmask[0] if bitmask is not None else None)

    def inputs(self, b: StepBatch, entry: GraphEntry, num_drafts: np.ndarray, slots: np.ndarray, drafts,
               slot_index: torch.Tensor, sampled: bool) -> TailInputs:
        """The step's per-sequence values padded to the entry, written into the entry's own buffers (CPU
        tensors written through numpy views: no tensor is made per step). The greedy variant reads the
        draft counts only; the sampled one every setting."""
        bp, s, tq = entry.bp, len(num_drafts), entry.tq
        t, host = self._buffers(bp, tq)
        values = {"num_drafts": num_drafts}
        if sampled:
            sp, first = b.sampling, b.spec.row_layout[:, 0]
            values.update(temperature=sp.temperature[first], top_k=sp.top_k[first], top_p=sp.top_p[first],
                          min_p=sp.min_p[first], seeds=sp.seeds[first],
                          # a sequence's rows take consecutive output indices from its first sampled row's
                          counters=sp.counters[first][:, None] + np.arange(tq))
        for name, v in values.items():
            host[name][:s] = v
            host[name][s:] = self._padding[name]
        t = dataclasses.replace(t, has_q=None, q=None, bitmask=None)
        if b.sampling.bitmask is not None:
            t.bitmask = self._fill_bitmask(b, bp, tq, num_drafts)
        if sampled and self.draws_q:
            flags = np.zeros(bp, dtype=bool)
            flags[:s] = [drafts.has_probs.get(int(slot), False) for slot in slots]
            t.has_q = torch.from_numpy(flags).to(self.device, non_blocking=True)
            if drafts.probs is None or not flags.any():
                t.q = self._q(bp)
            else:
                index = torch.zeros(bp, dtype=torch.long, device=self.device)
                index[:s] = slot_index
                t.q = drafts.probs[index, :self.k]
        return t

    def _fill_bitmask(self, b: StepBatch, bp: int, tq: int, num_drafts: np.ndarray) -> torch.Tensor:
        """The step's bitmask rows (one per sampled row, `b.spec.row_layout` order) at the entry's rows
        (sequence s's row j at s * tq + j); every other row allows every token."""
        t, host = self._bitmask(bp, tq)
        host.fill(-1)
        layout = b.spec.row_layout
        s = len(num_drafts)
        j = np.arange(layout.shape[1])
        real = j[None, :] <= num_drafts[:, None]                         # [S, K+1] a verify row, not padding
        seq, col = np.nonzero(real)
        host[seq * tq + col] = b.sampling.bitmask[layout[:s][real]]
        return t

    def _bitmask(self, bp: int, tq: int) -> tuple[torch.Tensor, np.ndarray]:
        if (bp, tq) not in self._bitmasks:
            host = np.full((bp * tq, -(-self.vocab_size // 32)), -1, dtype=np.int32)
            self._bitmasks[(bp, tq)] = (torch.from_numpy(host), host)
        return self._bitmasks[(bp, tq)]

    def _buffers(self, bp: int, tq: int) -> tuple[TailInputs, dict[str, np.ndarray]]:
        if (bp, tq) not in self._tail_buffers:
            # numpy arrays the tensors share memory with (made from the arrays: no host read of a tensor)
            host = {name: np.zeros((bp, tq) if name == "counters" else bp, dtype=dtype)
                    for name, (dtype, _) in _HOST_FIELDS.items()}
            tensors = {name: torch.from_numpy(a) for name, a in host.items()}
            self._tail_buffers[(bp, tq)] = (TailInputs(**tensors, has_q=None, q=None), host)
        return self._tail_buffers[(bp, tq)]

    def run(self, e: GraphEntry, width: int, logits: torch.Tensor, greedy: torch.Tensor,
            captured: dict[int, torch.Tensor], t: TailInputs, sampled: bool, filtered: bool = True):
        """filtered=False: no row of the batch sets top-k, top-p or min-p (the unfiltered variant)."""
        table = e.block_tables[:, :width]
        variant = PLAIN if e.tq == 1 else UNFILTERED if sampled and not filtered else sampled
        key = (e.bp, masked(variant) if t.bitmask is not None else variant)
        filtered = variant is not UNFILTERED
        self.calls[key] += 1
        fn = self.fns.get(key)
        if fn is None:         # the eager variant: under the host-sync guard like every eager op
            return drafted_tail(self.proposer, logits, greedy, captured, e.input_ids, e.positions, e.slot_mapping,
                                table, t, sampled, self.k, filtered)
        # As the forward's calls: the tail was traced with fullgraph=True (no host read can hide in it). Its
        # per-call inputs: the forward's outputs, the step's values and the table's view.
        per_call = {"logits": logits, "greedy": greedy, "table": table}
        per_call.update((f"captured{i}", h) for i, h in captured.items())
        per_call.update((f"t.{name}", getattr(t, name)) for name in _TAIL_FIELDS)
        if key not in self.direct:
            torch._dynamo.mark_dynamic(table, 1, min=2, max=max(3, self.graphs.max_width))
        return self._call(key, fn, (self.proposer, logits, greedy, captured, e.input_ids, e.positions, e.slot_mapping,
                                    table, t, sampled, self.k, filtered), per_call, width)

    def _q(self, bp: int) -> torch.Tensor:
        if bp not in self._zero_q:
            self._zero_q[bp] = torch.zeros(bp, self.k, self.vocab_size, device=self.device)
        return self._zero_q[bp]


_TAIL_FIELDS = tuple(f.name for f in dataclasses.fields(TailInputs))
PLAIN = "plain"     # the key of a plain entry's tail (`DraftedTails.fns`)
UNFILTERED = "unfiltered"   # the key of the sampled variant without top-k, top-p and min-p
# The keys of the variants that take a grammar bitmask, by the variant without it.
MASKED = {False: "greedy-masked", True: "sampled-masked", UNFILTERED: "unfiltered-masked", PLAIN: "plain-masked"}


def masked(variant: bool | str) -> str:
    return MASKED[variant]


def unmasked(variant: bool | str) -> bool | str:
    return next((v for v, m in MASKED.items() if m == variant), variant)


TREE_CONTEXT = "tree context"   # the key of a tree entry's context write ((bp, None): a plain entry's)


def _context_key(e: GraphEntry) -> tuple[int, str | None]:
    return (e.bp, None if e.tree_mask is None else TREE_CONTEXT)


# The tail's host-written inputs: dtype and a padded sequence's value (identity settings, no drafts; top_k
# None: the vocabulary size).
_HOST_FIELDS = {"num_drafts": (np.int64, 0), "temperature": (np.float32, 0.0), "top_k": (np.int64, None),
                "top_p": (np.float32, 1.0), "min_p": (np.float32, 0.0), "seeds": (np.int64, 0),
                "counters": (np.int64, 0)}


def _write_context(proposer, captured: dict[int, torch.Tensor], positions: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    proposer.write_context(captured, positions, slot_mapping)
