"""How many drafts each sequence verifies, per step, from what this engine measures.

A drafted step emits E(k) tokens for a sequence verifying k drafts, and costs the drafter plus the verify
rows. Neither is a constant: acceptance falls with temperature (the shipped drafter: about 5 tokens per
verify step at T=0 on its traffic, 2 through the server at T=0.8) and on text unlike the drafter's
training data; what a verify row costs depends on the mode (an eager step's fixed overhead hides its rows,
a compiled step's rows are most of it), the dtype, the batch size and the machine. So both are measured:

- Acceptance, per temperature bucket (0, up to 0.5, up to 1, above 1) and per sequence: for each draft
  position i the share of verifies that reached it and accepted it (the conditional rate a_i), in decayed
  counts. E(k) = 1 + sum over i <= k of a_1 ... a_i. A sequence's rates are its own counts shrunk
  (`shrink` pseudo-verifies) towards a prior: its bucket's last `history` finished sequences as a mixture,
  each sequence one component, weighted by how well it explains this sequence's verifies, beside a
  component of a new kind (every draft accepted) of one sequence's weight; before any sequence of the
  bucket finished, the bucket's pooled counts. Requests are a population, not one: pooled, one hard
  prompt's 18 verifies of 0-1 accepted drafts said stop for the T = 0 bucket, every later request was
  planned at 0 from that, and at 64 tokens an answer met its first probe (32 steps) once at most (eager
  default 0.99x / 0.83x of speculation off where always drafting gave 1.36x / 1.37x). Weighed, one verify
  that accepts 6 of 6 places a sequence with the easy ones (or the new kind) and one that accepts none with
  the hard ones. A bucket starts optimistic (every draft accepted) so that it gets measured.
- Cost, per batch-size bucket (powers of two): plain decode steps' wall time (the median of a window), and
  drafted steps' as a ratio to the plain steps measured beside them: each drafted step's ms over the median
  of the `min_samples` plain steps nearest it in time, before or after it (counted in measured steps), so
  that a busy neighbour, which slows both, moves neither the ratio nor the choice. In ms, the drafted
  window went stale: while drafting is off it gains a sample or two a probe, and a median taken in a busy
  spell (load 2 -> 4.6) priced a drafted step at 3.0 plain ones where it cost 2.2, for many requests after
  it, and requests whose probe accepted 6 of 6 drafts stayed off; while drafting is on, plain steps are
  measured once a probe, and the nearest ones after a drafted step, not only those before it, say what
  the machine was doing then. A drafted step is priced A + C * rows plain steps (the current median),
  fitted to the window's (verify rows, ratio) pairs: the median per row count, a line through them where
  several counts were seen, else C from the prior. Medians, because one step that met a compile, a
  collection or a busy neighbour must not turn drafting off. Until the plain window holds `min_samples`
  steps, and as many drafted steps have a ratio, the prior holds: A = `prior_fixed` plain steps, C =
  `prior_row` per row (a 2-core CPU: a drafted step cost 3 to 4.7 plain ones), and C is 0 until two row
  counts are measured: a prior that priced rows shortened blocks before anything was measured, the later
  drafts were then never reached, their rates never measured, and a compiled step, whose rows cost nothing
  extra, stopped drafting where full blocks paid 1.28x). A drafted step measured before any plain one
  takes its ratio from the plain steps after it. Where the step's shapes are static (graph mode: a verify
  entry computes 1 + K rows per sequence whatever k is), a row costs nothing beyond the entry:
  `padded_rows` fixes C at 0 and A is the drafted steps' median ratio. A line fitted there anyway read C =
  0.8 ms per row from noise between blocks of 3 to 5 drafts, priced a full block at 8.4 ms against the 6.8
  it cost, and kept the default at 1.18x where full blocks decoded at 1.51x (bf16, batch 1).

Each step the plan picks every sequence's k in 0..K to maximise the batch's tokens per second, sum E_s(k_s) /
(A + C * sum k_s), against B / t_plain for a plain step (coordinate ascent: K and B are small). Drafting
starts only where it wins by `margin` and stops where it no longer wins at all, so the choice does not flap on
noise, and it does not stop before every running sequence's temperature bucket holds `min_evidence` verifies:
a first answer's first few blocks (0.75 and 0.42 accepted at the first two positions where the bucket later
settled at 0.9) turned a T=0 batch-1 engine off until its probe, 30 steps later, in every fresh process. A new
sequence is probed with a full block from the step that prefills it (`plan_admitted`), and one planned at 0
again after `probe_every` of its steps; where no one drafts, the sequences due wait for the others due, at
most once every `probe_every` steps, unless every sequence of the step is due (at batch 1 a new request: one
or two drafted steps a request, two where async scheduling plans the next step before the verify is seen; what
an all-hard stream pays). A probe's block is not a choice to draft: what it measured must win by `margin` for
drafting to start. Every `probe_every` drafted steps two steps run plain (the second a plain decode) so that
both costs stay measured. With no sequence drafting the step runs plain and the drafter does not run.

`--speculative-adaptive` turns it on or off; the default is on for the drafter the model ships (the
default setup must never be a loss) and off for a drafter the caller names (explicit users keep the
behaviour they asked for, as with the batch-size threshold).
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice

import numpy as np


def temperature_bucket(t: float) -> int:
    return 0 if t <= 0 else 1 if t <= 0.5 else 2 if t <= 1.0 else 3


def batch_bucket(n: int) -> int:
    return max(1, n - 1).bit_length()


class Acceptance:
    """Decayed per-position counts: reached[i] verifies reached draft i, accepted[i] accepted it."""

    def __init__(self, k: int, prior: float = 0.0, decay: float = 1 / 128):
        self.reached = [prior] * k
        self.accepted = [prior] * k
        self.decay = decay

    def observe(self, verified: int, accepted: int) -> None:
        keep = 1.0 - self.decay
        for i in range(len(self.reached)):
            self.reached[i] *= keep
            self.accepted[i] *= keep
        for i in range(min(verified, accepted + 1, len(self.reached))):
            self.reached[i] += 1.0
            self.accepted[i] += i < accepted

    def rates(self, towards: list[float] | None = None, shrink: float = 0.0) -> list[float]:
        out = []
        for i, (r, a) in enumerate(zip(self.reached, self.accepted)):
            base = towards[i] if towards is not None else 1.0
            out.append((a + shrink * base) / (r + shrink) if r + shrink > 0 else base)
        return out


def expected_table(rates: list[float]) -> list[float]:
    """[E(0), E(1), ..., E(len(rates))]: the verify's own token plus each draft's chance of being reached
    and accepted."""
    out, p = [1.0], 1.0
    for a in rates:
        p *= a
        out.append(out[-1] + p)
    return out


def expected_tokens(rates: list[float], k: int) -> float:
    return expected_table(rates[:k])[-1]


class _Drafted:
    """A drafted step: its verify rows, its time `t` (the policy's count of measured steps), its ms, and the
    `n` plain steps measured nearest it in time, before or after it, as (distance, ms). Its cost is `ratio`,
    its ms over their median (None until a plain step is measured): a busy neighbour slows both."""

    __slots__ = ("rows", "t", "ms", "near", "ratio", "open")

    def __init__(self, rows: int, t: int, ms: float, before: Iterable[tuple[int, float]], n: int):
        self.rows, self.t, self.ms, self.open = rows, t, ms, True
        self.near, self.ratio = sorted((t - tp, p) for tp, p in before)[:n], None
        if self.near:
            self._price()

    def add(self, t: int, ms: float, n: int) -> None:
        """A plain step measured after it, at `t`: kept if among the nearest `n`; the first one that is not
        closes it (later ones are farther still)."""
        d = t - self.t
        if len(self.near) >= n and d >= self.near[-1][0]:
            self.open = False
            return
        self.near = sorted([*self.near, (d, ms)])[:n]
        self._price()

    def _price(self) -> None:
        self.ratio = self.ms / max(statistics.median(p for _, p in self.near), 1e-6)


class _Calibration:
    """Drafts accepted over drafts expected, for the blocks the plan chose (probes excluded: nothing picked
    them), decayed so that it follows the traffic; it scales each draft's expected share of a verify once
    `min_blocks` blocks are in. Capped at 1: it corrects the estimates the plan's choice biases upwards, and
    an estimate that runs low is corrected by the acceptance counts themselves."""

    def __init__(self, decay: float = 1 / 256, min_blocks: float = 16.0):
        self.decay, self.min_blocks = decay, min_blocks
        self.expected = self.accepted = self.blocks = 0.0

    def observe(self, expected: float, accepted: int) -> None:
        keep = 1.0 - self.decay
        self.expected = keep * self.expected + expected
        self.accepted = keep * self.accepted + accepted
        self.blocks = keep * self.blocks + 1.0

    @property
    def factor(self) -> float:
        if self.blocks < self.min_blocks or self.expected <= 0.0:
            return 1.0
        return min(1.0, self.accepted / self.expected)

    def apply(self, table: list[float]) -> list[float]:
        f = self.factor
        return table if f == 1.0 else [1.0 + f * (e - 1.0) for e in table]


@dataclass
class _Costs:
    plain: deque = field(default_factory=lambda: deque(maxlen=32))     # (t, ms)
    drafted: deque = field(default_factory=lambda: deque(maxlen=32))   # _Drafted


def _line(samples: list, prior_row: float, floor: float) -> tuple[float, float]:
    """A and C of cost = A + C * rows from (rows, cost) pairs: medians per row count, least squares through
    them weighted by count (C >= 0); with one row count seen, C = prior_row and A its median less that. A is
    at least `floor` (a plain step: a drafted one runs the same forward and the drafter besides), the line
    still through the weighted mean: a fit over row counts close together (blocks cut by confidence, 5 and 6
    drafts) extrapolates A to nothing or below, and the plan then verified one draft where six paid 2x."""
    by_rows: dict[int, list[float]] = {}
    for rows, ms in samples:
        by_rows.setdefault(rows, []).append(ms)
    pts = [(r, statistics.median(v), len(v)) for r, v in by_rows.items()]
    if len(pts) >= 2:
        w = sum(n for _, _, n in pts)
        mx = sum(r * n for r, _, n in pts) / w
        my = sum(m * n for _, m, n in pts) / w
        var = sum(n * (r - mx) ** 2 for r, _, n in pts)
        c = max(0.0, sum(n * (r - mx) * (m - my) for r, m, n in pts) / var)
        if my - c * mx < floor:
            c = max(0.0, (my - floor) / mx)
        return max(my - c * mx, floor), c
    (r, m, _), = pts
    return max(m - prior_row * r, floor), prior_row


class _PastSequences:
    """A temperature bucket as a mixture over its last `size` finished sequences, each one component: its own
    rates, with one pseudo-verify of the bucket's pooled rates. Requests differ more than a pooled count
    shows: one hard prompt's many short verifies outweighed the easy ones that followed it, and a new
    sequence started from that. A new sequence's prior is the components' rates weighted by how well each
    explains the verifies it has had (equal weights before its first), beside a component of a new kind
    (every draft accepted, `NEW_KIND` a position, the weight of one sequence): a sequence that accepts more
    than any seen one is not held to them."""

    NEW_KIND, FLOOR = 0.98, 0.02        # rates clipped so that one verify never rules a component out

    def __init__(self, k: int, size: int):
        self.rates: deque = deque(maxlen=size)
        self.k, self.version = k, 0
        self._table: tuple | None = None

    def add(self, acc: Acceptance, pooled: list[float]) -> None:
        if acc.reached[0] <= 0:
            return                      # never verified: nothing of its own
        rates = [(a + b) / (r + 1.0) for r, a, b in zip(acc.reached, acc.accepted, pooled)]
        self.rates.append([min(max(x, self.FLOOR), self.NEW_KIND) for x in rates])
        self.version += 1
        self._table = None

    def prior(self, acc: Acceptance) -> list[float] | None:
        """The components' rates weighted by their likelihood of `acc`'s counts; None with no component."""
        if not self.rates:
            return None
        if self._table is None:
            r = np.array([[self.NEW_KIND] * self.k, *self.rates])
            self._table = (r, np.log(r), np.log1p(-r))
        r, log_r, log_miss = self._table
        reached, accepted = np.array(acc.reached), np.array(acc.accepted)
        loglik = log_r @ accepted + log_miss @ (reached - accepted)
        w = np.exp(loglik - loglik.max())
        return (w @ r / w.sum()).tolist()


@dataclass
class _SeqState:
    bucket: int
    acc: Acceptance
    k: int = -1                  # the last planned k (-1: not planned yet)
    steps_off: int = 0
    probe: bool = True           # a new sequence is probed at once: its evidence, not only its bucket's
    forced: bool = False         # k was set by a probe, not chosen: it does not count as drafting
    predicted: float = 0.0       # the drafts the plan expected this block to get accepted (0: forced or none)
    dormant: bool = False        # arrived while its bucket was dormant: never drafts, no drafter context
    planned: int = 0             # plans it was in
    chosen: int = 0              # of them, those that chose to draft for it (probes not counted)
    verifies: int = 0
    prior: list | None = None    # its prior rates, for (past sequences' version, its verifies) in prior_key
    prior_key: tuple = ()


class DraftPolicy:
    def __init__(self, max_tokens_per_step: int, prior_fixed: float = 3.0, prior_row: float = 0.0,
                 margin: float = 1.05, probe_every: int = 32, shrink: float = 8.0, min_samples: int = 3,
                 padded_rows: bool = False, min_evidence: float = 16.0, history: int = 16,
                 dormant_window: int = 8, dormant_below: float = 0.05, explore_every: int = 8,
                 draft_sampled: bool = True):
        self.k_max = max_tokens_per_step - 1
        self.padded_rows, self.min_evidence = padded_rows, min_evidence
        self.prior_fixed, self.prior_row = prior_fixed, prior_row
        self.margin, self.probe_every, self.shrink, self.min_samples = margin, probe_every, shrink, min_samples
        # Optimistic start per temperature bucket: every draft accepted, so the first sequences draft.
        self.buckets = [Acceptance(self.k_max, prior=1.0) for _ in range(4)]
        self.past = [_PastSequences(self.k_max, history) for _ in range(4)]
        self.costs: dict[int, _Costs] = {}
        self.seqs: dict[int, _SeqState] = {}
        self._drafted_steps = 0
        self._t = 0                  # steps measured (observe_step), the clock of the cost samples
        self._plain_left = 0
        self._plain_steps = 0        # plans in a row in which no sequence drafted
        self._last_win = 0.0         # the last plan's drafted tokens per ms over a plain step's
        self.num_probes = 0
        # Per temperature bucket, the accepted drafts of chosen blocks against what the plan expected of them
        # (decayed sums): the plan drafts where its estimate is high, so the estimates of the blocks it picks
        # run high (T=0.8, shipped drafter: 3.03 tokens a verify expected, 2.44 got).
        self.calibration = [_Calibration() for _ in range(4)]
        # A bucket whose last `dormant_window` finished sequences all chose drafting in under
        # `dormant_below` of their steps is dormant: its new sequences neither draft nor pay the drafter's
        # context write on every step (eager fp32 at batch 1: 6% of a step, a drafter that never drafts),
        # except every `explore_every`-th, which runs as before and wakes the bucket if it chose to draft.
        self.dormant_window, self.dormant_below, self.explore_every = dormant_window, dormant_below, explore_every
        self.dormant = [False] * 4
        # False: a sampled sequence (T > 0) never drafts, probes or needs the drafter's context, as a dormant
        # bucket's without an explorer (graph mode on CPU, where a sampled drafted step costs about two plain
        # ones: engine_config.sampled_drafting_off).
        self.draft_sampled = draft_sampled
        self._choices = [deque(maxlen=dormant_window) for _ in range(4)]
        self._arrivals = [0] * 4

    # -- what the engine asks ------------------------------------------------------------------------
    def plan(self, seqs: list[tuple[int, float]]) -> dict[int, int]:
        """k for each (seq_id, temperature) of the sequences the next step may run."""
        states = [self._state(sid, t) for sid, t in seqs]
        b = len(states)
        if not states:
            return {}
        # E_s(k) for every sequence and k once; the ascent then moves running totals (O(B K) a step: the
        # plan runs on the engine's thread before every step).
        none = [1.0] * (self.k_max + 1)
        gains = [none if st.dormant else self.calibration[st.bucket].apply(expected_table(self.rates(st)))
                 for st in states]
        plain_ms, fixed_ms, row_ms = self.step_costs(b)
        ks = [self.k_max] * b
        tokens = sum(g[-1] for g in gains)
        rows = self.k_max * b
        for _ in range(2):
            for i in range(b):
                base_t, base_r = tokens - gains[i][ks[i]], rows - ks[i]
                best = max(range(self.k_max + 1),
                           key=lambda k: self._per_ms(base_t + gains[i][k], base_r + k, fixed_ms, row_ms))
                tokens, rows, ks[i] = base_t + gains[i][best], base_r + best, best
        drafted = self._per_ms(tokens, rows, fixed_ms, row_ms)
        self._last_win = drafted * plain_ms / b
        # Start only on a clear win, stop only where it no longer wins: noise does not flap the choice.
        was_on = any(st.k > 0 and not st.forced for st in states)
        settled = all(self.buckets[st.bucket].reached[0] >= self.min_evidence for st in states if not st.dormant)
        if settled and (not any(ks) or self._last_win < (1.0 if was_on else self.margin)):
            ks = [0] * b
        # A dormant sequence gains nothing from a draft, but the ascent's first draft of a batch has nothing
        # to compare with (no drafted step: 0 tokens per ms) and would take it.
        ks = [0 if st.dormant else k for st, k in zip(states, ks)]
        # A probe in a step that drafts anyway costs its verify rows; in one that would run plain it costs a
        # drafted step (the drafter runs for the whole batch), so there the sequences due wait until
        # `probe_every` plain steps have passed and are probed together: one drafted step in 32, where one
        # probe per sequence every 32 of its steps made every other step at batch 16 a drafted one. Unless
        # every sequence of the step is due (at batch 1, a new request): the drafted step then serves all.
        probes = [i for i, st in enumerate(states) if st.probe]
        started = any(states[i].k > 0 for i in probes)      # drafted last step: this one verifies it
        whole = len(probes) == b
        if probes and not any(ks) and not started and not whole and self._plain_steps < self.probe_every:
            probes = []
        for i, st in enumerate(states):
            # Calibration corrects the choice's bias, not the optimistic start: a bucket's first blocks are
            # planned on every draft accepted, and at T = 0 the 16 blocks that filled the calibration before
            # its bucket settled set its factor to 0.58, so a sequence whose own estimate (2.54 tokens a
            # verify) was right went plain at 1.9: 49 steps where drafting took 24.
            calibrated = self.buckets[st.bucket].reached[0] >= self.min_evidence
            st.forced, st.predicted = False, gains[i][ks[i]] - 1.0 if calibrated else 0.0
        # Until its verify is seen: the step that drafts, then the one that verifies. An arrival's block is
        # drafted whatever the plan would choose from its bucket's prior alone, so it is never a choice.
        for i in probes:
            states[i].forced = ks[i] == 0 or states[i].verifies == 0
            ks[i] = self.k_max
        for i, st in enumerate(states):
            st.k = ks[i]
            st.planned += 1
            if st.forced:
                st.predicted = 0.0
            elif ks[i]:
                st.chosen += 1
        self._plain_steps = 0 if any(ks) else self._plain_steps + 1
        return {sid: k for (sid, _), k in zip(seqs, ks)}

    def plan_admitted(self, seqs: list[tuple[int, float]], others_draft: bool) -> dict[int, int]:
        """k for sequences this step's schedule admitted after `plan` ran (their prompt's last chunk samples
        in it), so that the drafter drafts after the prefill and the first decode step verifies: a new
        sequence is probed with a full block at once. Planned at their first decode step instead, each
        request took one step more than always drafting (a plain step that drafts, then the verify): at batch
        1 in graph mode, with answers of about 25 tokens, the default decoded at 0.86x of always drafting.
        As in `plan`, a probe does not make a step that drafts for no one else draft for the whole batch
        (`others_draft`), unless every sampling sequence of the step is new."""
        out = {}
        for sid, t in seqs:
            st = self._state(sid, t)
            k = self.k_max if st.probe and not st.dormant and others_draft else 0
            st.k, st.forced, st.predicted = k, k > 0, 0.0
            out[sid] = k
        return out

    def plain_probe_due(self, batch: int = 0) -> bool:
        """True for two steps once every `probe_every` drafted steps, to keep the plain cost measured: the
        first still verifies the drafts it holds, the second is a plain decode. Also at once at a batch size
        whose drafted steps are measured and whose plain ones are not yet (`min_samples`): its decision
        otherwise rests on the prior, and at batch 8 in graph mode the prior's 3 plain steps a drafted one
        kept drafting on where it decoded at 0.82x."""
        if self._plain_left == 0:
            c = self.costs.get(batch_bucket(batch)) if batch else None
            unmeasured = c is not None and len(c.drafted) >= self.min_samples and len(c.plain) < self.min_samples
            # Far from break-even (drafting wins by 1.5x) the plain cost is re-measured 4 times less often: each
            # probe costs two steps outside the compiled drafted step (graph mode's default decoded at 1.41x
            # where drafting every step gave 1.53x; with this, 1.38x against 1.51x: probes are not the gap).
            every = self.probe_every * (4 if self._last_win >= 1.5 else 1)
            if unmeasured or self._drafted_steps >= every:
                self._drafted_steps, self._plain_left = 0, 2
        if self._plain_left:
            self._plain_left -= 1
            return True
        return False

    def rates(self, st: _SeqState) -> list[float]:
        return st.acc.rates(self._prior(st), self.shrink)

    def _prior(self, st: _SeqState) -> list[float]:
        """The bucket's past sequences weighed by this one's verifies; before any finished, the pooled rates."""
        past = self.past[st.bucket]
        if not past.rates:
            return self.buckets[st.bucket].rates()
        # Weighed again at each of its first `shrink` verifies, then at every `shrink`-th: by then its own
        # counts outweigh the prior and the weights move slowly (the plan runs before every step: at batch
        # 8, weighing at every verify cost 40 us a sequence).
        n = int(self.shrink) or 1
        key = (past.version, st.verifies if st.verifies < n else st.verifies // n * n)
        if st.prior_key != key:
            st.prior, st.prior_key = past.prior(st.acc), key
        return st.prior

    def step_costs(self, batch: int) -> tuple[float, float, float]:
        """(plain step ms, drafted step's fixed ms, ms per verify row) at this batch size; in units of a
        plain step where nothing is measured yet."""
        c = self.costs.get(batch_bucket(batch))
        plain = statistics.median(ms for _, ms in c.plain) if c and len(c.plain) >= self.min_samples else None
        if plain is None:
            return 1.0, self.prior_fixed, self.prior_row
        # Drafted steps in plain steps measured beside them, priced at today's plain step: while drafting is
        # off, the drafted window gains a sample or two a probe, and its median in ms dated from a busy spell.
        ratios = [(d.rows, d.ratio) for d in c.drafted if d.ratio is not None]
        if len(ratios) < self.min_samples:
            return plain, self.prior_fixed * plain, self.prior_row * plain
        if self.padded_rows:
            return plain, plain * max(1.0, statistics.median(r for _, r in ratios)), 0.0
        fixed, row = _line(ratios, self.prior_row, 1.0)
        return plain, fixed * plain, row * plain

    # -- what the engine learns ----------------------------------------------------------------------
    def observe_step(self, batch: int, rows: int, ms: float) -> None:
        """A pure decode step (no prefill) of `batch` sampling sequences that verified `rows` drafts and
        drafted again, or (rows = 0) neither."""
        c = self.costs.setdefault(batch_bucket(batch), _Costs())
        self._t += 1
        n = self.min_samples
        if rows:
            c.drafted.append(_Drafted(rows, self._t, ms, islice(reversed(c.plain), n), n))
            self._drafted_steps += 1
        else:
            for d in c.drafted:
                if d.open:
                    d.add(self._t, ms, n)
            c.plain.append((self._t, ms))

    def observe_verify(self, seq_id: int, temperature: float, verified: int, accepted: int) -> None:
        """A verify of `verified` drafts of the sequence accepted `accepted` of them."""
        st = self._state(seq_id, temperature)
        if st.predicted > 0.0 and verified:
            self.calibration[st.bucket].observe(st.predicted, accepted)
        st.predicted = 0.0
        st.acc.observe(verified, accepted)
        self.buckets[st.bucket].observe(verified, accepted)
        st.steps_off, st.probe = 0, False
        st.verifies += 1

    def observe_plain(self, seq_id: int) -> None:
        """The sequence took a step without verifying: one planned at 0 counts towards its probe."""
        st = self.seqs.get(seq_id)
        if st is None or st.k != 0 or st.dormant:      # a dormant sequence is never probed
            return
        st.steps_off += 1
        if st.steps_off >= self.probe_every:
            st.steps_off, st.probe = 0, True
            self.num_probes += 1

    def forget(self, seq_id: int) -> None:
        """The sequence finished: it joins its bucket's past sequences."""
        st = self.seqs.pop(seq_id, None)
        if st is None or st.dormant:
            return
        self.past[st.bucket].add(st.acc, self.buckets[st.bucket].rates())
        if st.planned:
            drafted = st.chosen / st.planned >= self.dormant_below
            choices = self._choices[st.bucket]
            choices.append(drafted)
            if drafted:
                self.dormant[st.bucket] = False
            elif len(choices) == choices.maxlen and not any(choices):
                self.dormant[st.bucket] = True

    def wants_context(self, seq_id: int, temperature: float) -> bool:
        """Whether the drafter needs this sequence's context (False: it arrived while its temperature bucket
        was dormant and is not that bucket's explorer). A step writes the drafter's context when any of its
        sequences wants it."""
        return not self._state(seq_id, temperature).dormant

    # -- internals -------------------------------------------------------------------------------------
    def _state(self, seq_id: int, temperature: float) -> _SeqState:
        st = self.seqs.get(seq_id)
        if st is None:
            b = temperature_bucket(temperature)
            st = self.seqs[seq_id] = _SeqState(b, Acceptance(self.k_max))
            if b > 0 and not self.draft_sampled:
                st.dormant, st.probe = True, False
            elif self.dormant[b]:
                self._arrivals[b] += 1
                st.dormant = self._arrivals[b] % self.explore_every != 0
                st.probe = not st.dormant
        return st

    @staticmethod
    def _per_ms(tokens: float, rows: int, fixed: float, row: float) -> float:
        """Tokens per ms of a drafted step verifying `rows` drafts in all (none verified: not a drafted step)."""
        return tokens / (fixed + row * rows) if rows else 0.0
