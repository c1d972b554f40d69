"""Training helpers shared by the default-model trainer and the drafter trainer."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(model, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None,
            per_row: bool = False) -> torch.Tensor:
    """Next-token cross-entropy over [B, T] rows; loss_mask [B, T] marks target positions that count.

    The mean is over all counted targets, or with `per_row` over rows of each row's own mean, so a row with
    few targets (a masked SFT row) weighs as much as a row of plain text.
    """
    hidden, _ = model(input_ids[:, :-1])
    logits = model.compute_logits(hidden)
    targets = input_ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    loss = loss.view(targets.shape)
    if loss_mask is None:
        return loss.mean()
    mask = loss_mask[:, 1:].to(loss.dtype)
    if per_row:
        rows = mask.sum(1)
        keep = rows > 0
        return ((loss * mask).sum(1)[keep] / rows[keep]).mean()
    return (loss * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def update_routing_biases(model, rate: float) -> torch.Tensor:
    """DeepSeek-V3 auxiliary-loss-free balancing for every MoE layer; returns the load [layers, E] it used."""
    loads = [moe.gate.update_bias(rate) for moe in model.moe_layers()]
    return torch.stack(loads) if loads else torch.zeros(0)


def load_imbalance(load: torch.Tensor) -> float:
    """max/mean expert load, averaged over layers (1.0 is perfectly balanced)."""
    if load.numel() == 0:
        return 1.0
    return float((load.max(-1).values / load.mean(-1).clamp_min(1e-9)).mean())
