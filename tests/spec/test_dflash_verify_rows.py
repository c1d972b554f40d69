"""A verify step sized by the drafts the worker holds: `step_batch.trim_drafts` turns a batch planned with k
drafts per sequence into exactly the batch the engine's own builder makes when it plans fewer (the oracle),
so a block that ended early (or was never drafted) costs only its own rows."""

import numpy as np
import pytest
from engine_helpers import assert_same_fields

from namazu import SamplingParams
from namazu.engine.batch_builder import build_step_batch
from namazu.scheduler.scheduler import ScheduledSeq
from namazu.scheduler.sequence import Sequence
from namazu.step.batch import trim_drafts

VOCAB = 264


def _seq(i: int, prompt: int, outputs: int, params: SamplingParams) -> Sequence:
    seq = Sequence(i, f"r{i}", 0, list(range(1, prompt + 1)), params, seed=100 + i)
    seq.token_ids = list(range(1, prompt + 1)) + [7] * outputs
    seq.block_table = [10 * i + j for j in range(-(-(prompt + outputs + 8) // 4))]
    return seq


def _batch(drafts: list[int]):
    """Four sequences: a verify, a prompt chunk that samples and wants prompt logprobs, another verify (with
    penalties), a plain decode; `drafts[i]` drafts planned for sequence i."""
    specs = [(12, 5, SamplingParams(temperature=0.7, top_p=0.9)),
             (9, 0, SamplingParams(temperature=0, prompt_logprobs=2)),
             (6, 3, SamplingParams(temperature=1.0, presence_penalty=0.5, top_k=5)),
             (4, 2, SamplingParams(temperature=0))]
    items = []
    for i, ((prompt, outputs, params), k) in enumerate(zip(specs, drafts)):
        seq = _seq(i, prompt, outputs, params)
        if outputs:                    # decoding: only the last token is new
            seq.num_computed_tokens = prompt + outputs - 1
            items.append(ScheduledSeq(seq, 1, k))
        else:                          # the last chunk of its prompt
            seq.num_computed_tokens = 3
            items.append(ScheduledSeq(seq, prompt - 3, k))
    batch, samplers, _ = build_step_batch(items, VOCAB)
    # Grammar rows that name their (sequence, row) so a misplaced row shows.
    batch.sampling.bitmask = np.asarray([[100 * s + j, -1] for s, it in enumerate(samplers)
                                         for j in range(it.num_drafts + 1)], dtype=np.int32)
    return batch


@pytest.mark.parametrize("keep", [[2, 0, 1, 0], [0, 0, 3, 0], [0, 0, 0, 0], [5, 0, 3, 0]],
                         ids=["both-shorter", "one-undrafted", "none-held", "all-held"])
def test_trimmed_batch_is_the_batch_planned_with_fewer_drafts(keep):
    planned = [5, 0, 3, 0]
    got = trim_drafts(_batch(planned), np.asarray(keep))
    want = _batch(keep)
    # Only the plan's own record of the step in flight stays (the engine's assumption, not the worker's).
    assert np.array_equal(got.seqs.assumed_drafts, want.seqs.assumed_drafts)
    assert_same_fields(got, want, "batch", exact_types=False)


def test_trimming_leaves_the_planned_batch_alone_and_refuses_more_drafts():
    b = _batch([5, 0, 3, 0])
    before = b.attn.input_ids.copy(), b.sampling.temperature.copy()
    trim_drafts(b, np.asarray([1, 0, 1, 0]))
    assert np.array_equal(b.attn.input_ids, before[0]) and np.array_equal(b.sampling.temperature, before[1])
    with pytest.raises(ValueError, match="outside"):
        trim_drafts(b, np.asarray([6, 0, 3, 0]))
