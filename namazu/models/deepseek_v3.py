"""DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): MLA attention + MoE, the one model family namazu serves.

Module names equal checkpoint tensor names, so loading is a name lookup. The same code trains (autograd,
no inference shortcuts in the math) and serves (attention delegated to the forward context's cache).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from namazu.config import ModelConfig
from namazu.kernels.moe_types import MoERuntime
from namazu.layers.mla import MLAAttention
from namazu.layers.moe import MLP, MoE
from namazu.layers.norm import RMSNorm
from namazu.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from namazu.layers.weight_loading import TPShard


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, experts_format: str, dtype, device,
                 runtime: MoERuntime | None, tp: TPShard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLAAttention(cfg, layer_idx, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(cfg, layer_idx, experts_format, dtype, device, runtime, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, experts_format: str, dtype, device, runtime: MoERuntime | None,
                 tp: TPShard):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device, tp=tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, experts_format, dtype, device, runtime, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DeepseekV3ForCausalLM(nn.Module):
    """`runtime`: how the routed experts run (kernels.backends.resolve_moe_runtime; None: the torch
    reference). `tp`: the tensor-parallel shard this copy holds (the layers own their collectives: the
    embedding and lm_head hold a range of the vocabulary, attention whole heads, the MLPs and experts a
    slice of their intermediate dimension; the norms and the router are replicated)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 experts_format: str = "bf16", runtime: MoERuntime | None = None, tp: TPShard = TPShard()):
        super().__init__()
        self.config = config
        self.experts_format = experts_format
        self.tp = tp
        self.model = DeepseekV3Model(config, experts_format, dtype, device, runtime, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype=dtype, device=device, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._whole_vocab: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids [B, T] (dense causal rows) or [N] (flat tokens under a forward context).

        Returns the final-normed hidden states and {layer index: that layer's output hidden state}.
        """
        if positions is None:
            t = input_ids.shape[-1]
            positions = torch.arange(t, device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions)
            if i in capture_layers:
                captured[i] = x
        return self.model.norm(x), captured

    def gather_whole_vocab(self) -> None:
        """Keeps a copy of the whole embedding and lm_head on this rank, for a drafter that borrows them
        (`whole_vocab`). Under tensor parallelism a collective: every rank calls it at start-up, together
        (not when a drafter is attached: a shadow drafter attaches on rank 0 alone). Costs 2 x V x H
        elements per rank beyond the model's shard (one V x H with tied embeddings)."""
        if self.tp.size > 1 and self._whole_vocab is None:
            embed = self.model.embed_tokens.whole()
            tied = self.lm_head.weight is self.model.embed_tokens.weight
            self._whole_vocab = (embed, embed if tied else self.lm_head.whole())

    def whole_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding [V, H], lm_head [V, H]) of the whole vocabulary: the layers' own weights at one rank,
        the copies `gather_whole_vocab` made under tensor parallelism."""
        if self.tp.size == 1:
            return self.model.embed_tokens.weight, self.lm_head.weight
        if self._whole_vocab is None:
            raise RuntimeError("the whole vocabulary's embedding and lm_head were not gathered on this rank "
                               "(gather_whole_vocab, on every rank at start-up)")
        return self._whole_vocab

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        # A quantized copy of the model may have replaced lm_head with another linear (one rank only).
        logits = head.gather_logits(hidden) if isinstance(head, ParallelLMHead) else head(hidden)
        return logits.float()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init (normal(0, initializer_range) for matrices, ones for norms, zero bias)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
        for moe in self.moe_layers():
            moe.gate.e_score_correction_bias.zero_()
