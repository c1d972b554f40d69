"""The tensor-parallel process group and the collectives the layers own.

One group spans every rank: nccl when the rank has a CUDA device, gloo otherwise. A second, always-gloo
group carries the control channel (host bytes), so on GPU the control traffic never queues behind the
model's collectives. At one rank every collective is the identity, and a sharded model in a process
that never joined a group gets an error saying so instead of a hang.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from namazu.distributed.env import RankEnv

# An idle server waits in the control channel for its next step indefinitely; a dead or hung peer is
# detected by the engine (process sentinels, heartbeats), which then ends every rank.
_IDLE_TIMEOUT = datetime.timedelta(days=7)
_control_group: dist.ProcessGroup | None = None


def init_tensor_parallel(env: RankEnv, device: torch.device) -> str:
    """Joins the group through torch's env:// rendezvous (the variables of `env`); returns the backend."""
    global _control_group
    os.environ.update(env.export())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the machine's cores: without a say from the user, each takes its share, so
        # that four ranks on two cores run one thread each instead of fighting over eight.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world_size))
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=_IDLE_TIMEOUT)
    _control_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return backend


def check_devices(device: str, local_ranks: int) -> None:
    """A node's ranks each need their own GPU (NCCL refuses two ranks on one device): refuse before any
    rank starts when this node has fewer."""
    if local_ranks > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        found = torch.cuda.device_count()
        if found < local_ranks:
            raise ValueError(f"--tensor-parallel-size needs {local_ranks} GPUs on this node (one per rank), found "
                             f"{found}; use fewer ranks, or --device cpu")


def control_group() -> dist.ProcessGroup:
    if _control_group is None:
        raise RuntimeError("this process has not joined a tensor-parallel group (init_tensor_parallel)")
    return _control_group


def _check(size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"a shard of a tensor-parallel model of size {size} runs only in a process that "
                           "joined its group (namazu.distributed.init_tensor_parallel); serve it with "
                           "--tensor-parallel-size, or load it with tp_size 1")


def all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sum over the ranks (in place; returns x)."""
    if size == 1:
        return x
    _check(size)
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, size: int, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along `dim`, in rank order."""
    if size == 1:
        return x
    _check(size)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, size: int, src: int = 0) -> torch.Tensor:
    """Rank `src`'s x on every rank (in place; returns x)."""
    if size == 1:
        return x
    _check(size)
    dist.broadcast(x, src)
    return x


def shutdown() -> None:
    """Leaves the group after every rank has reached this point: a rank that closes its connections while a
    peer is still finishing the last broadcast can make gloo abort that peer (SIGABRT at exit, seen once in
    a full test run). Only the orderly stop gets here; a failed rank exits without it."""
    global _control_group
    if dist.is_initialized():
        if _control_group is not None:
            try:
                dist.monitored_barrier(group=_control_group, timeout=datetime.timedelta(seconds=10))
            except RuntimeError:
                pass    # a peer is already gone: nothing left to wait for
        dist.destroy_process_group()
    _control_group = None


def min_over_ranks(n: int) -> int:
    """The smallest of every rank's `n` (host integers, over the control group): the KV blocks every
    rank can hold, ranks on other nodes included."""
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
    return int(t.item())
