"""How many CPU threads a model runner uses (`--threads`, `LLM(threads=...)`).

torch's default is one intra-op thread per core. On a machine whose cores other processes keep busy,
that oversubscribes: an OpenMP parallel region waits at its barrier for the slowest thread, and a thread
that lost its core to another process holds everyone up for a scheduler time slice. Measured on a
2-core machine with both cores busy elsewhere, a server with 2 threads fell from about 140 to 4 tokens/s
where the same server with 1 thread kept about 140. The default therefore counts only cores nobody else
is using: the cores this process may run on, less one for the engine process when the runner lives in
its own process (the engine plans the next step while the runner computes), less the load other
processes put on the machine at start-up, and never less than 1.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(separate_engine_process: bool, cores: int | None = None, load: float | None = None,
                    env: dict[str, str] | None = None) -> int:
    """The thread count when `--threads` is not given. `$OMP_NUM_THREADS`, when set, is the user's
    explicit choice and wins. `load` is the 1-minute load average (read here when None)."""
    env = os.environ if env is None else env
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit:
        try:
            value = int(explicit)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={explicit!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"OMP_NUM_THREADS={explicit!r} must be at least 1")
        return value
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    free = cores - int(round(load))
    reserved = 1 if separate_engine_process else 0
    return max(1, min(cores - reserved, free))


def apply_threads(threads: int | None, separate_engine_process: bool) -> int:
    """Sets torch's intra-op thread count for this process and returns it."""
    import torch

    n = threads if threads is not None else default_threads(separate_engine_process)
    if n < 1:
        raise ValueError(f"--threads={n}: must be at least 1")
    torch.set_num_threads(n)
    return n
