"""The step hand-off on both sides of the process boundary: pickled StepBatch (before issue 16 item 5)
vs the delta message (namazu/step_delta.py), per decode step, interleaved in one run.

    python bench/step_wire.py [--batch 1 32] [--context 64 2048] [--steps 200] [--rounds 3]

For each (batch, context): a running decode of `batch` sequences (`context` tokens each, grown one token
per step, the block table growing at block boundaries) is built with batch_builder each step, then
  pickle   engine: pickle.dumps(batch)        worker: pickle.loads
  delta    engine: StepEncoder.encode(batch)  worker: StepDecoder.decode (state kept across steps)
Reported: median microseconds per step on each side and bytes per step (the first step, every sequence
new, is excluded). The machine may be shared: the load average is printed; compare within one run.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time


def _batches(batch: int, context: int, steps: int):
    from namazu import SamplingParams
    from namazu.batch_builder import build_step_batch
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
    from namazu.step_delta import StepDecoder, StepEncoder

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| batch | context | wire | engine us | worker us | bytes/step |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for batch in args.batch:
        for context in args.context:
            batches = _batches(batch, context, args.steps)
            acc = {k: ([], [], []) for k in ("pickle", "delta")}
            for _ in range(args.rounds):
                for kind in ("pickle", "delta"):
                    for dst, src in zip(acc[kind], _run(batches, kind)):
                        dst.extend(src)
            for kind, (send, recv, sizes) in acc.items():
                print(f"| {batch} | {context} | {kind} | {1e6 * statistics.median(send):.1f} | "
                      f"{1e6 * statistics.median(recv):.1f} | {statistics.median(sizes):.0f} |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
