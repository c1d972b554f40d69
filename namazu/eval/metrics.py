"""Quality of a candidate model against a reference on the same tokens: perplexity, KL and top-1 agreement.

Per window (the bootstrap unit) the scorer keeps sums, so every statistic of any resample is exact:
reference and candidate next-token NLL, KL(ref || cand) summed over positions, top-1 agreements, and the
token count. Confidence intervals are percentile bootstraps over windows, paired (the same resampled
windows for both models), so the perplexity change's interval reflects the comparison, not the text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@dataclass
class WindowSums:
    nll_ref: torch.Tensor     # [W] float64
    nll_cand: torch.Tensor    # [W]
    kl: torch.Tensor          # [W]
    agree: torch.Tensor       # [W]
    count: torch.Tensor       # [W]


@dataclass
class Interval:
    value: float
    low: float
    high: float

    def fmt(self, digits: int = 4) -> str:
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


@dataclass
class Comparison:
    label: str
    tokens: int
    ppl_ref: Interval
    ppl_cand: Interval
    ppl_change_pct: Interval      # 100 * (ppl_cand / ppl_ref - 1)
    mean_kl: Interval             # nats per token
    top1_agreement: Interval      # fraction

    def as_dict(self) -> dict:
        return {"label": self.label, "tokens": self.tokens,
                **{k: vars(getattr(self, k)) for k in ("ppl_ref", "ppl_cand", "ppl_change_pct", "mean_kl",
                                                        "top1_agreement")}}


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """[T] token ids -> [T, V] fp32 logits (dense causal forward, no KV cache)."""
    hidden, _ = model(ids.unsqueeze(0).to(model.device))
    return model.compute_logits(hidden)[0].float()


def window_stats(logits_ref: torch.Tensor, logits_cand: torch.Tensor, ids: torch.Tensor) -> tuple[float, ...]:
    """(nll_ref, nll_cand, kl, agreements, count) summed over the window's predicted positions."""
    tgt = ids[1:].to(logits_ref.device)
    lr = F.log_softmax(logits_ref[:-1], -1)
    lc = F.log_softmax(logits_cand[:-1], -1)
    nll_r = -lr.gather(1, tgt[:, None]).sum()
    nll_c = -lc.gather(1, tgt[:, None]).sum()
    kl = (lr.exp() * (lr - lc)).sum()
    agree = (lr.argmax(-1) == lc.argmax(-1)).sum()
    return nll_r.item(), nll_c.item(), kl.item(), agree.item(), tgt.numel()


@torch.inference_mode()
def score(ref, cand, windows: list[torch.Tensor], desc: str = "scoring") -> WindowSums:
    rows = []
    for ids in tqdm(windows, desc=desc, unit="window", leave=False):
        rows.append(window_stats(logits_of(ref, ids), logits_of(cand, ids), ids))
    t = torch.tensor(rows, dtype=torch.float64)
    return WindowSums(*t.unbind(1))


def _stats(s: WindowSums, idx: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 5]: ppl_ref, ppl_cand, change %, mean KL, top-1 for the windows `idx` ([B, W] resamples)."""
    cols = [s.nll_ref, s.nll_cand, s.kl, s.agree, s.count]
    sums = [c[idx].sum(-1) if idx is not None else c.sum() for c in cols]
    nr, nc, kl, ag, n = sums
    ppl_r, ppl_c = torch.exp(nr / n), torch.exp(nc / n)
    return torch.stack([ppl_r, ppl_c, 100 * (ppl_c / ppl_r - 1), kl / n, ag / n], -1)


def compare(s: WindowSums, label: str, n_boot: int = 1000, confidence: float = 0.95,
            seed: int = 0) -> Comparison:
    point = _stats(s)
    w = s.count.numel()
    g = torch.Generator().manual_seed(seed)
    boot = _stats(s, torch.randint(0, w, (n_boot, w), generator=g))
    a = (1 - confidence) / 2
    lo = torch.quantile(boot, a, dim=0)
    hi = torch.quantile(boot, 1 - a, dim=0)
    iv = [Interval(float(point[i]), float(lo[i]), float(hi[i])) for i in range(5)]
    return Comparison(label, int(s.count.sum()), *iv)
