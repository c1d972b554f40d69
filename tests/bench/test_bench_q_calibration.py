"""bench/q_calibration.py's replay of the anchors a decode visits: exact where every step is certain, and below
the every-anchor average where easy and hard stretches alternate (steps end more often in the hard ones)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from q_calibration import visited_length  # noqa: E402

from namazu.spec.training.calibrate import expected_length  # noqa: E402


def outputs(lengths: list[int], k: int) -> np.ndarray:
    """valid [A, k] of outputs of these many anchors, concatenated (an anchor's block ends with its output)."""
    rows = []
    for n in lengths:
        rows += [[j < n - i for j in range(k)] for i in range(n)]
    return np.array(rows)


def test_certain_steps_give_exact_tokens_per_step():
    valid = outputs([12, 7], 3)
    # Every draft rejected: one token a step.
    assert visited_length(np.zeros(valid.shape), valid) == 1.0
    # Every draft inside the output accepted: 4 tokens a step, the last step of an output cut by its end
    # (12 anchors: 3 steps; 7: 2 steps).
    assert visited_length(np.ones(valid.shape), valid) == 19 / 5


def test_hard_stretches_weigh_more_than_in_the_every_anchor_average():
    k = 6
    valid = outputs([400], k)
    alpha = np.where(np.arange(400)[:, None] % 100 < 50, 0.95, 0.1) * np.ones((1, k))
    every, visited = expected_length(alpha, valid), visited_length(alpha, valid)
    # Half the anchors accept ~6.0 tokens a step, half ~1.1: the every-anchor mean is their average, a decode
    # spends most of its steps in the hard half (tokens over steps is their harmonic mean, near 1.9).
    assert every > 3.0 and 1.6 < visited < 2.3
