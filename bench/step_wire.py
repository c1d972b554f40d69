"""The step hand-off on both sides of the process boundary: a pickled StepBatch over the pipe (before issue 16
item 5) vs the delta message (namazu/step/delta.py) through the shared-memory ring (namazu/step/channel.py),
per decode step, interleaved in one run.

    python bench/step_wire.py [--batch 1 32] [--context 64 2048] [--steps 200] [--rounds 3]

For each (batch, context): a running decode of `batch` sequences (`context` tokens each, grown one token
per step, the block table growing at block boundaries) is built with batch_builder each step, then
  pickle   engine: pickle.dumps(batch)        worker: pickle.loads
  delta    engine: StepEncoder.encode(batch)  worker: StepDecoder.decode (state kept across steps), the
           bytes through the shared-memory ring (a notice on the pipe); delta-pipe: the same bytes over the pipe
Reported: median microseconds per step on each side and bytes per step (the first step, every sequence
new, is excluded), and the round trip through a real process boundary: a spawned process that receives
each step (pipe / ring notice), decodes it and answers a few bytes, as a worker does (no model: the
hand-off alone). The machine may be shared: the load average is printed; compare within one run.
Since issue 28 a StepBatch pickles the default way (its one-blob `__reduce__` went with the pickle path no
step used), so `pickle` here is slower than the path issue 16 replaced: compare delta runs with each other.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time


def _batches(batch: int, context: int, steps: int):
    from namazu import SamplingParams
    from namazu.engine.batch_builder import build_step_batch
    from namazu.scheduler.scheduler import ScheduledSeq
    from namazu.scheduler.sequence import Sequence

    seqs = []
    for i in range(batch):
        seq = Sequence(i, f"r{i}", 0, list(range(1, context + 1)), SamplingParams(temperature=0.7, top_p=0.9), seed=i)
        seqs.append(seq)
    out = []
    for step in range(steps):
        items = []
        for seq in seqs:
            if step:
                seq.token_ids.append(7)
            seq.num_computed_tokens = len(seq.token_ids) - 1
            seq.block_table = list(range(1000 * seq.seq_id, 1000 * seq.seq_id + -(-len(seq.token_ids) // 16)))
            items.append(ScheduledSeq(seq, 1, 0))
        out.append(build_step_batch(items, 163840)[0])
    return out


def _run(batches, kind: str) -> tuple[list[float], list[float], list[int]]:
    from namazu.step.delta import StepDecoder, StepEncoder

    enc, dec = StepEncoder(), StepDecoder()
    send, recv, sizes = [], [], []
    for b in batches:
        t0 = time.perf_counter()
        raw = pickle.dumps(b) if kind == "pickle" else enc.encode(b)
        t1 = time.perf_counter()
        _ = pickle.loads(raw) if kind == "pickle" else dec.decode(raw)
        t2 = time.perf_counter()
        send.append(t1 - t0)
        recv.append(t2 - t1)
        sizes.append(len(raw))
    return send[1:], recv[1:], sizes[1:]


def _echo(conn, kind: str, ring_name: str | None) -> None:
    """The worker's side of the round trip: receive, decode, answer."""
    from namazu.step.channel import StepReader, is_notice
    from namazu.step.delta import StepDecoder

    reader = StepReader(ring_name) if ring_name else None
    dec = StepDecoder()
    while True:
        raw = conn.recv_bytes()
        if raw == b"stop":
            break
        if kind == "pickle":
            pickle.loads(raw)
        else:
            dec.decode(reader.read(raw) if is_notice(raw) else raw)
        conn.send_bytes(b"ok")
    if reader is not None:
        reader.close()


def _round_trips(batches, kind: str) -> list[float]:
    import multiprocessing as mp

    from namazu.step.channel import StepRing
    from namazu.step.delta import StepEncoder

    ctx = mp.get_context("spawn")
    ring = StepRing(8 << 20) if kind == "delta" else None     # "delta-pipe": the same bytes over the pipe
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child, kind, ring.name if ring else None), daemon=True)
    proc.start()
    enc = StepEncoder()
    times = []
    try:
        for b in batches:
            t0 = time.perf_counter()
            if kind == "pickle":
                parent.send_bytes(pickle.dumps(b))
            else:
                msg = enc.encode(b)
                notice = ring.put(msg) if ring is not None else None
                parent.send_bytes(notice if notice is not None else msg)
            parent.recv_bytes()
            if ring is not None:
                ring.release_oldest()
            times.append(time.perf_counter() - t0)
        parent.send_bytes(b"stop")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
        if ring is not None:
            ring.close()
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| batch | context | wire | engine us | worker us | bytes/step | round trip us |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        for context in args.context:
            batches = _batches(batch, context, args.steps)
            acc = {k: ([], [], [], []) for k in ("pickle", "delta-pipe", "delta")}
            for _ in range(args.rounds):
                for kind in acc:
                    codec = "pickle" if kind == "pickle" else "delta"
                    for dst, src in zip(acc[kind], (*_run(batches, codec), _round_trips(batches, kind))):
                        dst.extend(src)
            for kind, (send, recv, sizes, rtt) in acc.items():
                print(f"| {batch} | {context} | {kind} | {1e6 * statistics.median(send):.1f} | "
                      f"{1e6 * statistics.median(recv):.1f} | {statistics.median(sizes):.0f} | "
                      f"{1e6 * statistics.median(rtt):.0f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
