"""Speculation inside one rank's step: which drafts a step verifies, the acceptance decision, and the
proposal of the next block.

The model runner's step reads forward -> sample -> verify -> propose, and everything speculative in it is a
call here:
- `verify_held_drafts_only(batch)`: async scheduling plans a verify of k drafts before the step that drafts
  them returns; the rows of drafts the proposer did not make are dropped before the forward;
- `verify_inputs(prep)`: the held drafts, read from the device `DraftBuffer` into the forward's inputs;
- `extend_context(...)`: a drafter with its own context (DFlash) reads every forward's hidden states;
- `accept(...)`: the acceptance rule (`verify.py`) over this step's drafts, with the drafter's q where it
  drew them; under tensor parallelism rank 0's decision is every rank's;
- `propose_on_device(...)`: a device proposer drafts the next block before the step's one host read (its ids
  stay in the draft buffer; only counts reach the host);
- `after_read(...)`: after the host read, a host proposer (n-gram) drafts from the updated histories, and
  the buffer records what the engine learns.
The proposer's kind is checked once, when the runner is built (`proposer.check_proposer`).

With `--speculative-tree-budget N` (`tree_step.py`) a device proposer that drafts trees (DFlash2) drafts
a tree in every step that drafts; `plan_tree(...)` then gives the next step's tree inputs (rotary
positions, counters, the attention mask), `accept` decides over the tree and moves the accepted path's
latents into place, and `propose_on_device` drafts the next trees from the accepted positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from namazu.distributed.decisions import share_decision, share_device_proposal, share_device_tree
from namazu.layers.sampler import SamplingTensors, seeded_rows
from namazu.spec.proposer import DraftBuffer, Proposal, Proposer, ProposerInput, check_proposer
from namazu.spec.tree_step import TreePlan, TreeStep, step_topology
from namazu.spec.verify import verify_deterministic, verify_stochastic
from namazu.step.batch import StepBatch, StepResult, trim_drafts

if TYPE_CHECKING:
    from namazu.worker.seq_table import PreparedStep, WorkerSeqTable


@dataclass
class DraftSite:
    """Where this forward's tokens sit, for a device proposer (device tensors, and host flags)."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    batch_index: torch.Tensor
    sampling: dict[str, object] = field(default_factory=dict)   # temperature / seeds / counters / all_greedy

    def as_kwargs(self) -> dict[str, object]:
        return dict(positions=self.positions, slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                    batch_index=self.batch_index, **self.sampling)


class Speculator:
    """One rank's speculation state: the proposer (or none), its kind, and the draft buffer."""

    def __init__(self, proposer: Proposer | None, num_speculative_tokens: int, vocab_size: int,
                 device: torch.device, share_decisions: bool, world_size: int, tree_budget: int = 0,
                 tree_candidates: int = 0):
        self.proposer = proposer
        self.kind = check_proposer(proposer) if proposer is not None else None
        self.k = num_speculative_tokens if proposer is not None else 0
        self.device = device
        self.share_decisions, self.world_size = share_decisions, world_size
        self.tree_budget = tree_budget if self.k else 0
        self.tree_candidates = tree_candidates
        if self.tree_budget and not (self.on_device and callable(getattr(proposer, "propose_tree", None))):
            raise ValueError(f"--speculative-tree-budget {tree_budget} needs a drafter that drafts trees (DFlash2); "
                             f"{type(proposer).__name__} proposes one chain")
        # A tree's N node tokens are held where a chain's k drafts are: the buffer is as wide as the larger.
        self.drafts = DraftBuffer(max(self.k, self.tree_budget), vocab_size, device)
        self.tree: TreeStep | None = None     # built in `attach` (it needs the block size)
        self._plan: TreePlan | None = None    # this step's tree sequences
        self._target_kv: torch.Tensor | None = None
        self._stochastic = False     # the device proposer's last drafts came with q

    # -- set-up ---------------------------------------------------------------------------------------
    @property
    def on_device(self) -> bool:
        return self.kind is not None and self.kind.on_device

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states this step's forward must capture."""
        return self.kind.hidden_layers if self.on_device else ()

    @property
    def _context(self):
        return self.proposer if self.kind is not None and self.kind.has_context else None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """A drafter's context cache shares the target's KV blocks: its bytes per block (0: none)."""
        ctx = self._context
        return ctx.kv_bytes_per_block(block_size, dtype) if ctx is not None else 0

    def attach(self, target: torch.nn.Module, num_blocks: int, block_size: int,
               target_kv: torch.Tensor | None = None) -> None:
        """`target_kv`: the target's latent stack [L, blocks, bs, D], where a tree step moves the accepted
        path's latents."""
        ctx = self._context
        if ctx is not None:
            ctx.attach(target, num_blocks, block_size)
        self._target_kv, self._block_size = target_kv, block_size
        self._build_tree()

    def _build_tree(self) -> None:
        """The tree step for the proposer's shape (depth: its block; width: up to 8 of its candidates)."""
        if self.tree_budget:
            if not callable(getattr(self.proposer, "propose_tree", None)):
                raise ValueError(f"--speculative-tree-budget {self.tree_budget} needs a drafter that drafts trees")
            self.tree = TreeStep(step_topology(self.tree_budget, self.k, self.proposer.cfg, self.tree_candidates),
                                 self._block_size,
                                 self.device)

    @property
    def draft_seconds(self) -> float:
        ctx = self._context
        return ctx.draft_seconds if ctx is not None else 0.0

    def swap_proposer(self, proposer: Proposer) -> None:
        """Serves `proposer` from the next step on (`spec/drafter_swap.py`: attached already, and every
        sequence is recomputed, so no context of the old one is read). Drafts held from the old proposer are
        dropped: none may be verified after the switch."""
        kind = check_proposer(proposer)
        if self.kind is None or kind.on_device != self.kind.on_device:
            raise ValueError("a proposer is replaced only by one of the same kind (device or host)")
        self.proposer, self.kind = proposer, kind
        self._stochastic = False
        for slot in list(self.drafts.counts):
            self.drafts.forget(slot)
        if self.tree is not None:     # no tree of the old drafter is verified; the new one's shape may differ
            self._build_tree()

    # -- before the forward ---------------------------------------------------------------------------
    def forget_finished(self, seqs: WorkerSeqTable, finished: list[int]) -> None:
        for sid in finished:
            slot = seqs.slot_of(sid)
            if slot is not None:
                self.drafts.forget(slot)
                if self.tree is not None:
                    self.tree.forget(slot)

    def verify_held_drafts_only(self, b: StepBatch, seqs: WorkerSeqTable) -> StepBatch:
        """The batch without the verify rows of drafts the proposer did not make: async scheduling plans a
        verify of all k before the step that drafts them has returned, and a block may end early
        (`--speculative-min-confidence`) or not be drafted at all. Those rows could never be accepted;
        scoring them would cost as much as real drafts. Every rank must trim alike (their collectives need
        the same shapes): the counts are rank 0's wherever decisions are shared, so without sharing (a
        test's switch) the planned batch runs as it is."""
        if not b.spec.max_drafts or (self.world_size > 1 and not self.share_decisions):
            return b
        sq = b.seqs
        slots = [seqs.slot_of(sid) for sid in sq.seq_ids.tolist()]
        held = np.asarray([self.drafts.count(slot) if slot is not None else 0 for slot in slots], dtype=np.int64)
        keep = np.minimum(sq.num_drafts, held)
        return b if np.array_equal(keep, sq.num_drafts) else trim_drafts(b, keep)

    def plan_tree(self, b: StepBatch, prep: PreparedStep, to_device) -> TreePlan | None:
        """This step's tree sequences (`TreeStep.plan`; None: none, or no tree budget). The runner puts the
        plan's rotary positions and mask into the forward's inputs (eager) or a tree entry's buffers (graph
        mode: `StepGraphs.load`); the acceptance, path move and next tree run eagerly after either forward."""
        self._plan = self.tree.plan(b, prep, to_device) if self.tree is not None else None
        return self._plan

    def emitted_rows(self, row_layout: torch.Tensor) -> torch.Tensor:
        """[S, K+1] the logit row of each emitted token (a tree's accepted path; a chain's rows in order)."""
        return self.tree.emitted_rows(self._plan, row_layout) if self._plan is not None else row_layout

    def drafts_before(self, slot: int, drafts: list[int], row: int) -> list[int]:
        """The held drafts that verify row `row` (0: the root) of the sequence in `slot` follows, for its
        penalty counts: drafts[:row] for a chain, the node's own path for a tree."""
        if self.tree is not None and slot in self.tree.held:
            return self.tree.path_tokens(drafts, row)
        return drafts[:row]

    def max_accepted(self, num_drafts: np.ndarray) -> np.ndarray:
        """The most drafts each verify of `num_drafts` can accept, what async scheduling assumes accepted
        (the engine's `_assumed_accepted`): a tree's depth, a chain's length."""
        return self.tree.max_accepted(num_drafts) if self.tree is not None else num_drafts

    def verify_inputs(self, draft_src: torch.Tensor | None) -> torch.Tensor | None:
        """The held draft ids this step verifies, in the order of `PreparedStep.draft_flat` (device)."""
        return self.drafts.gather(draft_src) if draft_src is not None else None

    # -- inside the step ------------------------------------------------------------------------------
    def extend_context(self, b: StepBatch, hidden: torch.Tensor, captured: dict[int, torch.Tensor],
                       site: DraftSite | None) -> None:
        ctx = self._context
        if ctx is not None:
            ctx.extend_context(self._input(b, None, hidden, captured, None, None, None, site))

    def accept(self, processed: torch.Tensor, target: torch.Tensor, draft_ids: torch.Tensor,
               num_drafts: torch.Tensor, st: SamplingTensors, row_layout: torch.Tensor, prep: PreparedStep,
               slot_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S, K+1], accepted [S]) by the acceptance rule: exact match where drafts are
        deterministic or the request gave its seed, the lossless rule with the drafter's q elsewhere.
        `target` [S, K+1] holds the target's own sample at every row."""
        held = self.drafts.distributions(prep.slots, slot_index, draft_ids)
        if held is None:
            tokens, accepted = verify_deterministic(target, draft_ids, num_drafts)
        else:
            # Per row: a greedy row, or one whose drafts came without q, takes the deterministic rule (the
            # same decision the compiled drafted step makes, `drafted_step.py`).
            q, has_q = held
            first = row_layout[:, 0]
            tokens, accepted = verify_stochastic(processed[row_layout], target, draft_ids, q, num_drafts,
                                                 (st.temperature[first] == 0) | ~has_q, st.seeds[first],
                                                 st.counters[row_layout], seeded=seeded_rows(st.seeds[first]))
        plan = self._plan
        if plan is None:
            return self.shared(tokens, accepted)
        tokens, accepted = self.tree.accept(plan, processed, target, tokens, accepted, st, row_layout, slot_index)
        if self.share_decisions:
            # Rank 0's path too: which latents move where is part of the decision.
            tokens, accepted, plan.path = share_decision(tokens, accepted, self.world_size, plan.path)
            plan.num_accepted = torch.where(plan.is_tree, accepted, 0)
        self.tree.commit_path(plan, self._target_kv, getattr(self._context, "cache", None))
        return tokens, accepted

    def shared(self, tokens: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's tokens and acceptance counts on every rank (one decision under tensor parallelism)."""
        if self.share_decisions:
            return share_decision(tokens, accepted, self.world_size)[:2]
        return tokens, accepted

    def propose_on_device(self, b: StepBatch, prep: PreparedStep, hidden: torch.Tensor,
                          captured: dict[int, torch.Tensor], rows: torch.Tensor, tokens: torch.Tensor,
                          accepted: torch.Tensor, site: DraftSite, st: SamplingTensors, row_layout: torch.Tensor,
                          slot_index: torch.Tensor) -> dict[str, torch.Tensor]:
        """A device proposer drafts the next block from this forward's hidden states, continuing after each
        sequence's accepted tokens (`rows` [S, K+1], `tokens`, `accepted`), before the host read; its ids
        stay in the draft buffer and only their counts (and grammar sequences' ids) join the result."""
        site.sampling = {"all_greedy": bool(b.sampling.all_greedy)}
        plan = self._plan
        if plan is not None:        # the proposer counts from the positions and output indices as planned
            site.positions = plan.chain_positions
        if not b.sampling.all_greedy:      # what a proposer that draws reads
            first = row_layout[:, 0]
            site.sampling.update(temperature=st.temperature[first], seeds=st.seeds[first],
                                 counters=(plan.chain_counters if plan is not None else st.counters)[row_layout])
        inp = self._input(b, None, hidden, captured, rows, tokens, accepted, site)
        if self.tree is not None:
            return self._propose_tree(inp, prep, slot_index, b.spec.max_drafts_next)
        proposal = self.proposer.propose(inp, self.k)
        if self.share_decisions:
            proposal = share_device_proposal(proposal, self.world_size)
        return self.store_proposal(proposal, slot_index, b.spec.max_drafts_next)

    def _propose_tree(self, inp: ProposerInput, prep: PreparedStep, slot_index: torch.Tensor, width: int
                      ) -> dict[str, torch.Tensor]:
        """Each sampling sequence's next draft tree: its node tokens into the draft buffer (what the engine
        sees: N drafts), the rest kept by slot for the acceptance rule."""
        tree = self.proposer.propose_tree(inp, self.tree.tt)
        if self.share_decisions:
            tree = share_device_tree(tree, self.world_size)
        ids = self.tree.store(tree, prep.slots, slot_index, self.drafts.ids.shape[0])
        return self.store_proposal(Proposal(ids), slot_index, width)

    def store_proposal(self, proposal: Proposal, slot_index: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """A device proposal into the draft buffer, by slot; the result's values of it (counts and ids)."""
        self._stochastic = proposal.probs is not None
        ids = proposal.ids
        counts = proposal.counts if proposal.counts is not None else torch.full(
            (ids.shape[0],), ids.shape[1], dtype=torch.long, device=self.device)
        self.drafts.write_device(slot_index, proposal)
        if ids.shape[1] != width:       # the result declares [S, max_drafts_next]
            padded = torch.zeros(ids.shape[0], width, dtype=torch.long, device=self.device)
            padded[:, :ids.shape[1]] = ids[:, :width]
            ids = padded
        return {"next_num_drafts": counts, "next_draft_ids": ids}

    # -- after the host read --------------------------------------------------------------------------
    def after_read(self, b: StepBatch, prep: PreparedStep, result: StepResult, seqs: WorkerSeqTable) -> None:
        """Drafts for the next step, into the draft buffer; the engine learns how many (and, for grammar
        sequences, which)."""
        if self.proposer is None:
            return
        if self.on_device:
            if result.next_num_drafts is None:
                # Told not to draft this step (too many sequences running): drafts held from an earlier
                # step must not be verified after this one's tokens.
                result.next_num_drafts = np.zeros(len(prep.slots), dtype=np.int64)
                result.next_draft_ids = np.zeros((len(prep.slots), 0), dtype=np.int64)
            self.drafts.note_device_counts(prep.slots, result.next_num_drafts, result.next_draft_ids,
                                           stochastic=self._stochastic)
        else:
            proposal = self.proposer.propose(self._input(b, seqs, None, {}, None, None, None, None), self.k)
            result.next_num_drafts = self.drafts.write(prep.slots, proposal)
        if b.spec.return_drafts.any():
            result.next_draft_ids = [self.drafts.host_drafts(int(slot)) if b.spec.return_drafts[s] else []
                                     for s, slot in enumerate(prep.slots)]
        else:
            result.next_draft_ids = None

    def _input(self, b: StepBatch, seqs: WorkerSeqTable | None, hidden: torch.Tensor | None,
               captured: dict[int, torch.Tensor], rows: torch.Tensor | None, tokens: torch.Tensor | None,
               accepted: torch.Tensor | None, site: DraftSite | None) -> ProposerInput:
        """`seqs` given: a host proposer's call, after the histories were updated; a device proposer's
        call happens inside the step, where histories are not collected (it works from tensors)."""
        sq, idx = b.seqs, b.spec.batch_index
        ids = [int(sq.seq_ids[i]) for i in idx]
        return ProposerInput(
            seq_ids=ids, prompt_lens=[int(sq.prompt_lens[i]) for i in idx],
            histories=[seqs.tokens_of(sid) for sid in ids] if seqs is not None else [],
            hidden=captured, final_hidden=hidden, rows=rows, tokens=tokens, accepted=accepted,
            **(site.as_kwargs() if site is not None else {}))
