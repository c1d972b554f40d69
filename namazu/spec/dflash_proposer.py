"""The DFlash2 drafter as a device proposer (`--speculative-model PATH --num-speculative-tokens N`).

Per sequence state lives in the paged cache, not in a table keyed by sequence: the drafter's context
keys/values of position t go to the same cache slot the target's KV of position t uses (the step's
slot mapping), in a tensor of the drafter's own. So whatever the engine does to the target's cache the
drafter's follows: chunked prefill, prefix caching (a cached block holds both), preemption by recompute
(the recompute rewrites both), n > 1 (shared prompt blocks), and rejected drafts (their entries sit at
positions at or beyond the next anchor, never visible, and are overwritten when those positions are
computed again). `extend_context` writes the entries of every forward, sampling or not; `propose` drafts
a block per sampling sequence from the context strictly before its anchor (the bonus token). The block's
own entries are never written: the cache holds context only.
"""
from __future__ import annotations

import time

import torch

from namazu.kernels import small_gemm
from namazu.layers.cpu_layout import k_major, use_k_major_linears, wants_k_major
from namazu.layers.sampler import hash_uniform
from namazu.spec.dflash import DFlashDrafter, draft_counts
from namazu.spec.dflash_config import check_drafter_checkpoint
from namazu.spec.proposer import Proposal, ProposerInput
from namazu.spec.tree import DraftTree, TreeTensors, draft_tree

# Noise stream of the drafter's own draws (the sampler uses 0-2): a seeded request drafts reproducibly.
STREAM_DRAFT = 3


class DFlashProposer:
    on_device = True
    # It reads the target's whole embedding and lm_head: under tensor parallelism the worker gathers them at
    # start-up (`DeepseekV3ForCausalLM.gather_whole_vocab`).
    whole_vocab = True

    def __init__(self, path: str, target_vocab_size: int, target_hidden_size: int, target_num_layers: int,
                 sample_drafts: bool = True, min_confidence: float = 0.0):
        # Checked here, in the engine process, so a wrong checkpoint fails before any worker starts.
        self.cfg = check_drafter_checkpoint(path, target_vocab_size, target_hidden_size, target_num_layers)
        self.path = str(path)
        self.target_shape = (target_vocab_size, target_hidden_size, target_num_layers)
        self.hidden_layers = tuple(self.cfg.target_layers)
        self.model: DFlashDrafter | None = None
        self.cache: torch.Tensor | None = None
        self.draft_seconds = 0.0      # wall time in extend_context + propose (host clock; exact on CPU)
        self.draft_calls = 0
        # At T > 0: draw drafts from the selector's q and verify with the full rule (True), or draft
        # greedily and verify as deterministic drafts (False). Both are lossless.
        self.sample_drafts = sample_drafts
        # A block ends before the first draft at which the running product of the walk's confidences
        # falls below this (`dflash.draft_counts`); 0: every block is k drafts long.
        # `--speculative-min-confidence` sets it (`selection.choose_speculation`).
        self.min_confidence = min_confidence
        # The noise stream of its draws: a shadow drafter (`spec/shadow.py`) draws from one of its own.
        self.draft_stream = STREAM_DRAFT

    # -- set-up in the worker -------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        c = self.cfg
        return c.num_layers * 2 * block_size * c.num_heads * c.head_dim * torch.empty(0, dtype=dtype).element_size()

    def attach(self, target: torch.nn.Module, num_blocks: int, block_size: int,
               reuse_cache: torch.Tensor | None = None) -> None:
        """Loads the drafter next to the target (same device and dtype), borrows its frozen embedding and
        lm_head (the whole vocabulary's: under tensor parallelism the copies every rank gathered at start-up,
        `whole_vocab`, so that every rank drafts alone, with no collective), and allocates the context cache
        with the target's block layout. `reuse_cache`: the cache of the drafter this one replaces
        (`spec/drafter_swap.py`), taken over when its shape fits, so a swap needs no second cache; its
        entries are stale and never read (every sequence is recomputed)."""
        w, lm_head = target.whole_vocab()
        self.model = DFlashDrafter.load(self.path, *self.target_shape, device=w.device, dtype=w.dtype)
        self.embed = w
        # The rows of the target's lm_head the drafter scores (its draft vocabulary), gathered once.
        self.head = self.model.draft_head(lm_head)
        if wants_k_major(self.head):
            use_k_major_linears(self.model)
            self.head = k_major(self.head)
        self.head_packed = small_gemm.pack(self.head)   # bf16 on CPU: the few-row product's layout
        self.model.fuse_for_serving()
        c = self.cfg
        self.block_size = block_size
        # One block past the engine's, as the target's cache has: graph-mode padding rows write there.
        shape = (c.num_layers, 2, (num_blocks + 1) * block_size, c.num_heads, c.head_dim)
        if reuse_cache is not None and tuple(reuse_cache.shape) == shape and reuse_cache.dtype == w.dtype:
            self.cache = reuse_cache
        else:
            self.cache = torch.zeros(shape, dtype=w.dtype, device=w.device)

    # -- the step -------------------------------------------------------------------------------------
    def extend_context(self, inp: ProposerInput) -> None:
        """Writes the context entries of every position this forward computed."""
        t0 = time.perf_counter()
        self.write_context(inp.hidden, inp.positions, inp.slot_mapping)
        self.draft_seconds += time.perf_counter() - t0

    def write_context(self, hidden: dict[int, torch.Tensor], positions: torch.Tensor, slot_mapping: torch.Tensor
                      ) -> None:
        """The context keys and values of positions [N] at their cache slots [N], from the target's hidden
        states of this forward. The write indexes the cache tensor itself (layer, key or value, slot): in a
        compiled graph a write through a view of it would be turned into a copy of the whole cache."""
        k, v = self.model.context_kv_all(self.model.fuse(hidden), positions)   # [layers, N, heads, D]
        layers = torch.arange(k.shape[0], device=k.device).unsqueeze(-1)
        slots = slot_mapping.unsqueeze(0)
        self.cache.index_put_((layers, torch.zeros_like(layers), slots), k.to(self.cache.dtype))
        self.cache.index_put_((layers, torch.ones_like(layers), slots), v.to(self.cache.dtype))

    def draft_block(self, inp: ProposerInput, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchor [S], anchor position [S], hidden [S, k, H], logits [S, k, N] over the draft vocabulary)
        of each sampling sequence's block, its context read from the paged cache."""
        acc = inp.accepted.unsqueeze(-1)
        anchor = inp.tokens.gather(1, acc).squeeze(-1)                      # the bonus token
        anchor_pos = inp.positions[inp.rows.gather(1, acc).squeeze(-1)] + 1
        tables = inp.block_tables[inp.batch_index]                           # [S, max_blocks]
        bs = self.block_size
        slots = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=tables.device)).flatten(1)   # [S, L]
        # Slot j of the table holds position j; only positions before the anchor are context (later ones
        # are rejected drafts or table padding).
        visible = torch.arange(slots.shape[1], device=slots.device) < anchor_pos.unsqueeze(-1)
        ctx = []
        for li in range(self.cfg.num_layers):
            kv = self.cache[li][:, slots].transpose(2, 3)                   # keys and values in one gather
            ctx.append((kv[0], kv[1]))
        h = self.model.forward_blocks(anchor, anchor_pos, ctx, visible, self.embed)[:, :k]
        return anchor, anchor_pos, h, small_gemm.packed_linear(h, self.head, self.head_packed)

    def propose(self, inp: ProposerInput, k: int) -> Proposal:
        t0 = time.perf_counter()
        proposal = self.draft(inp, k)
        self.draft_seconds += time.perf_counter() - t0
        self.draft_calls += 1
        return proposal

    def draft(self, inp: ProposerInput, k: int) -> Proposal:
        """The next block of every sampling sequence (device tensors, static shapes, no host read): what
        `propose` returns, without its host clock, so that a compiled drafted step can trace it."""
        k = min(k, self.cfg.num_draft_tokens)
        anchor, _, h, logits = self.draft_block(inp, k)
        if inp.all_greedy or not self.sample_drafts:
            walk = self.model.walk(anchor, h, logits, k)
        else:
            # Draft j of a sequence takes the output index after its bonus token, plus j.
            base = inp.counters.gather(1, inp.accepted.unsqueeze(-1)).squeeze(-1) + 1
            u = hash_uniform(inp.seeds, base, k, self.draft_stream)
            walk = self.model.walk(anchor, h, logits, k, inp.temperature, u)
        # Where the block ends depends on the drafter's own values only, never on the target's: the
        # verify stays lossless whatever the threshold.
        counts = draft_counts(walk.confidence, self.min_confidence) if self.min_confidence > 0 else None
        return Proposal(walk.ids, counts=counts, probs=walk.q, support=walk.support)

    def propose_tree(self, inp: ProposerInput, tt: TreeTensors) -> DraftTree:
        """Each sampling sequence's draft tree in topology `tt` (`spec/tree.py`), rooted at its bonus token:
        the same block forward as `propose`, then the selector's tables instead of one walk. Greedy rows
        (or `sample_drafts=False`) take the top-W children, sampling rows draw them from q without
        replacement, seeded from the output index of the first draft (the verify's `counters`)."""
        t0 = time.perf_counter()
        depth = tt.topology.depth
        if depth > self.cfg.num_draft_tokens:
            raise ValueError(f"a draft tree of depth {depth}: the drafter drafts {self.cfg.num_draft_tokens} positions")
        anchor, _, h, logits = self.draft_block(inp, depth)
        tables = self.model.selector_tables(anchor, h, logits, depth, tt.topology.candidates)
        base = inp.counters.gather(1, inp.accepted.unsqueeze(-1)).squeeze(-1) + 1 if inp.counters is not None \
            else torch.zeros_like(anchor)
        sample = not inp.all_greedy and self.sample_drafts
        seeds = inp.seeds if inp.seeds is not None else torch.zeros_like(anchor)
        tree = draft_tree(tt, *tables, anchor, inp.temperature if sample else None, seeds, base,
                          self.cfg.q_temperature_scale, greedy_candidates=self.cfg.selector_k)
        self.draft_seconds += time.perf_counter() - t0
        return tree


def make_dflash_proposer(path: str, target_config) -> DFlashProposer:
    """The proposer for `--speculative-model PATH`, checked against the target's ModelConfig."""
    return DFlashProposer(path, target_config.vocab_size, target_config.hidden_size,
                          target_config.num_hidden_layers)
