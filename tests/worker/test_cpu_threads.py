"""The runner's CPU thread count: the default never oversubscribes cores other processes keep busy."""
from __future__ import annotations

import pytest
import torch

from namazu.engine_config import EngineConfig
from namazu.worker.cpu_threads import apply_threads, default_threads


@pytest.mark.parametrize("cores, load, separate, expected", [
    (2, 0.0, True, 1),      # idle 2 cores: one for the engine process, one for the runner
    (2, 0.0, False, 2),     # runner in the engine's process: both
    (2, 2.0, False, 1),     # both cores busy elsewhere: never more than the free ones, at least 1
    (2, 7.0, True, 1),
    (16, 4.4, True, 12),    # 16 cores, about 4 busy elsewhere: 12 free
    (16, 0.2, True, 15),
    (1, 0.0, True, 1),
])
def test_default_threads_counts_only_free_cores(cores, load, separate, expected):
    assert default_threads(separate, cores=cores, load=load, env={}) == expected


def test_omp_num_threads_is_an_explicit_choice():
    assert default_threads(True, cores=2, load=9.0, env={"OMP_NUM_THREADS": "2"}) == 2
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        default_threads(True, cores=2, load=0.0, env={"OMP_NUM_THREADS": "two"})
    with pytest.raises(ValueError, match="at least 1"):
        default_threads(True, cores=2, load=0.0, env={"OMP_NUM_THREADS": "0"})


def test_apply_threads_sets_torch():
    before = torch.get_num_threads()
    try:
        assert apply_threads(2, separate_engine_process=True) == 2
        assert torch.get_num_threads() == 2
        assert apply_threads(1, separate_engine_process=False) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_threads_flag_is_checked():
    with pytest.raises(ValueError, match="--threads"):
        EngineConfig(threads=0)
    assert EngineConfig(threads=3).threads == 3
