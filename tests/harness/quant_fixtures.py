"""Small random DeepSeek-V3 models and tokenizers for the quantization and evaluation tests."""
from __future__ import annotations

import json
import os

import torch

from namazu.config import ModelConfig
from namazu.models.checkpoint import save_checkpoint
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM

VOCAB = 96


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.0,
                max_position_embeddings=256, initializer_range=0.08)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, skew: float = 0.0, dtype=torch.float32, **kw) -> DeepseekV3ForCausalLM:
    """Random model; `skew` biases routing towards low expert ids so high ids go cold on little data."""
    m = DeepseekV3ForCausalLM(tiny_config(**kw), dtype=dtype)
    m.init_weights(seed=seed)
    for moe in m.moe_layers():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(skew, -skew, moe.gate.num_experts))
    return m.eval()


def write_char_tokenizer(path: str) -> None:
    """A character-level tokenizer (ids < VOCAB) with a chat template, loadable by AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 32 + VOCAB - 2)]
    vocab = {"<unk>": 0, "<|im_end|>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|im_end|>",
                   "chat_template": template}, f)


def write_model_dir(path: str, **kw) -> DeepseekV3ForCausalLM:
    m = tiny_model(**kw)
    save_checkpoint(m, path)
    write_char_tokenizer(path)
    return m


def random_windows(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (length,), generator=g) for _ in range(n)]
