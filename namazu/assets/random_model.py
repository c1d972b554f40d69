"""Deterministic random-weight checkpoints with a byte-level tokenizer, for tests and benchmarks.

The tokenizer has one token per byte (plus chat special tokens), so Japanese text is three tokens per
character: exactly the case incremental detokenization must get right. Weights come from a fixed seed;
the same arguments always write the same files.

    python -m namazu.assets.random_model --out DIR [--size tiny|bench] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|bos|>", "<|end_of_text|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                  "<|im_middle|>", "<|im_end|>", "<|mask|>")
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

SIZES: dict[str, dict[str, Any]] = {
    # A few milliseconds per step on one CPU core: the engine tests.
    "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, first_k_dense_replace=1),
    # Big enough that the model, not Python, dominates a CPU step: the throughput benchmark.
    "bench": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=1,
                  num_experts_per_tok=4, first_k_dense_replace=1),
}


def write_byte_tokenizer(out: Path) -> int:
    """Writes tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False} for s in SPECIAL_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
              "bos_token": "<|bos|>", "eos_token": EOS, "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)


def write_random_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0, std: float = 0.15,
                            **overrides: Any) -> Path:
    """A DeepSeek-V3 checkpoint with N(0, std) weights (large enough that greedy picks are not ties)."""
    from namazu.config import ModelConfig
    from namazu.models.checkpoint import save_checkpoint
    from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM

    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}")
    out = Path(out)
    vocab = write_byte_tokenizer(out)
    fields = dict(SIZES[size], vocab_size=vocab, max_position_embeddings=2048, initializer_range=std,
                  tie_word_embeddings=False, rope_interleave=True, routed_scaling_factor=2.5,
                  bos_token_id=SPECIAL_TOKENS.index("<|bos|>") + 256, eos_token_id=SPECIAL_TOKENS.index(EOS) + 256)
    fields.update(overrides)
    cfg = ModelConfig(**fields)
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for moe in model.moe_layers():
            bias = moe.gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
    save_checkpoint(model, out, dtype=torch.float32)
    logger.info("wrote random %s checkpoint (seed %d, vocab %d) to %s", size, seed, vocab, out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(write_random_checkpoint(args.out, args.size, args.seed))


if __name__ == "__main__":
    main()
