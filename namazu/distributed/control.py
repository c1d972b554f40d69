"""The control channel: rank 0 hands every command to the other ranks as bytes.

The engine pickles a step's batch once and sends those bytes to rank 0; rank 0 broadcasts the same
bytes (a length, then the payload) over the gloo control group and every rank unpickles its own copy.
So a batch is serialised once whatever the number of ranks, and ranks on other nodes receive it the same
way as local ones.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from namazu.distributed.group import control_group


def share(payload: bytes | None, rank: int) -> bytes:
    """Rank 0 passes `payload`, the others None; every rank returns rank 0's bytes."""
    group = control_group()
    length = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.long)
    dist.broadcast(length, 0, group=group)
    if rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, 0, group=group)
    return payload if rank == 0 else buf.numpy().tobytes()
