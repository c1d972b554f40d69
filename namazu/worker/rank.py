"""One tensor-parallel rank: the `Worker` that owns a ModelRunner, and `worker_main`, the loop of a rank's
process (commands from the engine's pipe, steps from the shared-memory ring, shared with the other ranks over
the control channel). The engine drives ranks through an executor (`executor.py`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from namazu.distributed.control import share
from namazu.distributed.env import RankEnv
from namazu.distributed.group import init_tensor_parallel, min_over_ranks
from namazu.distributed.group import shutdown as shutdown_group
from namazu.distributed.health import start_heartbeat, start_parent_watchdog
from namazu.engine_config import EngineConfig
from namazu.spec.proposer import Proposer
from namazu.step.batch import StepBatch, StepResult
from namazu.step.channel import StepReader, is_notice
from namazu.step.delta import MAGIC_BYTES, StepDecoder

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    rank: int
    num_kv_blocks: int          # what this rank could hold (before allocation), then what it holds
    device: str
    dtype: str
    vocab_size: int


class Worker:
    """One rank: owns a ModelRunner."""

    def __init__(self, config: EngineConfig, model_path: str | Path, rank: int = 0, world_size: int = 1,
                 proposer: Proposer | None = None):
        from namazu.worker.model_runner import ModelRunner

        self.rank = rank
        self.runner = ModelRunner(config, model_path, rank, world_size, proposer)
        self.decoder = StepDecoder()    # this rank's half of the step wire format's state
        self.staged_drafter: Proposer | None = None   # loaded beside the serving one (spec/drafter_swap.py)

    def info(self) -> WorkerInfo:
        r = self.runner
        blocks = r.num_blocks if r.cache is not None else r.plan_kv_blocks()
        return WorkerInfo(self.rank, blocks, str(r.device), str(r.dtype).replace("torch.", ""),
                          r.model_config.vocab_size)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, batch: StepBatch) -> StepResult | None:
        result = self.runner.execute(batch)
        return result if self.rank == 0 else None

    def execute_step(self, message: bytes | bytearray) -> StepResult | None:
        """A step as the engine sent it (`step_delta.py`: only what changed since the last step)."""
        return self.execute(self.decoder.decode(message))

    def skip_step(self, message: bytes | bytearray) -> None:
        """A step the engine dropped before it ran (`InlineExecutor.discard`): decoded, so that the wire
        format's state follows the engine's, and the sequences it says finished forgotten; nothing runs."""
        self.runner.skip(self.decoder.decode(message))

    def resident_memory(self) -> dict[str, int]:
        """This rank's weight bytes (parameters and buffers, each tensor once), KV-cache bytes and resident
        set size (Linux; 0 elsewhere): `LLMEngine.collective_rpc(Worker.resident_memory)`."""
        model, cache = self.runner.model, self.runner.cache
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        rss = 0
        with contextlib.suppress(OSError), open(f"/proc/{os.getpid()}/status") as f:
            rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        return {"rank": self.rank, "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "kv_cache_bytes": cache.nbytes if cache is not None else 0, "rss_bytes": rss}

    def start_profile(self) -> None:
        self.runner.profile = []

    def stop_profile(self) -> list:
        steps, self.runner.profile = self.runner.profile or [], None
        return steps


# Called with each rank's Worker once its model is loaded, in the worker process (a module-level function,
# so that it pickles): tests use it to reach inside a rank.
WorkerSetup = Callable[[Worker], None]



def worker_main(conn: Connection | None, config: EngineConfig, model_path: str, env: RankEnv, log_level: int,
                 proposer: Proposer | None, setup: WorkerSetup | None, beat: Any, parent_pid: int,
                 ring_name: str | None = None) -> None:
    """One rank's process. Rank 0 reads each command's bytes from the engine's pipe (a step: a notice
    pointing into the shared-memory ring `ring_name`, `step_channel.py`) and shares them with the other
    ranks over the control channel; every rank runs the command and, when the engine started it (a local
    rank), answers on its own pipe, so an error on any rank reaches the engine."""
    rank, world_size = env.rank, env.world_size
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    start_parent_watchdog(parent_pid)
    if beat is not None:
        start_heartbeat(beat)
    reply = conn.send if conn is not None else (lambda _msg: None)
    reader: StepReader | None = None
    try:
        if ring_name is not None:
            reader = StepReader(ring_name)
        if world_size > 1:
            from namazu.worker.model_runner import resolve_device

            init_tensor_parallel(env, resolve_device(config.device))
        worker = Worker(config, model_path, rank, world_size, proposer)
        if setup is not None:
            setup(worker)
        info = worker.info()
        if world_size > 1:
            info.num_kv_blocks = min_over_ranks(info.num_kv_blocks)    # ranks the engine did not start too
        reply(("ok", info))
    except BaseException:
        reply(("error", traceback.format_exc()))
        return
    stop = pickle.dumps(None)
    while True:
        raw = None
        if rank == 0:
            try:
                raw = conn.recv_bytes()
                if is_notice(raw):
                    raw = reader.read(raw)
            except (EOFError, OSError):
                raw = stop   # the engine is gone: tell the other ranks
        if world_size > 1:
            try:
                raw = share(raw, rank)
            except BaseException:
                reply(("error", f"rank {rank}: the control channel failed (a peer rank is gone)\n"
                                + traceback.format_exc()))
                os._exit(1)
        if raw[:8] == MAGIC_BYTES:
            try:
                reply(("ok", worker.execute_step(raw)))
            except BaseException:
                reply(("error", traceback.format_exc()))
            continue
        msg = pickle.loads(raw)
        if msg is None:
            break
        method, args = msg
        try:
            out = args[0](worker, *args[1:]) if method == "rpc" else getattr(worker, method)(*args)
            reply(("ok", out))
        except BaseException:
            reply(("error", traceback.format_exc()))
    if reader is not None:
        reader.close()
    if world_size > 1:
        shutdown_group()
