"""Multi-head Latent Attention (DeepSeek-V2/V3).

Two mathematically equal forms share one set of weights:
- dense: expand the latent into per-head K/V with kv_b_proj and run causal attention (training, prefill
  without a cache context; this is what the reference implementation computes);
- absorbed: fold kv_b_proj's K half into the query and its V half into the output, so attention runs
  directly over the cached latent [c_kv | k_pe] (576 values per token for Kimi-K2 instead of 2*H*d).
The forward context decides which one runs and where the latents are cached.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from namazu.config import ModelConfig
from namazu.kernels import small_gemm
from namazu.layers.forward_context import get_forward_context
from namazu.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from namazu.layers.norm import RMSNorm
from namazu.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from namazu.layers.weight_loading import TPShard


def latent_attention_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                         scale: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
                         visible: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed attention of one sequence over its latent cache (torch reference for every kernel).

    q_lat [Tq, H, r], q_pe [Tq, H, dr], ckv [Tk, r], kpe [Tk, dr]; a key is visible to a query when
    k_pos <= q_pos, or where `visible` [Tq, Tk] says (a draft tree's rows). Returns o_lat [Tq, H, r]
    (still in latent space; apply `absorb_out`).
    """
    scores = torch.einsum("qhr,kr->hqk", q_lat.float(), ckv.float())
    scores = scores + torch.einsum("qhd,kd->hqk", q_pe.float(), kpe.float())
    scores = scores * scale
    if visible is None:
        visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,kr->qhr", probs, ckv.float()).to(q_lat.dtype)


class MLAAttention(nn.Module):
    """Under tensor parallelism a rank holds whole heads: q / q_b, kv_b by output rows, o_proj by input
    columns; the latent down-projections (q_a, kv_a) and their norms are replicated."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None, device=None,
                 tp: TPShard = TPShard()):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        tkw = {**kw, "tp": tp}
        self.layer_idx = layer_idx
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")  # this rank's heads
        heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        bias = cfg.attention_bias
        h = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * self.qk_head_dim, bias=False, **tkw)
        else:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, bias=bias, **tkw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, **kw)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * self.qk_head_dim, bias=False, **tkw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias, **tkw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, **kw)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              bias=False, **tkw)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, h, bias=bias, **tkw)
        self.rotary = RotaryEmbedding(cfg.rope, self.qk_rope_head_dim, cfg.rope_interleave, device=device)
        self.softmax_scale = yarn_softmax_scale(cfg.rope, self.qk_head_dim)

    # -- absorbed-form helpers (used by cache contexts) -------------------------------------------
    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                       self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, dn] -> latent-space query [N, H, r]."""
        w_uk, _ = self._kv_b()
        if small_gemm.applies(q_nope, w_uk, q_nope.shape[0]):
            # the kernel reads w [H, r, dn] with dn contiguous: a 2 x H x dn x r byte copy, a few us a call
            return small_gemm.bmm_nt(q_nope.transpose(0, 1), w_uk.transpose(1, 2).contiguous()).transpose(0, 1)
        return torch.einsum("nhd,hdr->nhr", q_nope, w_uk)

    def absorb_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """latent attention output [N, H, r] -> per-head values [N, H, dv]."""
        _, w_uv = self._kv_b()
        if small_gemm.applies(o_lat, w_uv, o_lat.shape[0]):
            return small_gemm.bmm_nt(o_lat.transpose(0, 1), w_uv).transpose(0, 1)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)

    # -- forward -----------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [..., H] -> q_nope [..., Hh, dn], q_pe [..., Hh, dr] (rotated), c_kv [..., r] (normed),
        k_pe [..., dr] (rotated)."""
        lead = x.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*lead, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = self.rotary(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2))
        k_pe = self.rotary(k_pe, cos, sin)
        return q_nope, q_pe, c_kv, k_pe

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self.project(x, positions)
        ctx = get_forward_context()
        lead = x.shape[:-1]
        if ctx is None:
            out = self._dense_causal(q_nope, q_pe, c_kv, k_pe)
        else:
            n = lead.numel()
            out = ctx.attend(self, q_nope.reshape(n, self.num_heads, -1), q_pe.reshape(n, self.num_heads, -1),
                             c_kv.reshape(n, -1), k_pe.reshape(n, -1))
        return self.o_proj(out.reshape(*lead, self.num_heads * self.v_head_dim))

    def _dense_causal(self, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        """Expanded-K/V causal attention over each row of [B, T] (or one row for [T])."""
        squeeze = q_nope.dim() == 3
        if squeeze:
            q_nope, q_pe, c_kv, k_pe = (t.unsqueeze(0) for t in (q_nope, q_pe, c_kv, k_pe))
        b, t = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv).view(b, t, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(b, t, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=self.softmax_scale)
        out = out.transpose(1, 2)
        return out.squeeze(0) if squeeze else out
