"""The model trains with autograd, and aux-loss-free bias updates balance expert load."""
from __future__ import annotations

import torch

from namazu.config import ModelConfig
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM
from namazu.models.training import lm_loss, load_imbalance, update_routing_biases


def _toy(seed=0) -> DeepseekV3ForCausalLM:
    cfg = ModelConfig.from_dict(dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        routed_scaling_factor=1.0, max_position_embeddings=64))
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
    model.init_weights(seed=seed)
    return model


def test_a_few_steps_reduce_loss():
    model = _toy()
    model.train()
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (4, 32), generator=g)
    batch[:, 1::2] = (batch[:, 0::2] + 1) % 64  # a learnable pattern: odd tokens follow even ones
    mask = torch.ones_like(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = lm_loss(model, batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        update_routing_biases(model, 1e-3)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    experts = model.moe_layers()[0].experts
    assert experts.w13.grad is not None and experts.w13.grad.abs().sum() > 0
    assert model.moe_layers()[0].gate.weight.grad.abs().sum() > 0


def test_bias_update_moves_load_toward_balance():
    model = _toy(1)
    model.train()
    gate = model.moe_layers()[0].gate
    gate.e_score_correction_bias[:2] = 0.3  # skewed start: experts 0 and 1 win every token
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(x)
    start = load_imbalance(update_routing_biases(model, 0.0))
    for _ in range(60):
        with torch.no_grad():
            model(x)
        update_routing_biases(model, 0.01)
    with torch.no_grad():
        model(x)
    end = load_imbalance(update_routing_biases(model, 0.0))
    assert start > 3.5, start
    assert end < 0.5 * start, (start, end)
    bias = gate.e_score_correction_bias
    assert bias[:2].max() < 0.3 and bias[2:].min() > 0.0  # over-loaded pushed down, under-loaded pulled up


def test_inference_experts_path_matches_training_path():
    """The sync-free gathered path (inference) and the grouped path (training) compute the same function."""
    model = _toy(3)
    experts = model.moe_layers()[0].experts
    x = torch.randn(13, 64)
    ids = torch.randint(0, 5, (13, 2))  # experts 5..7 get no tokens
    w = torch.rand(13, 2)
    with torch.no_grad():
        a = experts(x, ids, w)
        c = experts._forward_gathered(x, ids, w)
    b = experts._forward_grouped(x, ids, w)
    torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, b.detach(), rtol=1e-5, atol=1e-5)


def test_training_under_bf16_autocast():
    model = _toy(4)
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, ids)
    loss.backward()
    assert torch.isfinite(loss) and model.moe_layers()[0].experts.w13.grad is not None


def test_per_row_loss_weighs_rows_equally():
    model = _toy()
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 64, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :12] = False  # row 1 has 3 targets (positions 13..15), row 0 has 15
    with torch.no_grad():
        hidden, _ = model(batch[:, :-1])
        nll = torch.nn.functional.cross_entropy(model.compute_logits(hidden).transpose(1, 2), batch[:, 1:],
                                                reduction="none")
        m = mask[:, 1:].float()
        row_means = (nll * m).sum(1) / m.sum(1)
        torch.testing.assert_close(lm_loss(model, batch, mask, per_row=True), row_means.mean())
        torch.testing.assert_close(lm_loss(model, batch, mask), (nll * m).sum() / m.sum())
        mask[1] = False  # a row without targets is left out, not counted as zero
        torch.testing.assert_close(lm_loss(model, batch, mask, per_row=True), row_means[0])
