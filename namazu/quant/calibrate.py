"""Calibration with full expert coverage, and the CLI that writes an NVFP4 ModelOpt checkpoint.

`python -m namazu.quant.calibrate --model PATH --data FILE... --out DIR`

The only data-dependent part of NVFP4 is each linear's activation amax (-> input_scale). For a routed
expert that is two numbers, the amax of its gate/up input and of its down_proj input, and they must come
from the tokens the router actually sends it. Every MoE layer's `experts` is wrapped by an observer that
returns the normal top-k output and records, per expert, those amaxes and token counts. An expert that
has seen fewer than `--min-tokens` routed tokens is additionally run on every token of the pass
("forcing": it is computed for observation only, its output is discarded), so no expert ends without a
scale; the report lists which experts' scales came from forced tokens. With forcing off, an expert that
saw no token has no scale and the checkpoint is refused, unless `--impute-missing` (the layer's peer max;
every imputed expert listed).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from namazu.layers.experts import RoutedExperts
from namazu.quant.quantize import ActivationStats
from namazu.quant.selective import QuantPolicy, module_class

logger = logging.getLogger(__name__)


@dataclass
class ExpertCoverage:
    """Per-expert observations of one MoE layer ([E] each)."""

    tokens: torch.Tensor           # routed tokens seen
    a13: torch.Tensor              # amax of the gate/up input over routed tokens
    a2: torch.Tensor               # amax of the down_proj input over routed tokens
    forced_tokens: torch.Tensor    # tokens seen only because the expert was forced
    forced_a13: torch.Tensor
    forced_a2: torch.Tensor

    @classmethod
    def empty(cls, n: int) -> ExpertCoverage:
        z = lambda dt: torch.zeros(n, dtype=dt)  # noqa: E731
        return cls(z(torch.int64), z(torch.float32), z(torch.float32), z(torch.int64), z(torch.float32),
                   z(torch.float32))


class ObserverExperts(RoutedExperts):
    """Wraps a high-precision RoutedExperts; forward returns its normal output and records coverage."""

    def __init__(self, inner: RoutedExperts, min_tokens: int, force: bool):
        super().__init__()
        self.inner = inner
        self.num_experts, self.hidden_size = inner.num_experts, inner.hidden_size
        self.intermediate_size = inner.intermediate_size
        self.min_tokens, self.force = min_tokens, force
        self.cov = ExpertCoverage.empty(inner.num_experts)
        w = getattr(inner, "w13", None)
        if w is None:  # any other high-precision format: gather its weights once
            ws = {(e, p): t for e, p, n, t in inner.expert_params() if n == "weight"}
            self._w13 = torch.stack([torch.cat([ws[(e, "gate_proj")], ws[(e, "up_proj")]])
                                     for e in range(self.num_experts)])
            self._w2 = torch.stack([ws[(e, "down_proj")] for e in range(self.num_experts)])
        else:
            self._w13, self._w2 = inner.w13, inner.w2

    # Loading and saving go to the wrapped experts: the observer only adds coverage statistics.
    def load_expert_param(self, expert: int, proj: str, param: str, tensor: torch.Tensor) -> None:
        self.inner.load_expert_param(expert, proj, param, tensor)

    def expert_params(self) -> Iterator[tuple[int, str, str, torch.Tensor]]:
        return self.inner.expert_params()

    def expected_params(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return self.inner.expected_params()

    def _down_input(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of expert e on rows x, in x's dtype as the forward computes it."""
        gate, up = F.linear(x, self._w13[e].to(x.dtype)).chunk(2, dim=-1)
        return F.silu(gate) * up

    @torch.no_grad()
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = self.inner(x, topk_ids, topk_weights)
        cov = self.cov
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts).cpu()
        cold_before = cov.tokens < self.min_tokens
        for e in counts.nonzero().flatten().tolist():
            rows = (topk_ids == e).any(-1)
            xe = x[rows]
            cov.a13[e] = max(cov.a13[e], xe.abs().max().float().cpu())
            cov.a2[e] = max(cov.a2[e], self._down_input(e, xe).abs().max().float().cpu())
        cov.tokens += counts
        if self.force:
            x_amax = x.abs().max().float().cpu()
            for e in cold_before.nonzero().flatten().tolist():
                cov.forced_tokens[e] += x.shape[0]
                cov.forced_a13[e] = max(cov.forced_a13[e], x_amax)
                cov.forced_a2[e] = max(cov.forced_a2[e], self._down_input(e, x).abs().max().float().cpu())
        return out


@dataclass
class ExpertScale:
    layer: int
    expert: int
    tokens: int
    forced_tokens: int
    source: str        # routed | forced | low (routed but < min_tokens, no forcing) | imputed | missing
    a13_amax: float
    a2_amax: float


@dataclass
class CalibrationReport:
    min_tokens: int
    force: bool
    total_tokens: int = 0
    experts: list[ExpertScale] = field(default_factory=list)
    linears: dict[str, float] = field(default_factory=dict)

    def by_source(self, source: str) -> list[ExpertScale]:
        return [s for s in self.experts if s.source == source]

    def as_dict(self) -> dict:
        return {"min_tokens": self.min_tokens, "force": self.force, "total_tokens": self.total_tokens,
                "experts": [vars(s) for s in self.experts], "linear_input_amax": self.linears,
                "summary": {s: [[x.layer, x.expert] for x in self.by_source(s)]
                            for s in ("forced", "low", "imputed", "missing")}}

    def summary(self) -> str:
        toks = torch.tensor([s.tokens for s in self.experts], dtype=torch.float64)
        lines = [f"calibration tokens: {self.total_tokens}; experts: {len(self.experts)}; routed tokens per "
                 f"expert min/median/max = {int(toks.min())}/{int(toks.median())}/{int(toks.max())}"
                 if len(toks) else f"calibration tokens: {self.total_tokens}; no routed experts"]
        for layer in sorted({s.layer for s in self.experts}):
            counts = [f"{s.tokens}" + (f"+{s.forced_tokens}f" if s.source == "forced" else "")
                      for s in self.experts if s.layer == layer]
            lines.append(f"  layer {layer} routed tokens per expert (+forced): {' '.join(counts)}")
        for src, what in (("routed", "scales from routed tokens"),
                          ("forced", f"below {self.min_tokens} routed tokens, scales from forced tokens"),
                          ("low", f"below {self.min_tokens} routed tokens (forcing off), scales from few tokens"),
                          ("imputed", "no tokens, scale imputed from the layer's peer max"),
                          ("missing", "no tokens, NO SCALE")):
            items = self.by_source(src)
            lines.append(f"  {len(items):4d} {what}")
            if items and src != "routed":
                lines.append("       " + ", ".join(f"L{s.layer}/E{s.expert}({s.tokens})" for s in items))
        return "\n".join(lines)


class MissingScalesError(RuntimeError):
    """Experts without an input scale (forcing was off and the data never routed to them)."""


def calibrate(model: torch.nn.Module, windows: list[torch.Tensor], policy: QuantPolicy, min_tokens: int = 32,
              force: bool = True,
              progress: bool = True) -> tuple[dict[int, ExpertCoverage], dict[str, float], int]:
    """Runs the windows through the model with observers in place; returns (coverage per MoE layer,
    linear input amaxes, total tokens). The model is left as it was."""
    observers: dict[int, ObserverExperts] = {}
    moe_layers = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    for i, moe in moe_layers:
        if policy.experts_quantized(i):
            observers[i] = ObserverExperts(moe.experts, min_tokens, force)
            moe.experts = observers[i]
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if module_class(name) not in (None, "routed_experts") and policy.quantized(name):
            def record(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().float().item())
            hooks.append(mod.register_forward_pre_hook(record))
    total = 0
    needs_logits = policy.quantized("lm_head")
    try:
        with torch.inference_mode():
            for ids in tqdm(windows, desc="calibrating", unit="window", disable=not progress):
                hidden, _ = model(ids.unsqueeze(0).to(model.device))
                if needs_logits:  # lm_head runs outside forward(); observe it only when it is covered
                    model.compute_logits(hidden)
                total += ids.numel()
    finally:
        for h in hooks:
            h.remove()
        for i, moe in moe_layers:
            if i in observers:
                moe.experts = observers[i].inner
    return {i: o.cov for i, o in observers.items()}, amax, total


def finalize(coverage: dict[int, ExpertCoverage], linears: dict[str, float], total_tokens: int,
             min_tokens: int, force: bool, impute_missing: bool) -> tuple[ActivationStats, CalibrationReport]:
    """Chooses each expert's amaxes (routed, else forced, else imputed) and builds the report.
    Raises MissingScalesError listing every expert left without a scale."""
    report = CalibrationReport(min_tokens, force, total_tokens, linears=dict(linears))
    stats = ActivationStats(linears=dict(linears))
    for layer, cov in sorted(coverage.items()):
        a13, a2 = cov.a13.clone(), cov.a2.clone()
        sources = []
        for e in range(a13.numel()):
            n, nf = int(cov.tokens[e]), int(cov.forced_tokens[e])
            if n >= min_tokens:
                sources.append("routed")
            elif nf > 0:
                a13[e] = max(a13[e], cov.forced_a13[e])
                a2[e] = max(a2[e], cov.forced_a2[e])
                sources.append("forced")
            elif n > 0:
                sources.append("low")
            else:
                sources.append("missing")
        have = torch.tensor([s != "missing" for s in sources])
        if impute_missing and have.any():
            for e, s in enumerate(sources):
                if s == "missing":
                    a13[e], a2[e] = a13[have].max(), a2[have].max()
                    sources[e] = "imputed"
        for e, s in enumerate(sources):
            report.experts.append(ExpertScale(layer, e, int(cov.tokens[e]), int(cov.forced_tokens[e]), s,
                                              float(a13[e]), float(a2[e])))
        stats.experts_a13[layer], stats.experts_a2[layer] = a13, a2
    missing = report.by_source("missing")
    if missing:
        names = ", ".join(f"layer {s.layer} expert {s.expert}" for s in missing)
        raise MissingScalesError(f"{len(missing)} expert(s) saw no calibration token and have no input scale: "
                                 f"{names}. Calibrate with forcing on (the default), add data, or pass "
                                 f"--impute-missing to use each layer's peer max (listed in the report).")
    return stats, report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m namazu.quant.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="BF16 or block-FP8 checkpoint directory")
    ap.add_argument("--data", nargs="+", required=True, metavar="FILE",
                    help="calibration text (.txt[.gz], corpus format) or chats (.jsonl, rendered with the chat "
                         "template)")
    ap.add_argument("--out", required=True, help="directory for the NVFP4 ModelOpt checkpoint")
    ap.add_argument("--policy", default="experts",
                    help="what to quantize: preset 'experts' (default) or 'all-linear', or a comma list of "
                         "classes: routed_experts,shared_experts,dense_mlp,attention,lm_head")
    ap.add_argument("--exclude", nargs="*", default=[], metavar="PATTERN",
                    help="extra exclude_modules fnmatch patterns (e.g. 'model.layers.3.mlp.experts*')")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=65536, help="calibration tokens to use at most")
    ap.add_argument("--min-tokens", type=int, default=32,
                    help="routed tokens an expert needs before its scale counts as covered")
    ap.add_argument("--no-force", dest="force", action="store_false",
                    help="do not force cold experts to see tokens (then experts may end without a scale)")
    ap.add_argument("--impute-missing", action="store_true",
                    help="give experts without a scale their layer's peer max (listed in the report)")
    ap.add_argument("--weight-scale-search", action="store_true",
                    help="pick each weight block's FP8 scale by least squared error instead of the max rule "
                         "(same format; default off = byte-identical to ModelOpt's max calibration)")
    ap.add_argument("--dtype", default="auto")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from namazu.eval.data import load_tokenizer, token_windows
    from namazu.models.loader import load_model
    from namazu.quant.modelopt_checkpoint import save_quantized
    from namazu.quant.quantize import quantize_model

    policy = QuantPolicy.parse(args.policy, args.exclude)
    if policy.quantized("model.layers.1.mlp.gate"):
        print("refused: the router cannot be written as NVFP4 (use namazu.quant.sensitivity to measure it)",
              file=sys.stderr)
        return 2
    model = load_model(args.model, dtype=args.dtype)
    tok = load_tokenizer(args.tokenizer or args.model)
    windows = token_windows(args.data, tok, args.seq_len, args.max_tokens, "calibration").windows
    coverage, linears, total = calibrate(model, windows, policy, args.min_tokens, args.force)
    try:
        stats, report = finalize(coverage, linears, total, args.min_tokens, args.force, args.impute_missing)
    except MissingScalesError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    quantize_model(model, policy, stats, mode="w4a4", scale_search=args.weight_scale_search)
    save_quantized(model, args.out, policy, source_dir=args.model)
    with open(os.path.join(args.out, "calibration.json"), "w", encoding="utf-8") as f:
        json.dump({"model": args.model, "data": args.data, "policy": policy.exclude_modules, **report.as_dict()},
                  f, indent=2)
    print(f"wrote {args.out} (calibration report: {os.path.join(args.out, 'calibration.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
