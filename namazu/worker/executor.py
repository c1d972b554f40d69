"""Workers: the model runner behind a message interface, one per tensor-parallel rank.

The engine talks to an Executor. At start-up every rank reports how many KV blocks it could hold
(`infos()`) and the engine allocates the minimum on all of them (`allocate_kv_cache`), so no rank is
asked to hold more than it can. Per step, `submit(batch)` sends the same StepBatch to every rank and
returns at once; `collect()` waits for rank 0's StepResult. Between the two the engine plans the next step (async
scheduling); `execute(batch)` is both at once. `MultiprocExecutor` runs each rank in its own spawned
process (the default: the engine's Python work never competes with the forward for the GIL, and a
crash in the model surfaces as an error instead of taking the engine down); `InlineExecutor` runs
rank 0 in-process for debugging. Tensor parallelism adds ranks here (`namazu/distributed/`: the process
group, the control channel, heartbeats); the engine does not change. A dead or hung rank fails the
executor's next wait (or `check_health`) within seconds, with a message naming the rank.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from namazu.config import ModelConfig
from namazu.distributed.env import NodeLayout
from namazu.distributed.group import check_devices
from namazu.distributed.health import HANG_SECONDS, stale_seconds
from namazu.engine_config import EngineConfig
from namazu.layers.weight_loading import check_shardable
from namazu.spec.proposer import Proposer
from namazu.step.batch import StepBatch, StepResult
from namazu.step.channel import StepRing, ring_size
from namazu.step.delta import StepEncoder
from namazu.worker.rank import Worker, WorkerInfo, WorkerSetup, worker_main

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed; the message names the rank and carries its traceback."""


class Executor(abc.ABC):
    """What the engine drives: every method without a body here is each executor's own."""

    world_size: int = 1

    @abc.abstractmethod
    def infos(self) -> list[WorkerInfo]:
        """Every rank's info, in rank order."""
        ...

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates `num_blocks` KV blocks (the engine passes the minimum over ranks)."""
        ...

    @abc.abstractmethod
    def submit(self, batch: StepBatch) -> None:
        ...

    @abc.abstractmethod
    def collect(self) -> StepResult:
        ...

    def execute(self, batch: StepBatch) -> StepResult:
        self.submit(batch)
        return self.collect()

    def discard(self) -> None:
        """Drops the oldest step submitted and not collected (at close, or one whose sequences all finished
        before it was collected): worker processes are running it and would answer into closed pipes or
        out of turn, so it is collected and its result dropped."""
        self.collect()

    @abc.abstractmethod
    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(worker, *args)` on every rank; the answers in rank order."""
        ...

    def check_health(self) -> None:
        """Raises WorkerError when a rank is dead or hung (an in-process rank cannot be: nothing to do)."""
        return None

    @abc.abstractmethod
    def start_profile(self) -> None:
        """Rank 0 records every step's timestamps (model_runner.StepTiming) until `stop_profile`."""
        ...

    @abc.abstractmethod
    def stop_profile(self) -> list:
        ...

    def close(self) -> None:
        """Ends the workers (an in-process rank ends with the engine: nothing to do)."""
        return None

    def failure(self) -> str | None:
        """Why a worker cannot serve (e.g. its process died), or None while all are alive."""
        return None

    def kill(self) -> None:
        """Ends the workers at once (a hung step); in-process workers cannot be."""
        return None

    def ping(self, timeout: float) -> bool:
        """Whether every worker answers a no-op within `timeout` seconds (call between steps only)."""
        return True


class InlineExecutor(Executor):
    """Rank 0 in the engine's process: a submitted step runs when it is collected (same order and
    results as a worker process, no overlap)."""

    def __init__(self, config: EngineConfig, model_path: str | Path, proposer: Proposer | None = None):
        self.worker = Worker(config, model_path, proposer=proposer)
        self.encoder = StepEncoder()
        self._queued: list[bytes] = []

    def infos(self) -> list[WorkerInfo]:
        return [self.worker.info()]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.worker.allocate_kv_cache(num_blocks)

    def submit(self, batch: StepBatch) -> None:
        # Encoded like a worker process's steps, so that both executors run the same worker-side batch.
        self._queued.append(self.encoder.encode(batch))

    def collect(self) -> StepResult:
        return self.worker.execute_step(self._queued.pop(0))

    def discard(self) -> None:
        # Not run yet: nothing to wait for. Running it would compute a whole step only to drop it (after every
        # answer that ends at a stop token the host learns of after the next step is launched), and at
        # interpreter exit (`LLM.__del__`), with torch half torn down, it raised and printed a traceback.
        self.worker.skip_step(self._queued.pop(0))

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        # Between steps, as for worker processes: run before a queued step, fn would see the worker as it
        # was before that step.
        if self._queued:
            raise RuntimeError(f"collective_rpc with {len(self._queued)} step(s) submitted and not collected: "
                               "collect them first (LLMEngine.collective_rpc does)")
        return [fn(self.worker, *args)]

    def start_profile(self) -> None:
        self.worker.start_profile()

    def stop_profile(self) -> list:
        return self.worker.stop_profile()


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


def _shutdown(procs: list[Any], conns: list[Connection], ring: StepRing | None) -> None:
    try:
        conns[0].send_bytes(pickle.dumps(None))     # rank 0 passes it on to every rank
    except (OSError, ValueError, IndexError):
        pass
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.close()
    try:
        _stop(procs, grace=10.0)
    finally:
        if ring is not None:
            ring.close()


def _stop(procs: list[Any], grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join(timeout=2)


class MultiprocExecutor(Executor):
    """Each local rank in a spawned process. A batch is encoded once as what changed since the last step
    (`step_delta.py`) and written to a shared-memory ring that rank 0 reads (`step_channel.py`); rank 0
    shares the bytes with the others (`distributed/control.py`). Every wait for the workers also watches their
    processes and heartbeats: a rank that dies or hangs fails the wait within seconds with an error
    naming it, and every rank is then ended (`failure` keeps the message)."""

    def __init__(self, config: EngineConfig, model_path: str | Path, world_size: int = 1,
                 proposer: Proposer | None = None, setup: WorkerSetup | None = None,
                 layout: NodeLayout | None = None):
        self.world_size = world_size
        model_config = ModelConfig.from_pretrained(model_path)
        check_shardable(model_config, world_size)
        layout = layout or (NodeLayout.from_environ(world_size) if world_size > 1 else NodeLayout(1))
        check_devices(config.device, len(layout.local_ranks))
        if layout.node_rank != 0:
            raise ValueError(f"NODE_RANK={layout.node_rank}: the engine runs on node 0; other nodes start their "
                             "ranks with `python -m namazu.distributed.node`")
        self.layout = layout
        self._failure: str | None = None
        self.encoder = StepEncoder()
        self.ring = _make_ring(config, model_config)
        self._in_ring: deque[bool] = deque()    # per step submitted and not collected: whether it is in the ring
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        self.beats = []
        # Ends the workers and unlinks the ring on close(), when the executor is collected, and at interpreter
        # exit; registered before any start, so that a failed start (or a failed first answer) cleans up too.
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self.ring)
        for rank in layout.local_ranks:
            parent, child = ctx.Pipe()
            beat = ctx.Value("d", 0.0, lock=False)
            proc = ctx.Process(target=worker_main, name=f"namazu-worker-{rank}", daemon=True,
                               args=(child, config, str(model_path), layout.rank_env(rank),
                                     logging.getLogger("namazu").getEffectiveLevel(), proposer, setup, beat,
                                     os.getpid(), self.ring.name if self.ring is not None and rank == 0 else None))
            with _main_module_hidden():
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.beats.append(beat)
        self._infos = self._wait_all()
        logger.info("started %d worker process(es), pid %s", len(self.procs), self.pids)

    # -- health ---------------------------------------------------------------------------------------
    def _problem(self) -> str | None:
        """A dead or hung local rank, in words (None: all alive and beating)."""
        dead = [(rank, p) for rank, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            # A rank killed by a signal is the cause; peers that then exited on a failed collective are not.
            rank, p = min(dead, key=lambda rp: (rp[1].exitcode is None or rp[1].exitcode >= 0, rp[0]))
            return f"tensor-parallel rank {rank} (pid {p.pid}) died, exit code {p.exitcode}"
        for rank, (p, beat) in enumerate(zip(self.procs, self.beats)):
            if beat.value and stale_seconds(beat) > HANG_SECONDS:
                return (f"tensor-parallel rank {rank} (pid {p.pid}) is hung: no heartbeat for "
                        f"{stale_seconds(beat):.0f} s")
        return None

    def _blame(self, rank: int, traceback_text: str) -> str:
        """The message for an error reported by `rank`. When a peer dies, the survivors' collectives fail
        too ("connection closed by peer"), often before the engine sees the death; the dead rank is the
        one to name, so wait briefly for a sentinel before blaming the reporter."""
        deadline = time.monotonic() + 3.0
        ready = mp_connection.wait([p.sentinel for p in self.procs], timeout=3.0)
        problem = self._problem()
        # A killed process's sentinel is readable a moment before waitpid reports it (its files close
        # before it becomes a zombie): until then is_alive() still says True, and the reporter was blamed.
        while problem is None and ready and time.monotonic() < deadline:
            time.sleep(0.01)
            problem = self._problem()
        # A rank that reported its error and returned exits with 0: that is not a death to blame.
        if problem is not None and not any(p.exitcode == 0 for p in self.procs):
            return f"{problem} (rank {rank} then failed: {traceback_text.strip().splitlines()[-1]})"
        return f"tensor-parallel rank {rank} failed:\n{traceback_text}"

    def _fail(self, message: str) -> WorkerError:
        """Records the failure and ends every rank (a step cannot continue without one of them)."""
        if self._failure is None:
            self._failure = message
            logger.error("%s; stopping every worker", message)
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            _stop(self.procs, grace=0.0)
            if self.ring is not None:
                self.ring.close()
        return WorkerError(self._failure)

    def check_health(self) -> None:
        """Raises WorkerError if a rank died or hung (or did before)."""
        if self._failure is not None:
            raise WorkerError(self._failure)
        problem = self._problem()
        if problem is not None:
            raise self._fail(problem)

    def _wait_all(self) -> list[Any]:
        """Every local rank's answer to the last command, in rank order; the first error (or death, or
        hang) of any rank raises WorkerError naming it."""
        self.check_health()
        answers: dict[int, Any] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            ready = mp_connection.wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=0.5)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    continue        # the process is gone; its sentinel tells how
                if status == "error":
                    raise self._fail(self._blame(rank, payload))
                answers[rank] = payload
                del pending[rank]
            if pending:
                self.check_health()
        return [answers[r] for r in range(len(self.conns))]

    def _send(self, method: str, *args: Any) -> None:
        self._send_bytes(pickle.dumps((method, args)))     # pickled once, whatever the ranks

    def _send_bytes(self, raw: bytes) -> None:
        self.check_health()
        try:
            self.conns[0].send_bytes(raw)
        except (OSError, ValueError) as err:
            raise self._fail(f"tensor-parallel rank 0 (pid {self.procs[0].pid}) is gone: {err}") from err

    # -- the executor interface ------------------------------------------------------------------------
    def infos(self) -> list[WorkerInfo]:
        return list(self._infos)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send("allocate_kv_cache", num_blocks)
        self._wait_all()
        for info in self._infos:
            info.num_kv_blocks = num_blocks

    def submit(self, batch: StepBatch) -> None:
        message = self.encoder.encode(batch)
        notice = self.ring.put(message) if self.ring is not None else None
        self._in_ring.append(notice is not None)
        self._send_bytes(notice if notice is not None else message)

    def collect(self) -> StepResult:
        # Whatever the wait ends with (result, error, death), the worker is done with the message.
        if self._in_ring and self._in_ring.popleft():
            self.ring.release_oldest()
        return self._wait_all()[0]

    def _between_steps(self, what: str) -> None:
        """The ranks answer in order: a message sent behind an uncollected step would read its results."""
        if self._in_ring:
            raise RuntimeError(f"{what} with {len(self._in_ring)} step(s) submitted and not collected: collect them "
                               "first (LLMEngine.collective_rpc does)")

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(worker, *args)` on every rank (fn picklable: a module-level function); the local ranks'
        answers in rank order. Between steps only."""
        self._between_steps("collective_rpc")
        self._send("rpc", fn, *args)
        return self._wait_all()

    def start_profile(self) -> None:
        self._between_steps("start_profile")
        self._send("start_profile")
        self._wait_all()

    def stop_profile(self) -> list:
        self._between_steps("stop_profile")
        self._send("stop_profile")
        return self._wait_all()[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        self._finalizer()

    def failure(self) -> str | None:
        """A dead or hung rank (or one that failed before), in words; None while all serve."""
        return self._failure or self._problem()

    def kill(self) -> None:
        """Ends every rank at once. A rank whose heartbeat stopped is recorded as the cause first: once
        killed it would read as a death by SIGKILL, and the engine's watchdog often gets here before a
        wait on the workers has noticed the hang."""
        problem = self._problem()
        if problem is not None:
            self._fail(problem)
            return
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def ping(self, timeout: float) -> bool:
        """Every local rank answers a no-op within `timeout` (between steps only: the answer shares the
        pipe with step results). False leaves the pipe out of step: the caller kills the workers."""
        try:
            self._send("info")
        except WorkerError:
            return False
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return False
            status, _ = conn.recv()
            if status != "ok":
                return False
        return True


def _make_ring(config: EngineConfig, model: ModelConfig) -> StepRing | None:
    """The shared-memory ring for step messages, or None (steps then go over the pipe) where the system has
    no room for one."""
    size = ring_size(config.max_num_seqs, config.max_num_batched_tokens, config.num_speculative_tokens,
                     model.vocab_size, -(-model.max_position_embeddings // config.block_size))
    size = min(size, 32 << 20)      # container /dev/shm is often 64 MiB; a larger step falls back to the pipe
    try:
        return StepRing(size)
    except OSError as err:
        logger.warning("no shared memory for step messages (%s); steps go over the pipe", err)
        return None


def make_executor(config: EngineConfig, model_path: str | Path, proposer: Proposer | None = None,
                  setup: WorkerSetup | None = None) -> Executor:
    if config.executor == "inline":
        return InlineExecutor(config, model_path, proposer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return MultiprocExecutor(config, model_path, config.tensor_parallel_size, proposer, setup)
