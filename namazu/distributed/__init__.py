"""Tensor parallelism across processes: the process group, its collectives and the control channel.

- `env.py`: the torchrun-style environment of one rank (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
  LOCAL_RANK, plus NNODES / NODE_RANK for a multi-node launch).
- `group.py`: joining the group (nccl where CUDA is available, gloo otherwise) and the collectives the
  layers call (`all_reduce`, `all_gather`, `broadcast`); at one rank they are the identity.
- `control.py`: the channel that hands each command (a step's batch) from rank 0 to every rank as the
  bytes the engine pickled once.
- `decisions.py`: rank 0's sampled tokens, acceptance counts and device drafts, broadcast to every rank.
- `health.py`: heartbeats and the watchdog that ends a worker whose engine is gone.
- `node.py`: `python -m namazu.distributed.node`, the ranks of a further node of a multi-node launch.
"""
