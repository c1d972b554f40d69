"""The DFlash2 block drafter (REFERENCE.md section 3), shared by serving and training.

One forward drafts a whole block: the input is the target's frozen embedding of `[anchor, MASK x (B-1)]`
at positions `anchor_pos ..`, the context is the target's own hidden states of K layers at the positions
before the anchor, fused by `fc` + RMSNorm into one feature per position. In every draft layer the block's
queries attend, bidirectionally, over the block and over the context, whose keys/values are the layer's
own projections of the fused feature ("KV injection"; they depend on the feature alone, so serving keeps
them in a context-only cache). A final norm and the target's frozen lm_head give one distribution per
drafted position. DFlash2 adds a two-tap dynamic depthwise convolution on every sublayer's input (taps
never cross the block boundary) and a selector that re-ranks the top-K candidates of adjacent positions
with predecessor/successor codebooks.

Training (`namazu.spec.training.train`) calls `forward_blocks` with the context of a whole sequence and many
anchors; serving (`namazu.spec.dflash_proposer`) calls it with the context gathered from the paged cache.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from namazu.kernels import small_gemm
from namazu.layers.cpu_layout import k_major, wants_k_major
from namazu.layers.norm import RMSNorm
from namazu.spec.dflash_config import WEIGHTS_FILE, DFlashConfig, DrafterCheckpointError, check_drafter_checkpoint


@functools.lru_cache(maxsize=16)
def _inv_freq(d: int, theta: float, device: torch.device) -> torch.Tensor:
    return theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split) of x [..., T, D] at positions [..., T]."""
    d = x.shape[-1]
    ang = positions.float().unsqueeze(-1) * _inv_freq(d, theta, x.device)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TwoTapConv(nn.Module):
    """out[i, c] = sum_{t in 0,1} (base[t, c] + delta[i, t, g(c)]) * x[i - t, c] inside a block; the tap on
    x[i-1] is zero at the block's first position. Starts as the identity (base = [1, 0], delta = 0)."""

    def __init__(self, hidden: int, groups: int):
        super().__init__()
        self.groups = groups
        self.base = nn.Parameter(torch.stack([torch.ones(hidden), torch.zeros(hidden)]))
        self.delta = nn.Linear(hidden, 2 * groups, bias=False)
        nn.init.zeros_(self.delta.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, B, H] (one block per row)."""
        m, b, h = x.shape
        g = self.groups
        # Channel c belongs to group c // (H / groups): broadcast each group's delta over its channels
        # instead of materialising it per channel.
        d = small_gemm.linear(x, self.delta.weight).view(m, b, 2, g, 1)
        w = self.base.to(x.dtype).view(2, g, h // g) + d                  # [M, B, 2, groups, H / groups]
        prev = F.pad(x, (0, 0, 1, 0))[:, :b]          # x[i-1], zero before the block's first position
        return (w[:, :, 0] * x.view(m, b, g, -1) + w[:, :, 1] * prev.reshape(m, b, g, -1)).view(m, b, h)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, qd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.conv_attn = TwoTapConv(h, cfg.conv_groups)
        self.conv_mlp = TwoTapConv(h, cfg.conv_groups)
        self.q_proj = nn.Linear(h, qd, bias=False)
        self.k_proj = nn.Linear(h, qd, bias=False)
        self.v_proj = nn.Linear(h, qd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        # Serving: q/k/v and gate/up each as one product (`DFlashDrafter.fuse_for_serving`); None: the
        # separate modules (training, whose gradients flow through them).
        self.qkv_weight: torch.Tensor | None = None
        self.gate_up_weight: torch.Tensor | None = None

    def context_kv(self, feat: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The injected keys/values of context features feat [..., T, H] at positions [..., T]:
        [..., heads, T, head_dim] each (keys rotated)."""
        c = self.cfg
        k = self.k_proj(feat).unflatten(-1, (c.num_heads, c.head_dim)).transpose(-3, -2)
        v = self.v_proj(feat).unflatten(-1, (c.num_heads, c.head_dim)).transpose(-3, -2)
        return rope(k, positions.unsqueeze(-2), c.rope_theta), v

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                ctx_visible: torch.Tensor) -> torch.Tensor:
        """x [M, B, H] block states at positions pos [M, B]; ctx_k/ctx_v [M or 1, heads, L, head_dim];
        ctx_visible [M, L] which context entries each block sees (strictly before its anchor)."""
        c = self.cfg
        m, b, _ = x.shape
        hn = self.conv_attn(self.attn_norm(x))
        if self.qkv_weight is not None:
            # One product for q, k and v, and one rotation for q and k: the values below, up to summation order.
            qkv = small_gemm.linear(hn, self.qkv_weight).view(m, b, 3, c.num_heads, c.head_dim).permute(0, 2, 3, 1, 4)
            qk = rope(qkv[:, :2], pos[:, None, None], c.rope_theta)                    # [M, 2, heads, B, D]
            q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        else:
            q = rope(self.q_proj(hn).view(m, b, c.num_heads, c.head_dim).transpose(1, 2), pos.unsqueeze(1),
                     c.rope_theta)
            k = rope(self.k_proj(hn).view(m, b, c.num_heads, c.head_dim).transpose(1, 2), pos.unsqueeze(1),
                     c.rope_theta)
            v = self.v_proj(hn).view(m, b, c.num_heads, c.head_dim).transpose(1, 2)
        if ctx_k.shape[0] == 1 and m > 1:
            att = _shared_context_attention(q, k, v, ctx_k[0].to(q.dtype), ctx_v[0].to(q.dtype), ctx_visible)
        else:
            keys = torch.cat([ctx_k.expand(m, -1, -1, -1), k], dim=2)
            vals = torch.cat([ctx_v.expand(m, -1, -1, -1), v], dim=2)
            # Bidirectional inside the block: every block query sees all B block keys.
            visible = torch.cat([ctx_visible, ctx_visible.new_ones(m, b)], dim=1)[:, None, None, :]
            att = F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=visible)
        x = x + small_gemm.linear(att.transpose(1, 2).reshape(m, b, -1), self.o_proj.weight)
        hn = self.conv_mlp(self.mlp_norm(x))
        if self.gate_up_weight is not None:
            gate, up = small_gemm.linear(hn, self.gate_up_weight).chunk(2, dim=-1)
            return x + small_gemm.linear(F.silu(gate) * up, self.down_proj.weight)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))


def _shared_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor,
                              ctx_v: torch.Tensor, ctx_visible: torch.Tensor) -> torch.Tensor:
    """The attention of M blocks (q/k/v [M, heads, B, D]) over one context shared by all of them (ctx_k/ctx_v
    [heads, L, D], ctx_visible [M, L]) and bidirectionally over their own block: one softmax over
    [context ; block], the same as the concatenated form, but the context keys/values are multiplied as
    they are rather than copied once per block (training packs hundreds of blocks over one context, where
    the copies and their gradient sums were most of a step)."""
    m, heads, b, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qf = q.transpose(0, 1).reshape(heads, m * b, d)
    s_ctx = (qf @ ctx_k.transpose(-1, -2)).view(heads, m, b, -1).transpose(0, 1) * scale      # [M, h, B, L]
    s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, None, :], float("-inf"))
    s_blk = (q @ k.transpose(-1, -2)) * scale                                                 # [M, h, B, B]
    p = torch.cat([s_ctx, s_blk], dim=-1).float().softmax(-1).to(q.dtype)
    n = ctx_k.shape[1]
    p_ctx = p[..., :n].transpose(0, 1).reshape(heads, m * b, n)
    return (p_ctx @ ctx_v).view(heads, m, b, d).transpose(0, 1) + p[..., n:] @ v


class Walk(NamedTuple):
    """The selector walk's drafts: ids [M, k], q [M, k, V] when sampling (else None), confidence [M, k],
    and where q can be non-zero: the candidates [M, k, K] (None with q)."""

    ids: torch.Tensor
    q: torch.Tensor | None
    confidence: torch.Tensor
    support: torch.Tensor | None = None


def draft_counts(confidence: torch.Tensor, min_confidence: float) -> torch.Tensor:
    """Drafts worth verifying per row of confidence [M, k]: the longest prefix whose running product of
    confidences stays at or above `min_confidence` (the product tracks the chance that the whole prefix
    is accepted: `bench/draft_confidence.py`), and at least one, so a drafted sequence always verifies
    something (the drafter has already run; a block of none would make the step a plain decode that
    paid for a draft). 0 keeps all k. Device only: the counts reach the host with the step's one read."""
    m, k = confidence.shape
    if min_confidence <= 0 or k == 0:
        return torch.full((m,), k, dtype=torch.long, device=confidence.device)
    # The running product only falls, so the kept drafts are exactly those whose product clears the bar.
    keep = (confidence.cumprod(-1) >= min_confidence).sum(-1)
    return keep.clamp_min(1)


class Selector(nn.Module):
    """DFlash2's candidate selector: S(a, b) = U(b) + <pred[a] * (proj h), succ[b]> for a candidate b of a
    position whose predecessor token is a, U(b) the drafter's logit of b and h its hidden state there."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.pred = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.succ = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.proj = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def scores(self, prev: torch.Tensor, cand: torch.Tensor, cand_logits: torch.Tensor, h: torch.Tensor
               ) -> torch.Tensor:
        """prev [...], cand [..., K], cand_logits [..., K], h [..., H] -> scores [..., K]."""
        a = self.pred[prev] * small_gemm.linear(h, self.proj.weight).to(self.pred.dtype)   # [..., r]
        return cand_logits.float() + (self.succ[cand] * a.unsqueeze(-2)).sum(-1).float()


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * h, h, bias=False)
        self.fc_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.selector = Selector(cfg)
        # The draft vocabulary's token ids (sorted), or None: the whole vocabulary.
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size) if cfg.draft_vocab_size else None)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))

        # Serving: every layer's context key and value projections as one product (`fuse_for_serving`).
        self.context_kv_weight: torch.Tensor | None = None

    def fuse_for_serving(self) -> None:
        """Concatenates, for inference only, the weights applied to the same input: each layer's q/k/v and
        gate/up, and all layers' context keys and values. Fewer, larger products of the same dot products;
        a product of another shape is blocked differently by BLAS, so the values equal the separate
        modules' up to summation order (tests/spec/test_dflash_fused.py), and drafts only decide what is
        verified; on CPU the concatenations take the K-major layout the modules' weights have. Call it
        after the weights are final: training updates the separate modules, never these copies."""
        def fused(ws: list[torch.Tensor]) -> torch.Tensor:
            w = torch.cat([x.detach() for x in ws])
            return k_major(w) if wants_k_major(w) else w

        for layer in self.layers:
            layer.qkv_weight = fused([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
            layer.gate_up_weight = fused([layer.gate_proj.weight, layer.up_proj.weight])
        self.context_kv_weight = fused([w for layer in self.layers for w in (layer.k_proj.weight, layer.v_proj.weight)])

    def context_kv_all(self, feat: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's injected keys and values of context features feat [T, H] at positions [T]:
        [layers, T, heads, head_dim] each (keys rotated), the values of each layer's `context_kv`, in
        one product and one rotation (after `fuse_for_serving`)."""
        c = self.cfg
        kv = small_gemm.linear(feat, self.context_kv_weight).view(-1, c.num_layers, 2, c.num_heads, c.head_dim)
        k = rope(kv[:, :, 0].permute(1, 2, 0, 3), positions, c.rope_theta)            # [layers, heads, T, D]
        return k.transpose(1, 2), kv[:, :, 1].transpose(0, 1)

    # -- pieces ---------------------------------------------------------------------------------------
    def fuse(self, hidden: dict[int, torch.Tensor] | list[torch.Tensor]) -> torch.Tensor:
        """The context feature of each position from the target's hidden states of `target_layers`."""
        hs = [hidden[i] for i in self.cfg.target_layers] if isinstance(hidden, dict) else hidden
        x = torch.cat(hs, dim=-1).to(self.fc.weight.dtype)
        return self.fc_norm(small_gemm.linear(x, self.fc.weight))

    def block_inputs(self, anchor: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """anchor [M] -> embedded [anchor, MASK x (B-1)] [M, B, H] through the target's embedding."""
        b = self.cfg.block_size
        ids = torch.full((anchor.shape[0], b), self.cfg.mask_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        return F.embedding(ids, embed).to(self.fc.weight.dtype)

    def forward_blocks(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: list[tuple[torch.Tensor,
                       torch.Tensor]], ctx_visible: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [M, B-1, H] of the drafted positions anchor_pos + 1 .. + B-1."""
        b = self.cfg.block_size
        x = self.block_inputs(anchor, embed)
        pos = anchor_pos.unsqueeze(1) + torch.arange(b, device=anchor.device)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, pos, k, v, ctx_visible)
        return self.norm(x[:, 1:])

    # -- drafting -------------------------------------------------------------------------------------
    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Drafts only over the token ids `ids` from now on (None: the whole vocabulary)."""
        if ids is None:
            self.draft_vocab, self.cfg.draft_vocab_size = None, 0
            return
        ids = check_draft_vocab(torch.as_tensor(ids, dtype=torch.long).flatten(), self.cfg, "draft_vocab")
        self.cfg.draft_vocab_size = len(ids)
        self.draft_vocab = ids.to(self.fc.weight.device)

    def draft_head(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The rows of the target's lm_head the drafter scores: the draft vocabulary's, or all of them.
        The caller keeps the result (a gather of N rows) rather than recomputing it per step."""
        return lm_head if self.draft_vocab is None else lm_head.index_select(0, self.draft_vocab)

    def selector_tables(self, anchor: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, k: int,
                        candidates: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selector's scores of every (previous pick, candidate) pair of a block: (cand [M, k, K] the
        top-K candidates' token ids per position, first [M, K] position 0's scores after the anchor,
        pairs [M, k-1, K prev, K] position j's scores after each of position j-1's candidates). A walk
        (the chain) or a draft tree (`spec/tree.py`) only picks rows of these tables. `logits` [M, >=k, N]
        are over the draft vocabulary (`draft_head`). `candidates`: K (0: the selector's own `selector_k`; a
        draft tree may score more than the selector was trained on, `spec/tree.py`)."""
        logits = logits[:, :k].float()
        cand_logits, cand = logits.topk(candidates or self.cfg.selector_k, dim=-1)    # [M, k, K]
        if self.draft_vocab is not None:
            cand = self.draft_vocab[cand]                                     # shortlist index -> token id
        sel = self.selector
        a = small_gemm.linear(h[:, :k], sel.proj.weight).to(sel.pred.dtype)   # [M, k, r]
        first = cand_logits[:, 0] + ((sel.pred[anchor] * a[:, 0]).unsqueeze(-2) * sel.succ[cand[:, 0]]).sum(-1)
        pairs = cand_logits[:, 1:].unsqueeze(-2) + torch.einsum(
            "mjpr,mjcr->mjpc", sel.pred[cand[:, :-1]] * a[:, 1:].unsqueeze(-2), sel.succ[cand[:, 1:]]).float()
        return cand, first.float(), pairs

    def walk(self, anchor: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, k: int,
             temperature: torch.Tensor | None = None, uniforms: torch.Tensor | None = None) -> Walk:
        """The selector's walk over the top-K candidates of each position: greedy where temperature is 0
        (or None), inverse-CDF with `uniforms` [M, k] elsewhere. `logits` [M, >=k, N] are over the draft
        vocabulary (`draft_head`). Returns ids [M, k]; when sampling, q [M, k, V]: the distribution each
        draft was drawn from (zero outside the candidates); and each position's confidence [M, k], the
        signal `draft_counts` ends a block on: the largest probability of the selector's softmax over the
        candidates there (at 1 where the row is greedy: the pick's own probability; q's where it
        samples). Where a row samples it must not be the pick's own q: a block that kept a drawn draft
        only when the draw was likely would verify drafts no longer distributed as q, and the output
        would drift from the target's distribution. The largest probability depends on the picks before
        the position only, so the stopping rule stays lossless."""
        cand, first, pairs = self.selector_tables(anchor, h, logits, k)
        if temperature is None:
            return self._greedy_walk(cand, first, pairs)
        s, pick = first, anchor
        ids, qs, confs = [], [], []
        # Calibrated sampling temperature per position (config `q_temperature_scale`, fitted by
        # `namazu.spec.training.calibrate`): the drafter's scores are not the target's logits, so s / T alone is not
        # the q closest to the target's tempered distribution. Greedy rows never see it.
        scale = self.cfg.q_temperature_scale or [1.0] * k
        for j in range(k):
            if j:
                s = pairs[:, j - 1].gather(1, pick.view(-1, 1, 1).expand(-1, 1, pairs.shape[-1])).squeeze(1)
            p1 = s.softmax(-1)
            best = s.argmax(-1)
            t = temperature.float().clamp_min(1e-6).unsqueeze(-1) * scale[j]
            q = (s / t).softmax(-1)
            # Inverse CDF: the first candidate whose cumulative mass exceeds u. Dividing by the total
            # makes the last entry exactly 1 > u, so the pick always has q > 0.
            cdf = q.double().cumsum(-1)
            below = (cdf / cdf[:, -1:] <= uniforms[:, j:j + 1]).sum(-1)
            sampled = temperature > 0
            pick = torch.where(sampled, below, best)
            qs.append(torch.zeros(q.shape[0], self.cfg.vocab_size, device=q.device).scatter_(1, cand[:, j], q))
            conf = torch.where(sampled, q.max(-1).values, p1.max(-1).values)
            ids.append(cand[:, j].gather(1, pick.unsqueeze(-1)).squeeze(-1))
            confs.append(conf)
        return Walk(torch.stack(ids, 1), torch.stack(qs, 1), torch.stack(confs, 1), cand)

    @staticmethod
    def _greedy_walk(cand: torch.Tensor, first: torch.Tensor, pairs: torch.Tensor) -> Walk:
        """The walk where every row is greedy, with the per-position ops done once over the score tables:
        each position's pick and confidence depend only on the previous pick (one of K), so the argmax and
        the softmax's largest probability are taken for every possible previous pick at once, and only
        the chain of picks stays a loop, one small gather per position. The same values as the loop of
        `walk` (the same row-wise argmax and softmax over the same scores), in a third of its ops."""
        k = cand.shape[1]
        picks = [first.argmax(-1, keepdim=True)]                                      # [M, 1] each
        conf0 = first.softmax(-1).amax(-1, keepdim=True)
        if k > 1:
            # Per later position, [M, K]: the best next candidate after each candidate of the position before.
            for nxt in pairs.argmax(-1).unbind(1):
                picks.append(nxt.gather(1, picks[-1]))
        pick = torch.cat(picks, 1)                                                    # [M, k]
        ids = cand.gather(2, pick.unsqueeze(-1)).squeeze(-1)
        if k == 1:
            return Walk(ids, None, conf0)
        later = pairs.softmax(-1).amax(-1).gather(2, pick[:, :-1].unsqueeze(-1)).squeeze(-1)     # [M, k-1]
        return Walk(ids, None, torch.cat([conf0, later], 1))

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        self.cfg.save(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(Path(path) / WEIGHTS_FILE))

    @classmethod
    def load(cls, path: str | Path, target_vocab_size: int, target_hidden_size: int, target_num_layers: int,
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        cfg = check_drafter_checkpoint(path, target_vocab_size, target_hidden_size, target_num_layers)
        model = cls(cfg)
        weights = load_file(str(Path(path) / WEIGHTS_FILE))
        if cfg.draft_vocab_size:
            check_draft_vocab(weights["draft_vocab"], cfg, f"drafter {path}: tensor 'draft_vocab'")
        model.load_state_dict(weights, strict=True)
        return model.to(device=device, dtype=dtype).eval()


def check_draft_vocab(ids: torch.Tensor, cfg: DFlashConfig, what: str) -> torch.Tensor:
    """Draft-vocabulary ids as the walk needs them (integer, distinct, inside the vocabulary, at least
    selector_k of them), sorted; anything else raises DrafterCheckpointError naming `what`."""
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise DrafterCheckpointError(f"{what}: must be a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
    ids = ids.long().sort().values
    if len(ids) < cfg.selector_k:
        raise DrafterCheckpointError(f"{what}: {len(ids)} ids, fewer than selector_k={cfg.selector_k}")
    if len(ids) and (ids[0] < 0 or ids[-1] >= cfg.vocab_size):
        raise DrafterCheckpointError(f"{what}: ids outside the vocabulary [0, {cfg.vocab_size})")
    if bool((ids[1:] == ids[:-1]).any()):
        raise DrafterCheckpointError(f"{what}: repeated ids")
    return ids


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
