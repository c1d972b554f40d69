"""Routing variants that transformers does not implement (it always routes sigmoid + noaux_tc), checked
against a direct per-token reading of the DeepSeek-V2/V3 rules."""
from __future__ import annotations

import pytest
import torch

from namazu.config import ModelConfig
from namazu.layers.moe import Router


def _router(**kw) -> Router:
    cfg = ModelConfig.from_dict(dict(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, **kw))
    r = Router(cfg, dtype=torch.float32)
    torch.nn.init.normal_(r.weight, std=1.0)
    return r.eval()


def _per_token(scores: torch.Tensor, n_group: int, topk_group: int, k: int, group_score) -> list[set[int]]:
    picks = []
    for row in scores:
        groups = row.view(n_group, -1)
        keep = sorted(range(n_group), key=lambda g: -group_score(groups[g]))[:topk_group]
        allowed = [g * groups.shape[1] + j for g in keep for j in range(groups.shape[1])]
        picks.append(set(sorted(allowed, key=lambda e: -row[e].item())[:k]))
    return picks


def test_softmax_greedy_routing():
    r = _router(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
    x = torch.randn(20, 16)
    ids, w = r(x)
    probs = torch.softmax(x @ r.weight.T, -1)
    assert [set(t.tolist()) for t in ids] == _per_token(probs, 1, 1, 2, lambda g: g.max().item())
    torch.testing.assert_close(w, probs.gather(1, ids))


def test_group_limited_greedy_uses_group_max():
    r = _router(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=1,
                routed_scaling_factor=2.0, norm_topk_prob=False)
    x = torch.randn(20, 16)
    ids, w = r(x)
    probs = torch.softmax(x @ r.weight.T, -1)
    assert [set(t.tolist()) for t in ids] == _per_token(probs, 4, 1, 2, lambda g: g.max().item())
    torch.testing.assert_close(w, 2.0 * probs.gather(1, ids))


@pytest.mark.parametrize("bias_scale", [0.0, 0.5])
def test_noaux_tc_bias_selects_but_does_not_weigh(bias_scale):
    r = _router(n_group=4, topk_group=2)
    r.e_score_correction_bias.copy_(bias_scale * torch.randn(8))
    x = torch.randn(20, 16)
    ids, w = r(x)
    scores = torch.sigmoid(x @ r.weight.T)
    choice = scores + r.e_score_correction_bias
    expect = _per_token(choice, 4, 2, 2, lambda g: g.topk(2).values.sum().item())
    assert [set(t.tolist()) for t in ids] == expect
    raw = scores.gather(1, ids)
    torch.testing.assert_close(w, r.scaling * raw / raw.sum(-1, keepdim=True))
