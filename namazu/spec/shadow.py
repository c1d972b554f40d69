"""A shadow drafter: a second DFlash drafter that drafts beside the serving one on a sampled share of the
requests, is scored against what the target committed, and never changes what is served
(`--shadow-drafter DIR --shadow-fraction F`, `LLM(shadow_drafter=..., shadow_fraction=...)`).

Which requests: `shadow_sampled(request_id, F)`, a hash of the request id against F (deterministic: a
replayed request is shadowed again; F = 0 none, F = 1 all). The engine sends the sampled requests' sequence
ids to the worker once, with the next step (`StepBatch.shadow_seq_ids`); the worker forgets them when they
finish.

In the worker (rank 0 only: the scores are host numbers, no rank's decision depends on them), per step:
1. `extend_context`: the shadow's context keys/values of every position of the forward (shadowed or not: the
   prefix cache shares blocks between requests), from the same target hidden states the serving drafter
   reads, into a cache tensor of its own indexed by the target's KV slots (as `DFlashProposer` does; its
   bytes per block are planned with the target's at start-up), so a shadow's context follows prefill chunks,
   preemption by recompute and the prefix cache as the serving drafter's does. (CPU graph mode's compiled
   drafted tail, which writes the serving context inside it, runs only in steps without a shadowed sequence;
   the shadow's context of those steps' decode positions is not written, so a later request whose prompt
   hits those blocks in the prefix cache is drafted for by the shadow from a partial context.);
2. `score_on_device`: the target's probability of each held shadow draft at this step's rows (for the T > 0
   score below);
3. `propose`: where the serving drafter drafts, the shadow drafts a block for each shadowed sampling sequence
   from the same anchor (the bonus token), with a noise stream of its own (its draws are independent of the
   serving drafter's, as they would be if it served);
4. `after_read`, after the step's one host read: a second small read of the shadow's tensors, then scoring on
   the host, and the step's tallies into `StepResult.shadow`.
Nothing of it writes the serving drafter's cache, the draft buffer or any sampler state, so served tokens are
those of the serving path alone (tests/spec/test_shadow_drafter.py: identical greedy and seeded outputs).

Scoring (the acceptance length tau = drafts accepted + 1, the serving drafter's definition):
- exact rule rows (T = 0, a request that gave its seed, or a shadow that drafts without q): the serving step
  would accept the shadow's draft d_i iff it equals the target's own sample at that output index, and the
  committed tokens c_i are exactly those samples (greedy, or seeded decoding's tokens). So
      tau = 1 + (length of the longest prefix with d_i == c_i, at most the block's n drafts),
  read from the sequence's committed tokens as later steps bring them (a block stays open until a mismatch
  or n committed tokens; one still open when its sequence ends is scored on the tokens it got, one with none
  is dropped, as the serving drafter's last block is never verified). At T = 0 this is the acceptance the
  shadow would have had serving; at T > 0 without q it is one draw of it (c_i is distributed as the target's
  sample even where the serving rule drew it otherwise).
- ratio rule rows (T > 0, unseeded, drafts drawn from the shadow's q): the lossless rule accepts d_i with
  probability r_i = min(1, p_i(d_i) / q_i(d_i)) once d_1 .. d_{i-1} were accepted, so the expected number of
  accepted drafts of a block of n is
      E[accepted] = sum_{j=1}^{n} prod_{i=1}^{j} r_i,      expected tau = 1 + E[accepted],
  with p_i the target's processed (temperature, top-k/p, penalties, grammar) distribution after
  [anchor, d_1 .. d_{i-1}]. The next step computed p at its verify rows: row 0 after the anchor, row j after
  the serving drafts s_1 .. s_j. So p_i is known where d_1 .. d_{i-1} == s_1 .. s_{i-1} and i - 1 <= the
  serving drafts verified. The sum runs over those positions only (a prefix); positions past it are not
  scored (counted in `num_truncated_blocks`), which makes the expected tau a lower bound where the shadow
  leaves the serving drafter's path. A held block whose sequence's next step does not start at its anchor
  (preempted and recomputed meanwhile) is dropped (`num_dropped_blocks`).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.dflash_proposer import DFlashProposer
from namazu.spec.proposer import ProposerInput

logger = logging.getLogger(__name__)

# Noise stream of the shadow's draws (the sampler uses 0-2, the serving drafter 3): drawn with the serving
# drafter's stream, a shadow much like it would draw the same tokens and look better than it is.
STREAM_SHADOW = 4


class ShadowError(ValueError):
    """A shadow drafter this engine cannot run (no DFlash drafter serving, a draft tree, n-gram)."""


def shadow_sampled(request_id: str, fraction: float) -> bool:
    """Whether a request is shadowed: a hash of its id, as a number in [0, 1), below `fraction`."""
    if fraction <= 0.0:
        return False
    u = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") / 2.0 ** 64
    return u < fraction


# -- scoring (host) -----------------------------------------------------------------------------------------
def exact_accepted(drafts: list[int], committed: list[int]) -> tuple[int, bool]:
    """(drafts accepted, resolved) of a block under the exact rule: the longest prefix of `drafts` equal to
    `committed` (the tokens the target committed after the block's anchor, as many as are known); resolved
    once a draft differs or every draft was compared."""
    n = 0
    for d, c in zip(drafts, committed):
        if d != c:
            return n, True
        n += 1
    return n, n == len(drafts)


def expected_accepted(p: list[float] | np.ndarray, q: list[float] | np.ndarray) -> float:
    """E[accepted] = sum_{j=1}^{n} prod_{i<=j} min(1, p_i / q_i) of a block whose drafts have target
    probabilities p_i and drafter probabilities q_i (q_i > 0 for a drawn draft), position by position."""
    total, run = 0.0, 1.0
    for pi, qi in zip(p, q):
        run *= min(1.0, float(pi) / float(qi)) if qi > 0 else 0.0
        total += run
    return total


@dataclass
class _Block:
    start: int                      # tokens known (prompt + outputs) when it was drafted: d_1 predicts index start
    drafts: list[int]
    q: list[float] | None = None    # q_i(d_i): ratio-rule blocks only


def _zero_tally() -> dict[str, Any]:
    return {"acceptance_length_histogram": [], "num_exact_blocks": 0, "num_accepted_draft_tokens": 0,
            "num_draft_tokens": 0, "expected_acceptance_length_sum": 0.0, "num_expected_blocks": 0,
            "num_truncated_blocks": 0, "num_dropped_blocks": 0, "num_proposed_blocks": 0, "seconds": 0.0}


def _add_hist(hist: list[int], tau: int) -> None:
    if len(hist) < tau:
        hist.extend([0] * (tau - len(hist)))
    hist[tau - 1] += 1


def merge_tally(into: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """Adds one step's shadow tallies (`StepResult.shadow`) to running totals."""
    for key, value in step.items():
        if key == "acceptance_length_histogram":
            hist = into.setdefault(key, [])
            hist.extend([0] * (len(value) - len(hist)))
            for i, n in enumerate(value):
                hist[i] += n
        else:
            into[key] = into.get(key, 0) + value
    return into


def summary(tally: dict[str, Any]) -> dict[str, Any]:
    """The running tallies with their means: the exact rule's mean tau, the ratio rule's mean expected tau,
    and both pooled (each scored block weighs one)."""
    out = dict(tally)
    out["acceptance_length_histogram"] = list(tally["acceptance_length_histogram"])
    hist = out["acceptance_length_histogram"]
    exact_sum = float(sum((i + 1) * n for i, n in enumerate(hist)))
    ne, nx = tally["num_exact_blocks"], tally["num_expected_blocks"]
    out["mean_acceptance_length_exact"] = exact_sum / ne if ne else 0.0
    out["mean_acceptance_length_expected"] = tally["expected_acceptance_length_sum"] / nx if nx else 0.0
    out["mean_acceptance_length"] = ((exact_sum + tally["expected_acceptance_length_sum"]) / (ne + nx)
                                     if ne + nx else 0.0)
    return out


# -- start-up checks (engine process) -----------------------------------------------------------------------
def check_shadow(path: str, serving: Any, model_config: Any, config: Any) -> DFlashProposer:
    """The shadow drafter at `path`, checked as a serving drafter is at start-up (`check_drafter_checkpoint`:
    DrafterCheckpointError naming the field or tensor) and against what the shadow needs: a DFlash drafter
    serving (the shadow drafts at its anchors), chains (no draft tree). Loads no weights."""
    from namazu.spec.drafter_swap import drafter_id

    if not isinstance(serving, DFlashProposer):
        what = "no drafter" if serving is None else type(serving).__name__
        raise ShadowError(f"--shadow-drafter {path}: this engine serves {what}; a shadow drafts beside a serving "
                          "DFlash drafter (--speculative-model, or the model's own) and is scored at its steps")
    if config.speculative_tree_budget:
        raise ShadowError(f"--shadow-drafter {path}: not with --speculative-tree-budget (the shadow is scored on "
                          "a chain's verify rows); use one or the other")
    if not Path(path).is_dir():
        raise DrafterCheckpointError(f"--shadow-drafter {path}: not a directory")
    shadow = DFlashProposer(str(path), model_config.vocab_size, model_config.hidden_size,
                            model_config.num_hidden_layers, sample_drafts=serving.sample_drafts,
                            min_confidence=serving.min_confidence)
    shadow.drafter_id = drafter_id(shadow)
    return shadow


# -- in the worker (rank 0) ---------------------------------------------------------------------------------
def shadow_for_rank(config: Any, rank: int, serving: Any, model_config: Any) -> ShadowRunner | None:
    """Rank 0's shadow drafter for `--shadow-drafter` (the engine checked it with `check_shadow`), or None."""
    if config.shadow_drafter is None or rank != 0:
        return None
    if not isinstance(serving, DFlashProposer):
        raise ShadowError("--shadow-drafter needs a serving DFlash drafter in the worker")
    return ShadowRunner(config.shadow_drafter, serving.target_shape, config.num_speculative_tokens or 0,
                        serving.sample_drafts, serving.min_confidence)


@dataclass
class _Pending:
    """Device tensors of this step, read after the step's host read."""

    prop_ids: list[int] = field(default_factory=list)       # seq ids of the proposal's rows
    prop: tuple | None = None                               # (ids [S', k], counts [S'], q(d) [S', k] or None)
    prop_exact: list[bool] = field(default_factory=list)
    score_ids: list[int] = field(default_factory=list)      # seq ids of the scored rows
    score: tuple | None = None                              # (p(d) [S'', K+1], valid [S'', K+1])


class ShadowRunner:
    """The shadow drafter in rank 0's model runner: its context, its blocks, their scores."""

    def __init__(self, path: str, target_shape: tuple[int, int, int], k: int, sample_drafts: bool,
                 min_confidence: float):
        self.proposer = DFlashProposer(path, *target_shape, sample_drafts=sample_drafts,
                                       min_confidence=min_confidence)
        self.proposer.draft_stream = STREAM_SHADOW
        self.k = min(k, self.proposer.cfg.num_draft_tokens)
        self.shadowed: set[int] = set()
        self.open: dict[int, list[_Block]] = {}      # exact-rule blocks waiting for committed tokens
        self.held: dict[int, _Block] = {}            # ratio-rule blocks to score at the next step
        self._pending = _Pending()
        self._tally = _zero_tally()
        self._in_step = False      # this step carries a shadowed sequence (`note`)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.proposer.hidden_layers

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return self.proposer.kv_bytes_per_block(block_size, dtype)

    def attach(self, target: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        self.proposer.attach(target, num_blocks, block_size)

    # -- which sequences --------------------------------------------------------------------------------
    def note(self, b: Any) -> None:
        """A step arrived: the sequences it newly shadows, and whether it carries one."""
        self.shadowed.update(b.shadow_seq_ids)
        self._in_step = bool(self.shadowed) and any(int(s) in self.shadowed for s in b.seqs.seq_ids)

    def wants(self, b: Any) -> bool:
        """Whether this step carries a shadowed sequence (graph mode then runs its tail eagerly: the shadow
        reads the processed logits and hidden states the compiled tail keeps inside). `b` is the step `note`
        saw (or its trimmed copy: the same sequences)."""
        return self._in_step

    def forget(self, finished: list[int], seqs: Any) -> None:
        """Sequences that ended: open exact blocks are scored on the tokens they got (before the worker's
        table forgets those), held ratio blocks are dropped."""
        t0 = time.perf_counter()
        for sid in finished:
            self.shadowed.discard(sid)
            blocks = self.open.pop(sid, [])
            if blocks:
                hist = seqs.tokens_of(sid)
                for blk in blocks:
                    got = hist[blk.start:]
                    if got:
                        self._score_exact(blk, exact_accepted(blk.drafts, got)[0])
            if self.held.pop(sid, None) is not None:
                self._tally["num_dropped_blocks"] += 1
        self._tally["seconds"] += time.perf_counter() - t0

    # -- inside the step ----------------------------------------------------------------------------------
    def extend_context(self, b: Any, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       captured: dict[int, torch.Tensor]) -> None:
        """The shadow's context entries of every position this forward computed, shadowed or not: a block of
        the prefix cache computed for an unshadowed request may later hold a shadowed one's prompt, and its
        shadow context must be there too. (One product per token; the shadow's drafting, the larger cost,
        runs for the shadowed sequences only.)"""
        t0 = time.perf_counter()
        self.proposer.write_context(captured, positions, slot_mapping)
        self._tally["seconds"] += time.perf_counter() - t0

    def _sampling_rows(self, b: Any) -> tuple[list[int], list[int]]:
        """(sampling row s, seq id) of the shadowed sampling sequences of this step."""
        ids = b.seqs.seq_ids[b.spec.batch_index]
        pairs = [(s, int(sid)) for s, sid in enumerate(ids) if int(sid) in self.shadowed]
        return [s for s, _ in pairs], [sid for _, sid in pairs]

    def score_on_device(self, b: Any, prep: Any, processed: torch.Tensor, draft_ids: torch.Tensor | None,
                        num_drafts: torch.Tensor, row_layout: torch.Tensor) -> None:
        """The target's probability of each held ratio-rule draft at this step's rows, and which rows are on
        the draft's path (see the module docstring); read in `after_read`."""
        if not self.held or not self.wants(b):
            return
        t0 = time.perf_counter()
        sub, sids = [], []
        for s, sid in zip(*self._sampling_rows(b)):
            blk = self.held.get(sid)
            if blk is None:
                continue
            if int(prep.verify_from[s]) != blk.start - 1:     # not at its anchor: preempted meanwhile
                del self.held[sid]
                self._tally["num_dropped_blocks"] += 1
                continue
            sub.append(s)
            sids.append(sid)
        if sub:
            dev = processed.device
            width = row_layout.shape[1]                         # rows 0 .. K of each sequence
            d = torch.zeros(len(sub), width, dtype=torch.long)
            for r, sid in enumerate(sids):
                ids = self.held[sid].drafts[:width]
                d[r, :len(ids)] = torch.as_tensor(ids)
            d = d.to(dev)
            si = torch.as_tensor(sub, device=dev)
            logits = processed[row_layout[si]]                                       # [S'', K+1, V]
            pd = (logits.gather(-1, d.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)).exp()
            # Row j is after [anchor, s_1 .. s_j]: on the shadow's path iff d_1 .. d_j == s_1 .. s_j and j <= the
            # serving drafts verified. Row 0 always is.
            valid = torch.ones(len(sub), width, dtype=torch.bool, device=dev)
            if width > 1 and draft_ids is not None:
                same = (d[:, :width - 1] == draft_ids[si, :width - 1]).int().cumprod(1).bool()
                j = torch.arange(1, width, device=dev)
                valid[:, 1:] = same & (j <= num_drafts[si].unsqueeze(-1))
            self._pending.score_ids, self._pending.score = sids, (pd, valid)
        self._tally["seconds"] += time.perf_counter() - t0

    def propose(self, b: Any, rows: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor, site: Any,
                st: Any, row_layout: torch.Tensor) -> None:
        """The shadow's block for each shadowed sampling sequence, from the anchor the serving drafter
        drafts from (call only in a step where it drafts)."""
        if not self.wants(b):
            return
        sub, sids = self._sampling_rows(b)
        if not sub:
            return
        t0 = time.perf_counter()
        dev = tokens.device
        si = torch.as_tensor(sub, device=dev)
        greedy = bool(b.sampling.all_greedy)
        first = row_layout[si, 0]
        inp = ProposerInput(seq_ids=sids, prompt_lens=[], histories=[], hidden={}, final_hidden=None,
                            rows=rows[si], tokens=tokens[si], accepted=accepted[si], positions=site.positions,
                            slot_mapping=site.slot_mapping, block_tables=site.block_tables,
                            batch_index=site.batch_index[si], all_greedy=greedy,
                            temperature=None if greedy else st.temperature[first],
                            seeds=None if greedy else st.seeds[first],
                            counters=None if greedy else st.counters[row_layout[si]])
        prop = self.proposer.draft(inp, self.k)
        counts = prop.counts if prop.counts is not None else torch.full((len(sub),), prop.ids.shape[1],
                                                                       dtype=torch.long, device=dev)
        qd = prop.probs.gather(-1, prop.ids.unsqueeze(-1)).squeeze(-1) if prop.probs is not None else None
        # The exact rule's rows, as the serving rule decides them (spec/verify.py): greedy, or seeded
        # (engine-drawn seeds are negative), or drafts without q.
        sp = b.sampling
        first_h = b.spec.row_layout[sub, 0]
        exact = (sp.temperature[first_h] == 0) | (sp.seeds[first_h] >= 0) | (qd is None)
        self._pending.prop_ids, self._pending.prop = sids, (prop.ids, counts, qd)
        self._pending.prop_exact = [bool(x) for x in np.broadcast_to(exact, (len(sub),))]
        self._tally["seconds"] += time.perf_counter() - t0

    # -- after the step's host read -----------------------------------------------------------------------
    def after_read(self, seqs: Any) -> dict[str, Any]:
        """Scores what this step settled and opens the blocks it drafted; returns the step's tallies (and
        resets them)."""
        t0 = time.perf_counter()
        p, self._pending = self._pending, _Pending()
        tally = self._tally
        if p.score is not None:
            pd, valid = (x.cpu().numpy() for x in p.score)
            for r, sid in enumerate(p.score_ids):
                blk = self.held.pop(sid)
                n = min(len(blk.drafts), int(valid[r].sum()))      # valid is a prefix
                tally["expected_acceptance_length_sum"] += 1.0 + expected_accepted(pd[r, :n], blk.q[:n])
                tally["num_expected_blocks"] += 1
                tally["num_truncated_blocks"] += int(n < len(blk.drafts))
                tally["num_draft_tokens"] += len(blk.drafts)
        for sid, blocks in list(self.open.items()):
            hist = seqs.tokens_of(sid)
            still = []
            for blk in blocks:
                n, done = exact_accepted(blk.drafts, hist[blk.start:])
                if done:
                    self._score_exact(blk, n)
                else:
                    still.append(blk)
            if still:
                self.open[sid] = still
            else:
                del self.open[sid]
        if p.prop is not None:
            ids, counts, qd = p.prop
            ids, counts = ids.cpu().numpy(), counts.cpu().numpy()
            qd = qd.cpu().numpy() if qd is not None else None
            for r, sid in enumerate(p.prop_ids):
                c = int(counts[r])
                blk = _Block(len(seqs.tokens_of(sid)), [int(t) for t in ids[r, :c]])
                tally["num_proposed_blocks"] += 1
                if p.prop_exact[r]:
                    self.open.setdefault(sid, []).append(blk)
                else:
                    blk.q = [float(x) for x in qd[r, :c]]
                    if self.held.pop(sid, None) is not None:    # never scored: its sequence did not sample since
                        tally["num_dropped_blocks"] += 1
                    self.held[sid] = blk
        tally["seconds"] += time.perf_counter() - t0
        self._tally = _zero_tally()
        return tally

    def _score_exact(self, blk: _Block, accepted: int) -> None:
        t = self._tally
        _add_hist(t["acceptance_length_histogram"], accepted + 1)
        t["num_exact_blocks"] += 1
        t["num_accepted_draft_tokens"] += accepted
        t["num_draft_tokens"] += len(blk.drafts)


# -- in the engine ------------------------------------------------------------------------------------------
class ShadowStats:
    """The engine's view: which requests are shadowed, the running tallies, and the serving drafter's
    acceptance on the same sequences (the comparison the shadow is for)."""

    def __init__(self, shadow_id: str, path: str, fraction: float):
        self.shadow_id, self.path, self.fraction = shadow_id, path, fraction
        self.tally = _zero_tally()
        self.serving_hist: list[int] = []
        self.seq_ids: set[int] = set()
        self.new_seq_ids: list[int] = []
        self.num_requests = 0

    def add_request(self, request_id: str, seq_ids: list[int]) -> None:
        if shadow_sampled(request_id, self.fraction):
            self.num_requests += 1
            self.seq_ids.update(seq_ids)
            self.new_seq_ids.extend(seq_ids)

    def take_new(self) -> list[int]:
        new, self.new_seq_ids = self.new_seq_ids, []
        return new

    def observe_serving(self, seq_id: int, num_drafts: int, accepted: int) -> None:
        if num_drafts and seq_id in self.seq_ids:
            _add_hist(self.serving_hist, accepted + 1)

    def finished(self, seq_id: int) -> None:
        self.seq_ids.discard(seq_id)

    def add_step(self, step: dict[str, Any] | None) -> None:
        if step:
            merge_tally(self.tally, step)

    def report(self) -> dict[str, dict[str, Any]]:
        """{shadow id: tallies and means, with role "shadow" and the serving drafter's acceptance length
        histogram on the same sequences}."""
        out = summary(self.tally)
        hist = list(self.serving_hist)
        steps = sum(hist)
        out.update(role="shadow", path=self.path, fraction=self.fraction, num_shadowed_requests=self.num_requests,
                   serving_acceptance_length_histogram=hist,
                   serving_mean_acceptance_length=(sum((i + 1) * n for i, n in enumerate(hist)) / steps
                                                   if steps else 0.0))
        return {self.shadow_id: out}

