"""A guard that makes host synchronisation inside an engine step an error.

A step must not read device values on the host: that stalls the accelerator queue (and on a GPU costs
more than the kernels of a small decode step). On CPU nothing stalls, so the guard catches the *code*
that would: inside `no_host_sync()`,
- Python-level reads raise: Tensor.item, tolist, numpy, cpu, __bool__, __int__, __float__, __index__;
- aten ops whose result size or value must reach the host raise: _local_scalar_dense (every scalar read),
  nonzero, masked_select, unique, bincount, repeat_interleave with tensor repeats, indexing with a
  boolean mask, and any device-to-host copy.
Enable it in the runner with `--debug-no-host-sync`; the engine tests run every kind of step under it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """Raised when code inside a no-host-sync scope reads device data on the host."""


_TENSOR_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")

_SYNC_OPS = {
    aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
    aten.unique_dim, aten.unique_consecutive, aten.bincount, aten.argwhere, aten.masked_scatter,
}


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _SyncDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            raise HostSyncError(f"{packet.__name__} needs a device value on the host")
        if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor \
                and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave with tensor repeats has a data-dependent size")
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) and _bool_index(args[1]):
            raise HostSyncError("indexing with a boolean mask has a data-dependent size (use torch.where)")
        if packet is aten._to_copy:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu":
                raise HostSyncError("device-to-host copy inside a step")
        if packet is aten.copy_ and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            raise HostSyncError("device-to-host copy inside a step")
        return func(*args, **kwargs)


def _raiser(name: str):
    def method(self, *args, **kwargs):
        raise HostSyncError(f"Tensor.{name}() reads device data on the host inside a step")
    return method


@contextlib.contextmanager
def no_host_sync(enabled: bool = True) -> Iterator[None]:
    """Within the block, any host synchronisation raises HostSyncError (not thread-safe: it patches
    torch.Tensor for the whole process; meant for tests and --debug-no-host-sync)."""
    if not enabled:
        yield
        return
    saved = {name: torch.Tensor.__dict__.get(name) for name in _TENSOR_METHODS}
    for name in _TENSOR_METHODS:
        setattr(torch.Tensor, name, _raiser(name))
    try:
        with _SyncDetector():
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
