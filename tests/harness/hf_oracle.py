"""Tiny random DeepSeek-V3 checkpoints written by transformers itself: the outside oracle for logits."""
from __future__ import annotations

import torch


def make_hf_checkpoint(path, seed: int = 0, **overrides):
    """Saves a random transformers DeepseekV3ForCausalLM (fp32) with a non-zero correction bias; returns it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
              max_position_embeddings=256, rope_interleave=True, tie_word_embeddings=False,
              num_nextn_predict_layers=0)
    kw.update(overrides)
    rope = kw.pop("rope_parameters", None)
    cfg = DeepseekV3Config(**kw)
    if rope is not None:
        cfg.rope_parameters = rope
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.05 * torch.randn_like(gate.e_score_correction_bias))
    model.save_pretrained(path)
    return model
