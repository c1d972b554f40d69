"""`python -m namazu.distributed.node`: the ranks of one more node of a multi-node tensor-parallel server.

The server runs on node 0 and starts that node's ranks itself; every other node runs this command with
the same engine flags and the torchrun-style variables of the launch:

    NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example MASTER_PORT=29500 \\
        python -m namazu.distributed.node --model /ckpt --tp 16

(the server on node 0 gets NNODES=2 NODE_RANK=0 and the same MASTER_ADDR / MASTER_PORT). These ranks
receive each step through the control channel from rank 0 and answer no one: their errors reach the
engine as the failure of a collective on node 0. The command exits when its ranks do, non-zero if any
rank failed (the others are then ended).
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import time

from namazu.assets import resolve_model_path
from namazu.distributed.env import NodeLayout
from namazu.engine_config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m namazu.distributed.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_cli_args(args)
        layout = NodeLayout.from_environ(config.tensor_parallel_size)
        if "MASTER_PORT" not in os.environ or layout.node_rank == 0:
            raise ValueError("set NODE_RANK >= 1, NNODES, MASTER_ADDR and MASTER_PORT (node 0 runs the server)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from namazu.config import ModelConfig
    from namazu.spec.selection import choose_speculation
    from namazu.worker.rank import worker_main

    # The same choice as the engine's on node 0, so every rank holds the same proposer.
    model_path = resolve_model_path(config.model)
    choice = choose_speculation(config, model_path, ModelConfig.from_pretrained(model_path))
    config, drafter = choice.resolve(config), choice.drafter
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"namazu-worker-{rank}",
                         args=(None, config, str(model_path), layout.rank_env(rank),
                               logging.INFO, drafter, None, None, os.getpid()))
             for rank in layout.local_ranks]
    for proc in procs:
        proc.start()
    logging.info("node %d: ranks %s started, pid %s", layout.node_rank, list(layout.local_ranks),
                 [q.pid for q in procs])
    while all(q.exitcode in (None, 0) for q in procs) and any(q.is_alive() for q in procs):
        time.sleep(0.5)
    failed = [(rank, q.exitcode) for rank, q in zip(layout.local_ranks, procs) if q.exitcode not in (None, 0)]
    for q in procs:
        if q.is_alive():
            q.kill()
        q.join()
    if failed:
        print(f"error: rank(s) {failed} (rank, exit code) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
