"""The executor's kill() (called by the engine's watchdog) names a rank whose heartbeat stopped before it
ends the ranks: killed, that rank would read as a plain death by SIGKILL, and the message would lose
which rank hung and why. Deterministic: fake processes and heartbeats, no spawn."""
from __future__ import annotations

import time
from types import SimpleNamespace

from namazu.distributed.health import HANG_SECONDS
from namazu.worker.executor import MultiprocExecutor


class _Proc:
    def __init__(self, pid: int):
        self.pid, self.exitcode, self.killed = pid, None, False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9

    def join(self, timeout=None) -> None:
        return None


def _executor(stale_rank: int | None) -> MultiprocExecutor:
    ex = object.__new__(MultiprocExecutor)
    now = time.monotonic()
    ex.procs = [_Proc(100 + r) for r in range(4)]
    ex.beats = [SimpleNamespace(value=now - (HANG_SECONDS + 2 if r == stale_rank else 0.1)) for r in range(4)]
    ex._failure, ex.ring = None, None
    return ex


def test_kill_records_the_hung_rank_as_the_cause():
    ex = _executor(stale_rank=2)
    ex.kill()
    assert all(p.killed for p in ex.procs)
    assert ex.failure().startswith("tensor-parallel rank 2 (pid 102) is hung: no heartbeat for"), ex.failure()


def test_kill_of_a_step_past_its_timeout_blames_no_rank():
    ex = _executor(stale_rank=None)
    ex.kill()
    assert all(p.killed for p in ex.procs)
    # every rank died by SIGKILL: the lowest is named, as for any death (the watchdog says why it killed)
    assert ex.failure() == "tensor-parallel rank 0 (pid 100) died, exit code -9"
