"""Workers: the model runner behind a message interface, one per tensor-parallel rank.

The engine talks to an Executor. At start-up every rank reports how many KV blocks it could hold
(`infos()`) and the engine allocates the minimum on all of them (`allocate_kv_cache`), so no rank is
asked to hold more than it can. Per step, `submit(batch)` sends the same StepBatch to every rank and
returns at once; `collect()` waits for rank 0's StepResult. Between the two the engine plans the next step (async
scheduling); `execute(batch)` is both at once. `MultiprocExecutor` runs each rank in its own spawned
process (the default: the engine's Python work never competes with the forward for the GIL, and a
crash in the model surfaces as an error instead of taking the engine down); `InlineExecutor` runs
rank 0 in-process for debugging. Tensor parallelism adds ranks here; the engine does not change.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from namazu.engine_config import EngineConfig
from namazu.spec.proposer import Proposer
from namazu.step_batch import StepBatch, StepResult

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
        from namazu.model_runner import ModelRunner

        self.rank = rank
        self.runner = ModelRunner(config, model_path, rank, world_size, proposer)

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

    def start_profile(self) -> None:
        self.runner.profile = []

    def stop_profile(self) -> list:
        steps, self.runner.profile = self.runner.profile or [], None
        return steps


class WorkerError(RuntimeError):
    """A worker failed; the message carries its traceback."""


class Executor:
    world_size: int = 1

    def infos(self) -> list[WorkerInfo]:
        """Every rank's info, in rank order."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates `num_blocks` KV blocks (the engine passes the minimum over ranks)."""
        raise NotImplementedError

    def submit(self, batch: StepBatch) -> None:
        raise NotImplementedError

    def collect(self) -> StepResult:
        raise NotImplementedError

    def execute(self, batch: StepBatch) -> StepResult:
        self.submit(batch)
        return self.collect()

    def start_profile(self) -> None:
        """Rank 0 records every step's timestamps (model_runner.StepTiming) until `stop_profile`."""
        raise NotImplementedError

    def stop_profile(self) -> list:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InlineExecutor(Executor):
    """Rank 0 in the engine's process: a submitted step runs when it is collected (same order and
    results as a worker process, no overlap)."""

    def __init__(self, config: EngineConfig, model_path: str | Path, proposer: Proposer | None = None):
        self.worker = Worker(config, model_path, proposer=proposer)
        self._queued: list[StepBatch] = []

    def infos(self) -> list[WorkerInfo]:
        return [self.worker.info()]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.worker.allocate_kv_cache(num_blocks)

    def submit(self, batch: StepBatch) -> None:
        self._queued.append(batch)

    def collect(self) -> StepResult:
        return self.worker.execute(self._queued.pop(0))

    def start_profile(self) -> None:
        self.worker.start_profile()

    def stop_profile(self) -> list:
        return self.worker.stop_profile()


def _worker_main(conn: Connection, config: EngineConfig, model_path: str, rank: int, world_size: int,
                 log_level: int, proposer: Proposer | None) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    try:
        worker = Worker(config, model_path, rank, world_size, proposer)
        conn.send(("ok", worker.info()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break   # the engine is gone
        if msg is None:
            break
        method, args = msg
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn re-runs the parent's __main__ script in the child unless told otherwise, so a user script
    without an `if __name__ == "__main__":` guard would start its own LLM in the worker. The worker needs
    nothing from __main__ (its arguments are namazu objects), so hide the script path while starting."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if main is None or path is None or spec is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _shutdown(procs: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: str | Path, world_size: int = 1,
                 proposer: Proposer | None = None):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"namazu-worker-{rank}", daemon=True,
                               args=(child, config, str(model_path), rank, world_size,
                                     logging.getLogger("namazu").getEffectiveLevel(), proposer))
            with _main_module_hidden():
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        # Ends the workers on close(), when the executor is collected, and at interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns)
        self._infos = [self._recv(rank) for rank in range(world_size)]
        logger.info("started %d worker process(es), pid %s", world_size, [p.pid for p in self.procs])

    def _recv(self, rank: int) -> Any:
        try:
            status, payload = self.conns[rank].recv()
        except (EOFError, OSError) as err:
            code = self.procs[rank].exitcode
            raise WorkerError(f"worker {rank} (pid {self.procs[rank].pid}) died, exit code {code}") from err
        if status == "error":
            raise WorkerError(f"worker {rank} failed:\n{payload}")
        return payload

    def infos(self) -> list[WorkerInfo]:
        return list(self._infos)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for conn in self.conns:
            conn.send(("allocate_kv_cache", (num_blocks,)))
        for rank in range(self.world_size):
            self._recv(rank)
        for info in self._infos:
            info.num_kv_blocks = num_blocks

    def submit(self, batch: StepBatch) -> None:
        for conn in self.conns:
            conn.send(("execute", (batch,)))

    def collect(self) -> StepResult:
        results = [self._recv(rank) for rank in range(self.world_size)]
        return results[0]

    def start_profile(self) -> None:
        self.conns[0].send(("start_profile", ()))
        self._recv(0)

    def stop_profile(self) -> list:
        self.conns[0].send(("stop_profile", ()))
        return self._recv(0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self._finalizer()


def make_executor(config: EngineConfig, model_path: str | Path, proposer: Proposer | None = None) -> Executor:
    if config.executor == "inline":
        return InlineExecutor(config, model_path, proposer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return MultiprocExecutor(config, model_path, config.tensor_parallel_size, proposer)
