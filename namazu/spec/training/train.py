"""Train a DFlash2 drafter for a target on token ids the target produced (captured traffic).

    python -m namazu.spec.training.train --target PATH --data DIR_OR_FILES --out DIR [--heldout DIR_OR_FILES]

Data: capture shards (`namazu.spec.capture`): each record's prompt + output ids, the loss on the output
positions. `--text-mode retokenize` trains on the same outputs decoded to text and tokenized again (the
comparison the issue asks for); `--text-mode corpus` on corpus text instead (a generic drafter).

Per sequence: the frozen target's hidden states of the drafter's `target_layers` (computed online, in
fp32 as served; `--hidden-cache DIR` keeps them on disk for later epochs), many random anchors, all of
them trained in one pass: each block sees the context strictly before its anchor and itself
bidirectionally; block position k predicts token anchor + k with cross-entropy weighted exp(-(k-1)/gamma),
plus the selector's K-way cross-entropy (gold inserted if missing; with --selector-soft-weight
partly against the target's distribution over the candidates) weighted by alpha. AdamW, warm-up,
cosine decay, grad clip 1.0, bf16 autocast on CPU. Stops at --steps or --time-budget minutes. At the end:
held-out acceptance length (greedy drafts against the captured outputs, as the engine's verify step at
T=0 would count them), written to train_log.json beside the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from namazu.spec.capture import read_records
from namazu.spec.dflash import DFlashDrafter, num_parameters
from namazu.spec.dflash_config import DFlashConfig
from namazu.spec.draft_vocab import extend_vocab, frequent_tokens

log = logging.getLogger(__name__)


@dataclass
class Example:
    ids: list[int]
    loss_from: int          # first position whose token is trained on (the output's start)
    greedy: bool = False    # captured at T=0: the outputs are the target's greedy continuation


# -- data -------------------------------------------------------------------------------------------------
def load_examples(sources: list[str], max_len: int, text_mode: str = "raw", tokenizer=None,
                  stats: dict | None = None) -> list[Example]:
    """Captured requests as training sequences (one per choice). text_mode 'retokenize': each output is
    decoded and tokenized again (stats counts how many changed)."""
    out: list[Example] = []
    changed = total = 0
    for rec in read_records(sources):
        greedy = (rec.sampling.get("temperature") or 0.0) == 0.0
        for ids in rec.output_token_ids:
            if len(ids) < 2:
                continue
            if text_mode == "retokenize":
                again = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False)
                changed += again != ids
                total += 1
                ids = again
            seq = (rec.prompt_token_ids + ids)[-max_len:]
            out.append(Example(seq, max(1, len(seq) - len(ids)), greedy))
    if stats is not None and total:
        stats["retokenized_changed_share"] = changed / total
    return out


def corpus_examples(tokenizer, n: int, max_len: int, seed: int = 0) -> list[Example]:
    """Generic data: corpus text (train split, both languages) in windows of max_len tokens."""
    from namazu.tiny.corpus import default_corpus_dir, read_text

    rng = random.Random(seed)
    out: list[Example] = []
    for lang, share in (("ja", 0.7), ("en", 0.3)):
        text = read_text(default_corpus_dir(), lang, "train")
        want = int(n * share)
        for _ in range(want):
            start = rng.randrange(max(1, len(text) - 4 * max_len))
            ids = tokenizer.encode(text[start:start + 3 * max_len], add_special_tokens=False)[:max_len]
            if len(ids) > 16:
                out.append(Example(ids, 8))
    return out


# -- the loss --------------------------------------------------------------------------------------------
class HostArena:
    """Copies of tensors that live as long as the process, packed end to end into large slabs.

    `--hidden-cache memory` keeps a few tensors of ~0.1-0.3 MB per training sequence for the whole run.
    Allocated one by one, glibc places them between the step's large short-lived tensors (once those are
    freed its mmap threshold rises to their size), and the holes they pin are neither reused nor returned:
    a corpus-text trainer grew by 6.5 MB of RSS per cached sequence, whose tensors hold 0.74 MB, and was
    OOM-killed at 17 GB. A slab is one allocation larger than glibc's largest mmap threshold (32 MB), so it
    is mapped on its own, and the heap keeps only short-lived tensors."""

    ALIGN = 64

    def __init__(self, slab_bytes: int = 64 << 20):
        self.slab_bytes = slab_bytes
        self.slab = torch.empty(0, dtype=torch.uint8)
        self.used = 0

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t inside a slab."""
        n = t.numel() * t.element_size()
        if self.used + n > self.slab.numel():
            self.slab = torch.empty(max(self.slab_bytes, n), dtype=torch.uint8)
            self.used = 0
        out = self.slab[self.used:self.used + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used += -(-n // self.ALIGN) * self.ALIGN
        return out


class Target:
    """The frozen target: hidden states of the drafter's layers, its next-token distributions, its embedding
    and lm_head."""

    def __init__(self, path: str, layers: list[int], cache_dir: str | None = None, soft_top: int = 0):
        from namazu.models.loader import load_model

        self.model = load_model(path, dtype="float32", progress=False).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers = layers
        self.embed = self.model.model.embed_tokens.weight
        self.lm_head = self.model.lm_head.weight
        self.soft_top = soft_top
        # "memory": computed once per sequence and kept for later epochs (fp32, as served); a directory:
        # the same on disk.
        self.memory: dict[str, TargetOutputs] | None = {} if cache_dir == "memory" else None
        self.arena = HostArena() if self.memory is not None else None
        self.cache_dir = Path(cache_dir) if cache_dir and cache_dir != "memory" else None
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def outputs(self, ids: list[int], key: str | None = None) -> TargetOutputs:
        if self.memory is not None and key in self.memory:
            return self.memory[key]
        path = self.cache_dir / f"{key}.pt" if self.cache_dir and key else None
        if path is not None and path.exists():
            return TargetOutputs(*torch.load(path))
        final, captured = self.model(torch.tensor([ids]), capture_layers=self.layers)
        out = TargetOutputs([captured[i][0] for i in self.layers])
        if self.soft_top:
            # The target's next-token distribution at every position, kept as its top entries (renormalised).
            probs = self.model.compute_logits(final[0]).softmax(-1)
            top_p, top_i = probs.topk(self.soft_top, dim=-1)
            out.soft_ids, out.soft_p = top_i, top_p / top_p.sum(-1, keepdim=True)
        if path is not None:
            torch.save((out.hidden, out.soft_ids, out.soft_p), path)
        if self.memory is not None and key is not None:
            keep = lambda t: None if t is None else self.arena.keep(t)  # noqa: E731
            out = TargetOutputs([keep(h) for h in out.hidden], keep(out.soft_ids), keep(out.soft_p))
            self.memory[key] = out
        return out

    def hidden(self, ids: list[int], key: str | None = None) -> list[torch.Tensor]:
        return self.outputs(ids, key).hidden


@dataclass
class TargetOutputs:
    hidden: list[torch.Tensor]                 # [T, H] per drafter target layer
    soft_ids: torch.Tensor | None = None       # [T, top]: the target's likeliest next tokens after position t
    soft_p: torch.Tensor | None = None         # [T, top]: their probabilities (renormalised)


def context_kv(drafter: DFlashDrafter, hs: list[torch.Tensor], pos: torch.Tensor | None = None
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every draft layer's injected keys/values ([1, heads, N, head_dim]) of N positions: one sequence's
    (pos None: 0 .. N-1), or several packed end to end (pos: each one's position in its sequence)."""
    feat = drafter.fuse(hs)
    pos = torch.arange(feat.shape[0]) if pos is None else pos
    return [tuple(x.unsqueeze(0) for x in layer.context_kv(feat, pos)) for layer in drafter.layers]


def draft_hidden(drafter: DFlashDrafter, embed: torch.Tensor, ids: torch.Tensor,
                 ctx: list[tuple[torch.Tensor, torch.Tensor]], anchors: torch.Tensor,
                 pos: torch.Tensor | None = None, seq: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's final hidden states [M, B-1, H] of the blocks anchored at indices `anchors` of `ids`,
    each seeing the context strictly before its anchor in its own sequence (pos/seq: position and sequence
    of each index when several sequences are packed; None: one sequence). The same forward the engine runs
    from its paged cache (tests/spec/test_dflash.py checks that they agree)."""
    n = ctx[0][0].shape[2]
    pos = torch.arange(n) if pos is None else pos
    visible = pos.unsqueeze(0) < pos[anchors].unsqueeze(1)
    if seq is not None:
        visible &= seq.unsqueeze(0) == seq[anchors].unsqueeze(1)
    return drafter.forward_blocks(ids[anchors], pos[anchors], ctx, visible, embed)


def batch_loss(drafter: DFlashDrafter, target: Target, examples: list[Example], outs: list[TargetOutputs],
               anchors: int, rng: np.random.Generator, soft_weight: float = 0.0,
               vocab: torch.Tensor | None = None, selector_soft_weight: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block loss, selector loss, number of trained positions) of random anchors of several sequences,
    packed end to end into one forward (each block sees its own sequence's context only). With
    soft_weight > 0 the block loss mixes the captured token's cross-entropy with the cross-entropy against
    the target's own next-token distribution at that position (its top entries): at T > 0 drafts are
    accepted with probability sum min(p, q), so the drafter's whole distribution matters, not only its top.
    vocab (sorted token ids): the draft vocabulary it will serve with; the softmax runs over those rows of
    the lm_head only (the distribution the serving walk draws from), and a position whose token lies
    outside it is not trained (it can never be drafted). selector_soft_weight > 0 does the same for the
    selector: its softmax over the K candidates is also trained against the target's distribution restricted
    to them (renormalised), because at T > 0 that softmax, tempered, is the q the lossless rule sees, and
    sum min(p_T, q) is largest when q has p_T's shape over the candidates, not only its argmax. A captured
    token sampled at T > 0 is one noisy draw of that shape; the target's own distribution is all of it."""
    cfg = drafter.cfg
    b = cfg.block_size
    k = torch.arange(1, b)
    ids, pos, seq, hid, anc, at, valid = [], [], [], [], [], [], []
    soft_ids, soft_p = [], []
    off = 0
    for i, (ex, out) in enumerate(zip(examples, outs)):
        t = len(ex.ids)
        lo, hi = max(1, ex.loss_from - 1), t - 2       # an anchor needs at least one label after it
        if hi < lo:
            continue
        cand_pos = np.arange(lo, hi + 1)
        a = torch.from_numpy(np.sort(rng.choice(cand_pos, size=min(anchors, len(cand_pos)), replace=False)))
        local = a.unsqueeze(1) + k                                       # [m, B-1] positions of the labels
        valid.append((local < t) & (local >= ex.loss_from))
        at.append(off + local.clamp(max=t - 1))
        anc.append(off + a)
        ids.append(torch.tensor(ex.ids))
        pos.append(torch.arange(t))
        seq.append(torch.full((t,), i))
        hid.append(out.hidden)
        if (soft_weight > 0 or selector_soft_weight > 0) and out.soft_p is not None:
            soft_ids.append(out.soft_ids)
            soft_p.append(out.soft_p)
        off += t
    if not anc:
        return torch.zeros(()), torch.zeros(()), 0
    ids, pos, seq = torch.cat(ids), torch.cat(pos), torch.cat(seq)
    anc, at, valid = torch.cat(anc), torch.cat(at), torch.cat(valid)
    hidden = [torch.cat([h[j] for h in hid]) for j in range(len(hid[0]))]
    h = draft_hidden(drafter, target.embed, ids, context_kv(drafter, hidden, pos), anc, pos, seq)   # [M, B-1, H]
    labels = ids[at]
    head = target.lm_head
    # Columns of the logits: token ids, or with a draft vocabulary indices into it (-1: outside).
    col_of = None
    if vocab is not None:
        head = head.index_select(0, vocab)
        col_of = torch.full((target.lm_head.shape[0],), -1, dtype=torch.long)
        col_of[vocab] = torch.arange(len(vocab))
        valid = valid & (col_of[labels] >= 0)
    lab = labels if col_of is None else col_of[labels].clamp_min(0)
    w = torch.exp(-(k - 1).float() / cfg.loss_gamma).expand_as(labels) * valid
    logits = (h @ head.T.to(h.dtype)).float()                            # [M, B-1, V or N]
    # Selector candidates: the drafter's top-K, the gold token put in the last slot if missing.
    cand = logits.detach().topk(cfg.selector_k, dim=-1).indices          # [M, B-1, K]
    has = cand == lab.unsqueeze(-1)
    cand[..., -1] = torch.where(has.any(-1), cand[..., -1], lab)
    gold = (cand == lab.unsqueeze(-1)).float().argmax(-1)
    # One log-softmax and one gather for every term (each gather's backward is a dense [M, B-1, V]).
    # The selector's softmax over its K candidates is shift-invariant, so log-probabilities serve as U.
    use_soft = bool(soft_ids)
    cols = [lab.unsqueeze(-1)]
    if use_soft:
        src = at - 1                                                     # token `at` follows position at-1
        sid, sp = torch.cat(soft_ids)[src], torch.cat(soft_p)[src]
        if col_of is not None:
            # The target's distribution restricted to the draft vocabulary, renormalised.
            sid = col_of[sid]
            sp = torch.where(sid >= 0, sp, 0.0)
            sp = sp / sp.sum(-1, keepdim=True).clamp_min(1e-9)
            sid = sid.clamp_min(0)
        cols.append(sid)
    cols.append(cand)
    g = logits.log_softmax(-1).gather(-1, torch.cat(cols, -1))
    ce = -g[..., 0]
    if use_soft and soft_weight > 0:
        ce = (1 - soft_weight) * ce - soft_weight * (sp * g[..., 1:1 + sid.shape[-1]]).sum(-1)
    block = (ce * w).sum() / w.sum().clamp_min(1e-6)
    prev = torch.cat([ids[anc].unsqueeze(1), labels[:, :-1]], dim=1)
    cand_ids = cand if vocab is None else vocab[cand]
    scores = drafter.selector.scores(prev, cand_ids, g[..., -cfg.selector_k:], h)
    log_q = scores.log_softmax(-1)                                       # one log-softmax for both terms
    sce = -log_q.gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    if use_soft and selector_soft_weight > 0:
        # p's mass on each candidate (0 where it is not among the kept top entries), renormalised over
        # the candidates; positions where no candidate is among them keep the captured token's term only.
        pc = ((cand.unsqueeze(-1) == sid.unsqueeze(-2)) * sp.unsqueeze(-2)).sum(-1)       # [M, B-1, K]
        mass = pc.sum(-1, keepdim=True)
        soft_sce = -(pc / mass.clamp_min(1e-9) * log_q).sum(-1)
        sce = torch.where(mass.squeeze(-1) > 0, (1 - selector_soft_weight) * sce + selector_soft_weight * soft_sce,
                          sce)
    sel = (sce * w).sum() / w.sum().clamp_min(1e-6)
    return block, sel, int(valid.sum())


def sequence_loss(drafter: DFlashDrafter, target: Target, ex: Example, hs: list[torch.Tensor] | TargetOutputs,
                  anchors: int, rng: np.random.Generator, soft_weight: float = 0.0,
                  vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """batch_loss of one sequence."""
    tout = hs if isinstance(hs, TargetOutputs) else TargetOutputs(hs)
    return batch_loss(drafter, target, [ex], [tout], anchors, rng, soft_weight, vocab)


@torch.no_grad()
def heldout_loss(drafter: DFlashDrafter, target: Target, examples: list[Example], anchors: int = 64,
                 vocab: torch.Tensor | None = None) -> dict:
    """Mean block loss (captured tokens, position-decayed, as trained: over the draft vocabulary `vocab`
    when given) and the drafter's top-1 accuracy per block position (given the true tokens before it,
    among the draft vocabulary) over held-out sequences: the curve that says whether more steps still
    help."""
    drafter.eval()
    rng = np.random.default_rng(0)
    losses, hits, counts = [], np.zeros(drafter.cfg.block_size - 1), np.zeros(drafter.cfg.block_size - 1)
    head = target.lm_head if vocab is None else target.lm_head.index_select(0, vocab)
    for i, ex in enumerate(examples):
        tout = target.outputs(ex.ids, key=f"heldout-{i}")
        block, _, n = sequence_loss(drafter, target, ex, tout, anchors, rng, vocab=vocab)
        if not n:
            continue
        losses.append(float(block))
        ids = torch.tensor(ex.ids)
        t = len(ex.ids)
        a = torch.arange(max(1, ex.loss_from - 1), t - 1)
        h = draft_hidden(drafter, target.embed, ids, context_kv(drafter, tout.hidden), a)
        at = a.unsqueeze(1) + torch.arange(1, drafter.cfg.block_size)
        valid = (at < t) & (at >= ex.loss_from)
        top = (h @ head.T).argmax(-1)
        top1 = (top if vocab is None else vocab[top]) == ids[at.clamp(max=t - 1)]
        hits += (top1 & valid).sum(0).numpy()
        counts += valid.sum(0).numpy()
    drafter.train()
    return {"heldout_loss": float(np.mean(losses)) if losses else float("nan"),
            "heldout_top1": (hits / np.maximum(counts, 1)).round(4).tolist()}


# -- held-out acceptance ---------------------------------------------------------------------------------
@torch.no_grad()
def acceptance_length(drafter: DFlashDrafter, target: Target, examples: list[Example], k: int,
                      max_examples: int = 200) -> dict:
    """Decoding simulated over each held-out output: from the first output token on, draft k greedily from
    the context before the anchor, accept the prefix equal to the captured tokens, move by accepted + 1.
    Against greedy (T=0) captures this is exactly what the engine's verify step counts. Also the
    acceptance rate of each draft position given the ones before it were accepted."""
    drafter.eval()
    head = drafter.draft_head(target.lm_head)
    taus: dict[str, list[int]] = {"greedy": [], "sampled": []}
    tried = {kind: np.zeros(k) for kind in taus}
    took = {kind: np.zeros(k) for kind in taus}
    for ex in examples[:max_examples]:
        kind = "greedy" if ex.greedy else "sampled"
        ctx = context_kv(drafter, target.hidden(ex.ids))
        t = len(ex.ids)
        ids = torch.tensor(ex.ids)
        a = ex.loss_from
        while a < t - 1:
            kk = min(k, t - 1 - a, drafter.cfg.num_draft_tokens)
            h = draft_hidden(drafter, target.embed, ids, ctx, torch.tensor([a]))[:, :kk]
            drafts = drafter.walk(ids[a:a + 1], h, h @ head.T, kk).ids
            match = (drafts[0] == ids[a + 1:a + 1 + kk]).long()
            acc = int(torch.cumprod(match, 0).sum())
            taus[kind].append(acc + 1)
            tried[kind][:min(acc + 1, kk)] += 1
            took[kind][:acc] += 1
            a += acc + 1
    drafter.train()
    out = {}
    for kind, v in taus.items():
        if v:
            out[kind] = {"mean_acceptance_length": float(np.mean(v)), "verify_steps": len(v),
                         "histogram": np.bincount(v, minlength=k + 2)[1:].tolist(),
                         "position_acceptance": (took[kind] / np.maximum(tried[kind], 1)).round(4).tolist()}
    return out


# -- the run ---------------------------------------------------------------------------------------------
def blend_with_base(drafter: DFlashDrafter, base: dict[str, torch.Tensor], share: float) -> None:
    """Every weight moved back to `share` * base + (1 - share) * fine-tuned (`--blend-init`), in place; the
    draft vocabulary (a buffer of ids, possibly extended) stays the fine-tuned one. Why: a short fine-tune
    on a drifted mix fits its new content and erodes what the base drafted well (bench/RESULTS.md, round 2:
    greedy prose lost 13%, partly because the selector's confidence, which ends a block, fell); a point
    on the line between the two weights trades one against the other (the weight-space ensembles of
    robust fine-tuning, Wortsman et al. 2022)."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.lerp_(base[name].to(p.dtype), share)


def default_target_layers(num_layers: int, count: int = 3) -> list[int]:
    """Spread evenly from layer 1 to L-3 (REFERENCE.md); small targets (a few layers): 1 .. L-1, since
    there the last layer carries most of what predicts the next tokens."""
    lo, hi = (1, num_layers - 3) if num_layers >= 8 else (min(1, num_layers - 1), num_layers - 1)
    count = min(count, hi - lo + 1)
    return sorted({round(lo + i * (hi - lo) / max(1, count - 1)) for i in range(count)})


def non_embedding_parameters(target_model) -> int:
    skip = {id(target_model.model.embed_tokens.weight), id(target_model.lm_head.weight)}
    return sum(p.numel() for p in target_model.parameters() if id(p) not in skip)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    from namazu.assets import resolve_model_path
    from namazu.config import ModelConfig
    from namazu.tokenizer import Tokenizer

    target_path = str(resolve_model_path(args.target))
    tcfg = ModelConfig.from_pretrained(target_path)
    tok = Tokenizer.from_pretrained(target_path)
    layers = args.target_layers or default_target_layers(tcfg.num_hidden_layers)
    mask_id = tok.token_to_id(args.mask_token)
    if mask_id is None:
        raise SystemExit(f"the target's tokenizer has no {args.mask_token!r} token for the block input")
    cfg = DFlashConfig(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
                       target_num_layers=tcfg.num_hidden_layers, target_layers=layers, mask_token_id=mask_id,
                       block_size=args.block_size, num_layers=args.num_layers, num_heads=args.num_heads,
                       head_dim=args.head_dim, intermediate_size=args.intermediate_size,
                       selector_k=args.selector_k, selector_rank=args.selector_rank, trained_on=args.text_mode)
    if args.init:
        # Fine-tuning: the base drafter's shape, weights and draft vocabulary (unless --draft-vocab picks one).
        drafter = DFlashDrafter.load(args.init, tcfg.vocab_size, tcfg.hidden_size, tcfg.num_hidden_layers)
        cfg = drafter.cfg
        cfg.trained_on = args.text_mode
        layers = cfg.target_layers
        base_weights = {n: p.detach().clone() for n, p in drafter.named_parameters()} if args.blend_init else None
    else:
        if args.blend_init:
            raise SystemExit("--blend-init needs --init (the drafter to blend back towards)")
        drafter = DFlashDrafter(cfg)
    target = Target(target_path, layers, args.hidden_cache,
                    soft_top=args.soft_top if args.soft_weight > 0 or args.selector_soft_weight > 0 else 0)
    n_params, budget = num_parameters(drafter), non_embedding_parameters(target.model)
    log.info("drafter: %d parameters = %.1f%% of the target's %d non-embedding parameters", n_params,
             100 * n_params / budget, budget)

    stats: dict = {}
    if args.text_mode == "corpus":
        n_train = min(len(load_examples(args.data, args.max_len)), args.max_sequences or 1 << 62)
        examples = corpus_examples(tok, n_train, args.max_len, args.seed)
    else:
        examples = load_examples(args.data, args.max_len, args.text_mode, tok, stats)
    if args.shuffle_ids:
        for ex in examples:
            out = ex.ids[ex.loss_from:]
            random.Random(args.seed).shuffle(out)
            ex.ids[ex.loss_from:] = out
    if args.max_sequences:
        examples = examples[:args.max_sequences]
    if args.reload_data and not args.heldout:
        raise SystemExit("--reload-data needs --heldout (the held-out share of --data would leak into training)")
    heldout: list[Example] = []
    if not args.heldout:
        random.Random(args.seed).shuffle(examples)
        cut = max(1, len(examples) // 20)
        heldout, examples = examples[:cut], examples[cut:]
    if not examples:
        raise SystemExit(f"no training sequences in {args.data}")
    log.info("%d training sequences", len(examples))

    def draft_vocabulary() -> torch.Tensor | None:
        # The N commonest output tokens of the data so far (a capture that is still growing: again per epoch).
        base = drafter.draft_vocab.cpu() if args.init and drafter.draft_vocab is not None else None
        if args.draft_vocab_extend:
            # Fine-tuning on drifted traffic: the base's shortlist kept whole (its traffic loses nothing) and
            # the commonest new output tokens outside it added (fresh tool names and keys it cannot propose).
            return extend_vocab(base, (ex.ids[ex.loss_from:] for ex in examples), args.draft_vocab_extend)
        if not args.draft_vocab:
            return base
        ids = frequent_tokens((ex.ids[ex.loss_from:] for ex in examples), args.draft_vocab)
        if len(ids) < cfg.selector_k:
            raise SystemExit(f"the training outputs hold {len(ids)} distinct tokens, fewer than the selector's "
                             f"{cfg.selector_k} candidates: too little data for --draft-vocab")
        return ids
    vocab = draft_vocabulary()

    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    from tqdm import tqdm

    # The held-out loss curve: a fixed few held-out sequences (the 5% split, or the --heldout captures).
    curve_set = (heldout or load_examples(args.heldout, args.max_len))[:args.eval_sequences] if args.eval_every else []
    t0 = time.time()
    budget_s = args.time_budget * 60
    order = rng.permutation(len(examples))
    cursor, step, history = 0, 0, []
    bar = tqdm(total=args.steps, desc="drafter", unit="step")
    drafter.train()
    while step < args.steps and time.time() - t0 < budget_s:
        progress = max(step / args.steps, (time.time() - t0) / budget_s)
        lr = args.lr * min(1.0, progress / args.warmup) if progress < args.warmup else \
            args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        batch_ex, batch_out = [], []
        for _ in range(args.batch):
            if cursor == len(order):
                if args.reload_data and args.text_mode != "corpus":
                    # A capture still being written: records only ever append, so the indices (the
                    # target-output cache keys) of the sequences already seen stay the same.
                    examples = load_examples(args.data, args.max_len, args.text_mode, tok, stats)
                    examples = examples[:args.max_sequences] if args.max_sequences else examples
                    log.info("epoch: %d training sequences", len(examples))
                    vocab = draft_vocabulary()
                order, cursor = rng.permutation(len(examples)), 0
            i = int(order[cursor])
            cursor += 1
            batch_ex.append(examples[i])
            batch_out.append(target.outputs(examples[i].ids, key=f"{args.text_mode}-{i}"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            block, sel, n_tok = batch_loss(drafter, target, batch_ex, batch_out, args.anchors, rng, args.soft_weight,
                                           vocab, args.selector_soft_weight)
            loss = block + cfg.selector_alpha * sel
        if n_tok:
            loss.backward()
        tot_b, tot_s = float(block.detach()), float(sel.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        history.append({"step": step, "loss": tot_b, "selector_loss": tot_s, "lr": lr, "tokens": n_tok,
                        "elapsed_s": time.time() - t0})
        if args.eval_every and (step % args.eval_every == 0) and curve_set:
            history[-1].update(heldout_loss(drafter, target, curve_set, vocab=vocab))
            log.info("step %d: train loss %.3f, %s", step, tot_b, json.dumps(
                {k: v for k, v in history[-1].items() if k.startswith("heldout")}))
        bar.update(1)
        if args.snapshot_at and step == int(args.snapshot_at[0]):
            drafter.save(args.snapshot_at[1])     # for comparisons at an equal step count
        bar.set_postfix(loss=f"{tot_b:.3f}", sel=f"{tot_s:.3f}", lr=f"{lr:.1e}")
    bar.close()
    train_s = time.time() - t0
    if args.blend_init:
        blend_with_base(drafter, base_weights, args.blend_init)
    drafter.set_draft_vocab(vocab)
    drafter.save(args.out)
    if args.heldout:    # read only now: a held-out capture may still be in the making while training runs
        heldout = load_examples(args.heldout, args.max_len)
    acc = acceptance_length(drafter, target, heldout, args.eval_k)
    result = {"steps": step, "train_seconds": train_s, "blend_init": args.blend_init,
              "sequences": len(examples), "heldout": len(heldout),
              "parameters": n_params, "target_non_embedding_parameters": budget,
              "parameter_share": n_params / budget, "text_mode": args.text_mode, "eval_k": args.eval_k,
              "heldout_acceptance": acc, **stats, "history": [h for i, h in enumerate(history)
                                                   if "heldout_loss" in h or i % max(1, len(history) // 200) == 0]}
    (Path(args.out) / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "history"}
    log.info("done: %s", json.dumps(summary))
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--data", nargs="+", required=True, help="capture directories or shard files")
    ap.add_argument("--heldout", nargs="*", default=None, help="held-out captures (default: 5%% of --data)")
    ap.add_argument("--out", required=True, help="drafter checkpoint directory to write")
    ap.add_argument("--init", default=None, metavar="DIR",
                    help="fine-tune this drafter (its shape, weights and draft vocabulary) instead of training "
                         "a new one from scratch; the drafter-shape flags are then ignored")
    ap.add_argument("--blend-init", type=float, default=0.0, metavar="SHARE",
                    help="with --init: end at SHARE * init + (1 - SHARE) * fine-tuned weights (0: the fine-tuned "
                    "ones), keeping more of what the base drafted well")
    ap.add_argument("--shuffle-ids", action="store_true",
                    help="train on each output's ids in random order (a negative control: a drafter that "
                         "learned nothing about the sequences; the refresh gate must refuse it)")
    ap.add_argument("--text-mode", default="raw", choices=("raw", "retokenize", "corpus"),
                    help="raw captured ids; the outputs decoded and re-tokenized; or corpus text")
    ap.add_argument("--hidden-cache", default=None,
                    help="keep the target's outputs per sequence for later epochs: a directory, or 'memory'")
    ap.add_argument("--soft-weight", type=float, default=0.0,
                    help="share of the block loss taken against the target's own next-token distribution")
    ap.add_argument("--soft-top", type=int, default=32, help="entries kept of that distribution")
    ap.add_argument("--selector-soft-weight", type=float, default=0.0,
                    help="share of the selector's loss taken against the target's distribution over its candidates "
                    "(its --soft-top entries)")
    ap.add_argument("--reload-data", action="store_true",
                    help="read --data again at every epoch (a capture that is still growing)")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: never)")
    ap.add_argument("--eval-sequences", type=int, default=24, help="held-out sequences of that loss")
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--time-budget", type=float, default=20.0, help="minutes of training at most")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="random anchors per sequence")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-sequences", type=int, default=None,
                    help="train on the first N sequences only (comparisons on an equal data set)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.04, help="share of the run")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-k", type=int, default=4, help="draft tokens per step of the held-out evaluation")
    ap.add_argument("--mask-token", default="<|mask|>")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft only over the N most frequent output tokens of the training data, and train the "
                    "softmax over those N rows of the lm_head (0: the whole vocabulary)")
    ap.add_argument("--draft-vocab-extend", type=int, default=0, metavar="N",
                    help="with --init: keep the base drafter's draft vocabulary and add the N most frequent "
                    "output tokens of the training data outside it (0: keep it as it is)")
    ap.add_argument("--snapshot-at", nargs=2, default=None, metavar=("STEP", "DIR"),
                    help="also save the drafter as it is after STEP steps")
    g = ap.add_argument_group("drafter shape")
    g.add_argument("--target-layers", type=int, nargs="*", default=None)
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--num-layers", type=int, default=1)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--intermediate-size", type=int, default=512)
    g.add_argument("--selector-k", type=int, default=8)
    g.add_argument("--selector-rank", type=int, default=16)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
