"""The step wire format (namazu/step/delta.py) and its shared-memory transport (namazu/step/channel.py):
the worker rebuilds exactly the batch the engine built, a running decode's message does not grow with
context length, bad bytes are refused, and the shared-memory segment never outlives the engine."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import assert_same_fields, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.engine.batch_builder import build_step_batch
from namazu.scheduler.scheduler import ScheduledSeq
from namazu.scheduler.sequence import Sequence
from namazu.spec.drafters import ScriptedDrafter
from namazu.step.delta import StepDecoder, StepEncoder, StepFormatError


def _features(i: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i, max_tokens=12, n=2,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                       max_tokens=12, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, allowed_token_ids=list(range(65, 91)), min_tokens=4, max_tokens=12),
        SamplingParams(temperature=0.9, seed=i, logit_bias={70: 5.0, 71: -100.0, 200 + i: 2.5}, max_tokens=12,
                       ignore_eos=True),
    ][i % 5]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_worker_rebuilds_every_batch_the_engine_built(async_scheduling):
    """Real traffic through the codec: speculation (drafts, assumed drafts), preemption by a tiny block pool,
    a shared prefix (prefix cache hits), chunked prefill, n=2, grammar bitmasks, penalties, logprobs and
    prompt logprobs. Every batch the runner receives equals, field by field, the one the engine built."""
    shared = prompts(1, lo=12, hi=13, seed=5)[0]
    batch = [shared + p for p in prompts(10, lo=3, hi=40, seed=7)]
    drafter = ScriptedDrafter("random", 264, seed=1)
    with LLM(tiny_checkpoint(), executor="inline", max_num_batched_tokens=24, max_num_seqs=8, block_size=4,
             num_kv_blocks=40, max_model_len=64, drafter=drafter, num_speculative_tokens=2,
             enable_prefix_caching=True, async_scheduling=async_scheduling) as llm:
        ex = llm.engine.executor
        sent, checked = [], []
        submit, decode = ex.submit, ex.worker.decoder.decode

        def spy_submit(b):
            sent.append(b)
            return submit(b)

        def spy_decode(raw):
            got = decode(raw)
            assert_same_fields(sent.pop(0), got, f"step {len(checked)}")
            checked.append(got)
            return got

        ex.submit, ex.worker.decoder.decode = spy_submit, spy_decode
        outs = llm.generate(prompt_token_ids=batch, sampling_params=[_features(i) for i in range(len(batch))],
                            use_tqdm=False)
        stats = llm.engine.get_stats()
    assert all(o.finished for o in outs) and not sent
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert any(b.spec.max_drafts for b in checked) and any(b.sampling.bitmask is not None for b in checked)
    assert any(np.any(b.seqs.assumed_drafts) for b in checked) == async_scheduling
    assert any(b.prompt_lp.num >= 0 and len(b.prompt_lp.rows) for b in checked)
    assert any(len(b.attn.input_ids) > len(b.attn.logit_rows) and len(b.spec.row_layout) for b in checked)


def _decode_batch(num_seqs: int, context: int, step: int, block_size: int = 16):
    """A decode step of `num_seqs` sequences `context + step` tokens long (their block tables grown as the
    block manager grows them)."""
    items = []
    for i in range(num_seqs):
        seq = Sequence(i, f"r{i}", 0, list(range(1, context + 1)), SamplingParams(temperature=0.5), seed=i)
        seq.token_ids += [7] * step
        seq.num_computed_tokens = context + step - 1
        n = -(-(context + step) // block_size)
        seq.block_table = [1000 * i + j for j in range(n)]
        items.append(ScheduledSeq(seq, 1, 0))
    return build_step_batch(items, 264)[0]


def _running_message_sizes(context: int) -> list[int]:
    enc, dec = StepEncoder(), StepDecoder()
    sizes = []
    for step in range(40):
        b = _decode_batch(32, context, step)
        raw = enc.encode(b)
        assert_same_fields(b, dec.decode(raw), f"step {step}")
        sizes.append(len(raw))
    return sizes


def test_a_running_decode_message_is_o_changes():
    """Batch-32 decode: after the first step (every sequence new: tables in full) a step costs the same
    bytes at a 40-token context (3-block tables) as at a 4000-token one (250-block tables), a fixed amount
    per sequence, plus 32 bytes per table that crosses a block boundary."""
    short, long_ = _running_message_sizes(40), _running_message_sizes(4000)
    assert long_[0] > short[0] + 32 * 200 * 8            # the first step sends whole tables
    assert (min(short[1:]), max(short[1:])) == (min(long_[1:]), max(long_[1:]))
    steady = [n for n in long_[1:] if n == min(long_[1:])]
    assert len(steady) > 30 and steady[0] < 32 * 80 + 512, f"{steady[0]} bytes for a running batch-32 decode"
    grew = [b - a for a, b in zip(long_[1:], long_[2:]) if b > a]
    # at a boundary, each sequence: its new block id and its table change (batch row, kept, appended)
    assert grew and all(g == 32 * (8 + 3 * 8) for g in grew)


def test_tables_that_shrink_or_are_replaced_arrive_intact():
    enc, dec = StepEncoder(), StepDecoder()
    b = _decode_batch(3, 40, 0)
    assert_same_fields(b, dec.decode(enc.encode(b)), "first")
    b = _decode_batch(3, 40, 0)
    b.attn.block_tables[1, 1] = 777                          # preempted and scheduled again: new blocks
    b.seqs.num_blocks[2] = 2                                 # a rejected draft's block freed
    b.attn.block_tables[2, 2] = 0
    assert_same_fields(b, dec.decode(enc.encode(b)), "changed")
    b.finished_seq_ids = [0]
    b2 = _decode_batch(3, 40, 0)
    b2.finished_seq_ids, b2.seqs.seq_ids[0] = [0], 9        # 0 forgotten, 9 arrives in its slot
    assert_same_fields(b2, dec.decode(enc.encode(b2)), "reused slot")
    assert dec.num_known == enc.num_known == 3
    b3 = _decode_batch(3, 40, 0)
    b3.spec.write_context = False                           # no sequence of the step will draft
    assert_same_fields(b3, dec.decode(enc.encode(b3)), "no drafter context")


def test_bad_messages_are_refused():
    enc, dec = StepEncoder(), StepDecoder()
    raw = enc.encode(_decode_batch(2, 40, 0))
    with pytest.raises(StepFormatError, match="magic"):
        dec.decode(b"\x00" * len(raw))
    with pytest.raises(StepFormatError, match="truncated"):
        dec.decode(raw[:-24])
    sender = StepEncoder()
    sender.encode(_decode_batch(2, 40, 0))
    later = sender.encode(_decode_batch(2, 40, 1))     # refers to sequences sent before
    with pytest.raises(StepFormatError, match="never received"):
        StepDecoder().decode(later)
    assert dec.decode(raw).seqs.seq_ids.tolist() == [0, 1]     # the refusals left the decoder usable


def _shm(name: str) -> Path:
    return Path("/dev/shm") / name.lstrip("/")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory is not a file system here")
def test_shared_memory_is_unlinked_on_close_and_on_worker_death():
    with LLM(tiny_checkpoint(), max_num_seqs=4) as llm:
        ring = llm.engine.executor.ring
        assert ring is not None and _shm(ring.name).exists()
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    assert not _shm(ring.name).exists(), "close() left the segment"

    with LLM(tiny_checkpoint(), max_num_seqs=4) as llm:
        ex = llm.engine.executor
        name = ex.ring.name
        os.kill(ex.pids[0], signal.SIGKILL)
        with pytest.raises(Exception, match="died"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
        assert not _shm(name).exists(), "a dead worker's executor kept the segment"


_KILLED_ENGINE = """
import os, signal, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from engine_helpers import tiny_checkpoint
from namazu import LLM, SamplingParams
llm = LLM(tiny_checkpoint(), max_num_seqs=2)
llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
print(llm.engine.executor.ring.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory is not a file system here")
def test_shared_memory_is_unlinked_when_the_engine_process_is_killed():
    here = Path(__file__).resolve()
    code = _KILLED_ENGINE.format(root=str(here.parents[2]), tests=str(here.parents[1] / "harness"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    name = proc.stdout.split()[-1]
    deadline = time.monotonic() + 20
    while _shm(name).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _shm(name).exists(), "the resource tracker did not unlink the killed engine's segment"


def test_the_ring_never_overwrites_a_message_in_flight():
    from namazu.step.channel import StepReader, StepRing

    ring = StepRing(3000)
    reader = StepReader(ring.name)
    try:
        a, b = ring.put(b"a" * 1000), ring.put(b"b" * 1000)       # async scheduling: two steps in flight
        assert reader.read(a) == b"a" * 1000 and reader.read(b) == b"b" * 1000
        ring.release_oldest()                                     # a collected; b still unread
        assert ring.put(b"c" * 1500) is None, "wrapped over the message in flight"   # goes over the pipe
        assert reader.read(b) == b"b" * 1000
        ring.release_oldest()
        d = ring.put(b"d" * 1500)                                 # nothing in flight: from the start
        assert reader.read(d) == b"d" * 1500
        assert ring.put(b"e" * 4000) is None                      # larger than the ring: over the pipe
    finally:
        reader.close()
        ring.close()
