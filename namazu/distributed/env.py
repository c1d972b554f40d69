"""The environment of one tensor-parallel rank, in torchrun's variable names.

The server starts the ranks of its own node itself and sets these for each; on other nodes
`python -m namazu.distributed.node` starts the remaining ranks from the same variables (NNODES,
NODE_RANK, MASTER_ADDR, MASTER_PORT), as torchrun would.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def export(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous reads."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks of a `world_size` group this node runs: nnodes nodes with world_size / nnodes each."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"NODE_RANK={self.node_rank} of NNODES={self.nnodes}: need 0 <= NODE_RANK < NNODES")
        if self.world_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.world_size} is not divisible by NNODES={self.nnodes}")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def rank_env(self, rank: int) -> RankEnv:
        return RankEnv(rank, self.world_size, rank % self.ranks_per_node, self.master_addr, self.master_port)

    @classmethod
    def from_environ(cls, world_size: int, environ: dict[str, str] | None = None) -> NodeLayout:
        """NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT when set (a multi-node launch); otherwise one
        node on the loopback address and a free port."""
        env = os.environ if environ is None else environ
        nnodes = int(env.get("NNODES", "1"))
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else (free_port() if nnodes == 1 else 29500)
        return cls(world_size, nnodes, int(env.get("NODE_RANK", "0")), addr, port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
