"""A compiled graph called past torch.compile's frame machinery, for graph mode's per-step calls on CPU.

torch.compile's frame costs a cache lookup, the bytecode that gathers the graph's inputs (every parameter
and buffer, by attribute) and the set-up around the call: about 0.1 ms of a 1.7 ms batch-1 forward, and
0.3-0.4 ms of the drafted step's compiled tail (its inputs are the drafter's parameters and cache, the
forward's outputs and a dataclass of per-sequence values), about 6% of a drafted step at batch 1.

A graph-mode call's inputs are the same tensors on every call (parameters, caches, the entry's buffers)
except for a few the caller names per call: the block table's view at the step's width, the forward's
outputs the tail reads, the tail's per-sequence values. So the argument list dynamo built for one call,
recorded by `GraphRecorder`, serves every later call with those replaced (`DirectCall`), and the width at
the positions of the graph's symbolic integers that held it (the table's width is the only dynamic
dimension; the view's row stride is symbolic too, and a constant of the caller's buffers).

What it must not miss: an input that changes per call without being named. `DirectCall.learn` accepts a
recorded call only if every named tensor is found once and some symbolic integer held the width, and only
if the direct call returns the traced call's outputs; a caller whose persistent inputs change (a new
drafter) drops its DirectCall and learns again on its next call through torch.compile.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch


class GraphRecorder:
    """A torch.compile backend (`backend`, such as `graph_mode.compile_backend`'s) that keeps, for a call made
    inside `record()`, the compiled graph, which of its inputs are symbolic integers, and the argument list
    dynamo built for that call."""

    def __init__(self, backend: Callable):
        self.backend = backend
        self._recording = False
        self.last: tuple[Callable, list[bool], list] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        symbolic = [isinstance(a, torch.SymInt) for a in example_inputs]
        fn = self.backend(gm, example_inputs)

        def call(*args):
            if self._recording:
                self.last = (fn, symbolic, list(args))
            return fn(*args)

        return call

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        self.last, self._recording = None, True
        try:
            yield
        finally:
            self._recording = False


class DirectCall:
    """A recorded call replayed with its named per-call tensors and its width replaced."""

    def __init__(self, fn: Callable, args: list, tensor_at: dict[int, str], width_at: list[int],
                 nones: list[bool] | None):
        self.fn, self.args, self.tensor_at, self.width_at = fn, args, tensor_at, width_at
        self.nones = nones      # the traced call's result: a tuple (None where it held None), or None

    @classmethod
    def learn(cls, recorded: tuple[Callable, list[bool], list] | None, per_call: Mapping[str, torch.Tensor | None],
              width: int, ref) -> DirectCall | None:
        """From the call `recorded` (GraphRecorder.last) that received `per_call` (name -> tensor; None: absent)
        at `width` and returned `ref` (a tuple of tensors and Nones, or None); None where it does not
        reproduce that call."""
        if recorded is None:
            return None
        fn, symbolic, args = recorded
        named = {id(t): name for name, t in per_call.items() if t is not None}
        if len(named) != sum(t is not None for t in per_call.values()):
            return None          # one tensor under two names: which to pass later is ambiguous
        tensor_at = {i: named[id(a)] for i, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) in named}
        # The symbolic integers at the width's value are the width; the others (the table view's row stride,
        # which the dynamic width makes symbolic too) are constants of the caller's buffers.
        width_at = [i for i, s in enumerate(symbolic) if s and args[i] == width]
        if len(set(tensor_at.values())) != len(tensor_at) or (any(symbolic) and not width_at):
            return None
        if ref is not None and not (isinstance(ref, tuple) and all(r is None or isinstance(r, torch.Tensor)
                                                                   for r in ref)):
            return None
        direct = cls(fn, [int(a) if isinstance(a, torch.SymInt) else a for a in args], tensor_at, width_at,
                     None if ref is None else [r is None for r in ref])
        out = list(direct.raw(per_call, width) or ())
        want = [r for r in ref if r is not None] if ref is not None else []
        same = len(out) == len(want) and all(isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
                                             for a, b in zip(out, want))
        return direct if same else None

    def raw(self, per_call: Mapping[str, torch.Tensor | None], width: int):
        """The compiled graph's own outputs (a flat sequence of tensors)."""
        args = list(self.args)
        for i, name in self.tensor_at.items():
            args[i] = per_call[name]
        for i in self.width_at:
            args[i] = width
        return self.fn(*args)

    def __call__(self, per_call: Mapping[str, torch.Tensor | None], width: int):
        """The traced call's result for these per-call tensors and width."""
        out = self.raw(per_call, width)
        if self.nones is None:
            return None
        flat = iter(out)
        return tuple(None if none else next(flat) for none in self.nones)
