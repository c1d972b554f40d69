"""The worker-side proposer interface and the buffer that keeps drafts on the device between steps.

A proposer is called by the model runner in the same step, right after the target's forward and the
verification of the drafts proposed last step. A device proposer (`on_device = True`, e.g. a DFlash
drafter) gets that forward's hidden states of the layers it lists in `hidden_layers` and returns draft
ids (and, for T > 0, their distributions) as device tensors; a host proposer (n-gram prompt lookup)
reads the sequences' token histories after the step's one host read and returns ids. Either way the
drafts go into the `DraftBuffer`, by sequence slot, and the next step's verify reads its inputs from
there: draft ids never travel to the engine process, which only learns how many drafts each sequence
has (and their ids for sequences whose grammar must check them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class ProposerInput:
    """One step, seen by a proposer: S sampling sequences after verification."""

    seq_ids: list[int]
    prompt_lens: list[int]
    histories: list[list[int]]             # known tokens (prompt + committed outputs), after this step
    hidden: dict[int, torch.Tensor]        # layer -> [N, H] this forward's hidden states (device)
    final_hidden: torch.Tensor | None      # [N, H] final-normed hidden states (device)
    rows: torch.Tensor | None              # [S, K+1] flat query index of each sequence's sampled rows
    tokens: torch.Tensor | None            # [S, K+1] emitted tokens (device); tokens[s, :accepted[s] + 1]
    accepted: torch.Tensor | None          # [S]
    # Where this forward's tokens sit, for a proposer that keeps per-sequence context in the paged cache
    # (all device tensors; see `DFlashProposer`):
    positions: torch.Tensor | None = None      # [N] position of each flat token (after async corrections)
    slot_mapping: torch.Tensor | None = None   # [N] its KV-cache slot (block * block_size + offset)
    block_tables: torch.Tensor | None = None   # [B, max_blocks] of the batch's sequences
    batch_index: torch.Tensor | None = None    # [S] batch row of each sampling sequence
    # Sampling settings of each sampling sequence, for a proposer that draws (and returns q); None where
    # every row is greedy (all_greedy):
    temperature: torch.Tensor | None = None    # [S]
    seeds: torch.Tensor | None = None          # [S]
    counters: torch.Tensor | None = None       # [S, K+1] output index of each sampled row's token
    all_greedy: bool = True                    # host flag: no sequence samples at T > 0


@dataclass
class Proposal:
    ids: list[list[int]] | torch.Tensor              # host: per sequence; device: [S, k]
    counts: torch.Tensor | None = None               # device proposals: [S] drafts per sequence
    probs: list[np.ndarray | None] | torch.Tensor | None = None   # draft distributions [k, V] per sequence
    # Device proposals whose probs are zero outside a few candidates: those candidates [S, k, K]. Under TP
    # the broadcast then carries K values per position, not the vocabulary's V.
    support: torch.Tensor | None = None


class Proposer(Protocol):
    """What every proposer has. `on_device` says which of the two kinds it is (checked once, when the
    worker attaches it: `check_proposer`):
    - a host proposer (`on_device = False`, n-gram lookup) drafts from `ProposerInput.histories` after the
      step's one host read and returns lists of ids (and optionally per-draft distributions);
    - a device proposer (`on_device = True`, a DFlash drafter) drafts inside the step from the hidden states
      of `hidden_layers` and returns device tensors that never leave the device."""

    on_device: bool
    hidden_layers: tuple[int, ...]

    def propose(self, inp: ProposerInput, k: int) -> Proposal:
        """At most k drafts per sequence, continuing after its last committed token."""
        ...


class ContextProposer(Proposer, Protocol):
    """A device proposer with its own per-position context in the paged cache (a DFlash drafter). The
    worker calls:
    - `kv_bytes_per_block(block_size, dtype)`: its cache bytes per KV block (planned with the target's);
    - `attach(target_model, num_blocks, block_size)`: once, in the worker, after the KV cache is allocated;
    - `extend_context(inp)`: every forward, sampling or not, before `propose` (S may be 0).
    `draft_seconds` is its running wall time in those calls (the step result reports each step's share)."""

    draft_seconds: float

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...

    def attach(self, target: torch.nn.Module, num_blocks: int, block_size: int) -> None: ...

    def extend_context(self, inp: ProposerInput) -> None: ...


_CONTEXT_HOOKS = ("kv_bytes_per_block", "attach", "extend_context")


@dataclass(frozen=True)
class ProposerKind:
    on_device: bool
    has_context: bool           # a ContextProposer (device only)
    hidden_layers: tuple[int, ...]


def check_proposer(proposer: Proposer) -> ProposerKind:
    """The kind of `proposer`, checked once: a TypeError names what is missing or inconsistent."""
    name = type(proposer).__name__
    if not callable(getattr(proposer, "propose", None)):
        raise TypeError(f"proposer {name} has no propose(inp, k)")
    on_device = getattr(proposer, "on_device", None)
    if not isinstance(on_device, bool):
        raise TypeError(f"proposer {name}: on_device must be True (drafts from hidden states, inside the step) "
                        "or False (drafts from token histories, after the host read)")
    layers = tuple(getattr(proposer, "hidden_layers", ()))
    hooks = [h for h in _CONTEXT_HOOKS if callable(getattr(proposer, h, None))]
    if hooks and len(hooks) != len(_CONTEXT_HOOKS):
        raise TypeError(f"proposer {name} has {hooks} but not {sorted(set(_CONTEXT_HOOKS) - set(hooks))}: a "
                        "proposer with its own context implements all of ContextProposer")
    if hooks and not on_device:
        raise TypeError(f"proposer {name}: only a device proposer keeps a context in the paged cache")
    if hooks and not isinstance(getattr(proposer, "draft_seconds", None), float):
        raise TypeError(f"proposer {name}: a ContextProposer keeps draft_seconds (float)")
    if layers and not on_device:
        raise TypeError(f"proposer {name}: hidden_layers {layers} are only handed to a device proposer")
    return ProposerKind(on_device, bool(hooks), layers)


class DraftBuffer:
    """Drafts per sequence slot on the device: ids [slots, K], counts, and (stochastic proposers)
    distributions [slots, K, V]. The host keeps the counts (and ids, for penalty histories and the
    grammar check) of what it wrote."""

    def __init__(self, k: int, vocab_size: int, device: torch.device):
        self.k, self.vocab_size, self.device = k, vocab_size, device
        self.ids = torch.zeros(0, max(k, 1), dtype=torch.long, device=device)
        self.probs: torch.Tensor | None = None
        self.counts: dict[int, int] = {}
        self.host_ids: dict[int, list[int]] = {}
        self.has_probs: dict[int, bool] = {}

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def ensure(self, num_slots: int) -> None:
        n = self.ids.shape[0]
        if num_slots > n:
            grow = max(num_slots, 2 * n) - n
            self.ids = torch.cat([self.ids, torch.zeros(grow, self.width, dtype=torch.long, device=self.device)])
            if self.probs is not None:
                self.probs = torch.cat([self.probs, torch.zeros(grow, self.width, self.vocab_size,
                                                                device=self.device)])

    def write(self, slots: np.ndarray, proposal: Proposal) -> np.ndarray:
        """Stores one step's proposal; returns the number of drafts per sequence (host)."""
        self.ensure(int(slots.max()) + 1 if len(slots) else 0)
        if isinstance(proposal.ids, torch.Tensor):
            raise TypeError("a device proposal (tensor ids) is stored with write_device, not write")
        counts = np.zeros(len(slots), dtype=np.int64)
        rows, cols, vals = [], [], []
        for s, (slot, ids) in enumerate(zip(slots.tolist(), proposal.ids)):
            ids = list(ids)[:self.k]
            counts[s] = len(ids)
            self.counts[slot] = len(ids)
            self.host_ids[slot] = ids
            rows += [slot] * len(ids)
            cols += range(len(ids))
            vals += ids
            probs = proposal.probs[s] if proposal.probs is not None else None
            self.has_probs[slot] = probs is not None
            if probs is not None and len(ids):
                if self.probs is None:
                    self.probs = torch.zeros(self.ids.shape[0], self.width, self.vocab_size, device=self.device)
                self.probs[slot, :len(ids)] = torch.as_tensor(np.asarray(probs[:len(ids)]), dtype=torch.float32,
                                                              device=self.device)
        if vals:
            self.ids[torch.as_tensor(rows), torch.as_tensor(cols)] = torch.as_tensor(vals, device=self.device)
        return counts

    def write_device(self, slots: torch.Tensor, proposal: Proposal) -> None:
        """Stores a device proposal without reading it (the counts reach the host with the step's result)."""
        ids = proposal.ids
        self.ids[slots, :ids.shape[1]] = ids
        if proposal.probs is not None:
            if self.probs is None:
                self.probs = torch.zeros(self.ids.shape[0], self.width, self.vocab_size, device=self.device)
            self.probs[slots, :ids.shape[1]] = proposal.probs

    def note_device_counts(self, slots: np.ndarray, counts: np.ndarray, ids: np.ndarray | None,
                           stochastic: bool) -> None:
        """The host's record of a device proposal, once the step's result was read."""
        for s, slot in enumerate(slots.tolist()):
            self.counts[slot] = int(counts[s])
            self.has_probs[slot] = stochastic
            if ids is not None:
                self.host_ids[slot] = [int(t) for t in ids[s, :counts[s]]]

    def count(self, slot: int) -> int:
        """Drafts held for `slot` (0: none)."""
        return self.counts.get(slot, 0)

    def host_drafts(self, slot: int) -> list[int]:
        """The held drafts' ids as the host knows them: a host proposal's, or a device proposal's for the
        sequences whose ids were returned (grammar sequences, penalty histories); else empty."""
        return self.host_ids.get(slot, [])

    def gather(self, src: torch.Tensor) -> torch.Tensor:
        """Held draft ids by flat index `slot * width + j` (the verify inputs)."""
        return self.ids.view(-1)[src]

    def distributions(self, slots: np.ndarray, slot_index: torch.Tensor, draft_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [S, K, V], has_q [S] bool) of the sequences in `slots` when any of their drafts came with a
        distribution; a sequence whose drafts did not gets the one-hot of its ids and has_q False (the
        acceptance rule treats it as a deterministic draft). None: all deterministic."""
        flags = [self.has_probs.get(int(slot), False) for slot in slots]
        if not any(flags) or draft_ids.shape[1] == 0 or self.probs is None:
            return None
        q = self.probs[slot_index, :draft_ids.shape[1]]
        onehot = torch.nn.functional.one_hot(draft_ids, self.vocab_size).float()
        has = torch.as_tensor(flags, device=q.device)
        return torch.where(has.view(-1, 1, 1), q, onehot), has

    def forget(self, slot: int) -> None:
        self.counts.pop(slot, None)
        self.host_ids.pop(slot, None)
        self.has_probs.pop(slot, None)
