"""Whether drafting pays, per sequence and per step, from what this engine measures.

A drafted step emits E tokens per sequence (its acceptance length) and costs r plain steps (the drafter,
and the verify rows of every drafting sequence). It pays where E > r. Neither number is a constant: E
falls with temperature (the shipped drafter: about 3.7 tokens per verify step at T=0, 2.0 through the
server at T=0.8) and on text unlike the drafter's training data; r depends on the mode (eager, graph),
the batch size and the machine. So both are measured:

- E per sequence: an exponential average of its tokens per verify step, started from the average of the
  sequences in its temperature bucket (0, up to 0.5, up to 1, above 1), itself started optimistic so
  that a new bucket gets measured;
- r per batch-size bucket (powers of two): the average wall time of steps that verify and draft over that
  of plain decode steps, both from the engine's own steps (prefill steps are not counted). Until both are
  measured, r is `prior_ratio` (3: a drafted step measured 3.4-4.7 plain steps on a 2-core CPU, graph
  mode, and 3.8 eager through the server; the first measurement replaces it).

A sequence verifies drafts while E >= r * margin. One that stopped is probed again after
`probe_every` of its steps (two steps: one drafts, the next verifies), and every `probe_every` drafted
steps two steps run without drafting (the second a plain decode), so both averages stay current. With
no sequence wanting drafts the step runs plain and the drafter does not run.

`--speculative-adaptive` turns it on or off; the default is on for the drafter the model ships (the
default setup must never be a loss) and off for a drafter the caller names (explicit users keep the
behaviour they asked for, as with the batch-size threshold).
"""
from __future__ import annotations

from dataclasses import dataclass


def temperature_bucket(t: float) -> int:
    return 0 if t <= 0 else 1 if t <= 0.5 else 2 if t <= 1.0 else 3


def batch_bucket(n: int) -> int:
    return max(1, n - 1).bit_length()


@dataclass
class _SeqState:
    ema: float
    on: bool
    steps_off: int = 0


class DraftPolicy:
    def __init__(self, max_tokens_per_step: int, prior_ratio: float = 3.0, margin: float = 1.05,
                 probe_every: int = 32, alpha: float = 0.25):
        self.prior_ratio, self.margin = prior_ratio, margin
        self.probe_every, self.alpha = probe_every, alpha
        # Optimistic start per temperature bucket: every block accepted, so the first sequences draft.
        self.bucket_ema = dict.fromkeys(range(4), float(max_tokens_per_step))
        self.step_ms: dict[tuple[int, bool], float] = {}
        self.seqs: dict[int, _SeqState] = {}
        self._drafted_steps = 0
        self._plain_left = 0
        self.num_probes = 0

    # -- what the engine asks ------------------------------------------------------------------------
    def wants(self, seq_id: int, temperature: float, batch: int = 1) -> bool:
        """Whether the sequence verifies drafts (and asks for them) in the step being planned, `batch`
        sequences running."""
        st = self.seqs.get(seq_id)
        if st is None:
            e = self.bucket_ema[temperature_bucket(temperature)]
            st = self.seqs[seq_id] = _SeqState(e, e >= self.ratio(batch) * self.margin)
        return st.on

    def plain_probe_due(self) -> bool:
        """True for two steps once every `probe_every` drafted steps, to keep r measured: the first still
        verifies the drafts it holds, the second is a plain decode (no drafts held, none asked for)."""
        if self._plain_left == 0 and self._drafted_steps >= self.probe_every:
            self._drafted_steps, self._plain_left = 0, 2
        if self._plain_left:
            self._plain_left -= 1
            return True
        return False

    def ratio(self, batch: int) -> float:
        b = batch_bucket(batch)
        drafted, plain = self.step_ms.get((b, True)), self.step_ms.get((b, False))
        return drafted / plain if drafted and plain else self.prior_ratio

    # -- what the engine learns ----------------------------------------------------------------------
    def observe_step(self, batch: int, drafted: bool, ms: float) -> None:
        """A pure decode step (no prefill) of `batch` sampling sequences that verified and drafted, or
        neither."""
        key = (batch_bucket(batch), drafted)
        old = self.step_ms.get(key)
        self.step_ms[key] = ms if old is None else old + self.alpha * (ms - old)
        if drafted:
            self._drafted_steps += 1

    def observe_verify(self, seq_id: int, temperature: float, tokens: int, batch: int) -> None:
        """A verify of the sequence emitted `tokens` (accepted drafts + 1)."""
        st = self.seqs.get(seq_id)
        if st is None:
            return
        st.ema += self.alpha * (tokens - st.ema)
        b = temperature_bucket(temperature)
        self.bucket_ema[b] += self.alpha * (tokens - self.bucket_ema[b])
        st.on = st.ema >= self.ratio(batch) * self.margin
        st.steps_off = 0

    def observe_plain(self, seq_id: int) -> None:
        """The sequence took a step without verifying: a stopped one counts towards its probe."""
        st = self.seqs.get(seq_id)
        if st is None or st.on:
            return
        st.steps_off += 1
        if st.steps_off >= self.probe_every:
            st.on, st.steps_off = True, 0
            self.num_probes += 1

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
