"""The refresh gate: is a candidate drafter better than the serving one on held-out requests, overall and
for every kind of request?

The measure is the engine's: acceptance length = tokens emitted over verify steps, summed over the requests
(a ratio of sums, as /metrics reports it), and tokens per engine step. Both drafters answer the same requests
with the same seeds, so the comparison is paired: the bootstrap resamples requests (never tokens: the steps
of one request are not independent draws), recomputes both ratios on each resample, and takes the 2.5% and
97.5% quantiles of their difference. A request belongs to one class per axis: language (Japanese / English /
other, from its answer's script), kind (a tool call, a JSON answer, text) and temperature bucket.

The verdict: promote when the candidate's overall gain has its whole 95% interval above zero and no class
with at least `min_class_requests` held-out requests is worse than the serving drafter by more than
`margin` (relative, on the point estimate); smaller classes are reported, not gated.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from namazu.spec.capture import CaptureRecord
from namazu.spec.training.replay import RequestAcceptance

_JA = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")
TOOL_MARK = "<|tool_calls_section_begin|>"


def temperature_bucket(t: float) -> str:
    return "T=0" if t == 0 else "0<T<=0.8" if t <= 0.8 else "T>0.8"


def request_classes(rec: CaptureRecord, tokenizer) -> dict[str, str]:
    """{axis: class} of a captured request, from its first answer's text and its sampling settings."""
    text = tokenizer.decode(rec.output_token_ids[0] if rec.output_token_ids else [], skip_special_tokens=False)
    ja, latin = len(_JA.findall(text)), len(_LATIN.findall(text))
    language = "ja" if ja and ja >= latin / 4 else "en" if latin else "other"
    body = text.strip()
    if TOOL_MARK in text:
        kind = "tool_call"
    elif body[:1] in "{[" and _is_json(body):
        kind = "json"
    else:
        kind = "text"
    return {"language": language, "kind": kind,
            "temperature": temperature_bucket(float(rec.sampling.get("temperature") or 0.0))}


def _is_json(text: str) -> bool:
    for candidate in (text, text.split("<|")[0].strip()):   # an end-of-turn token after it
        try:
            json.loads(candidate)
            return True
        except ValueError:
            continue
    return False


@dataclass
class Comparison:
    """Serving (a) against candidate (b) over one set of requests."""

    requests: int
    a_acceptance: float
    b_acceptance: float
    gain: float                      # b - a, acceptance length
    gain_low: float                  # its 95% bootstrap interval
    gain_high: float
    a_tokens_per_step: float
    b_tokens_per_step: float
    ratio: float                     # b / a, acceptance length

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return num.sum(-1) / np.maximum(den.sum(-1), 1)


def compare(a: Sequence[RequestAcceptance], b: Sequence[RequestAcceptance], resamples: int = 2000,
            seed: int = 0) -> Comparison:
    """a[i] and b[i] are the same request through the two drafters."""
    a_tok = np.array([r.verify_tokens for r in a], dtype=float)
    a_ver = np.array([r.verify_steps for r in a], dtype=float)
    b_tok = np.array([r.verify_tokens for r in b], dtype=float)
    b_ver = np.array([r.verify_steps for r in b], dtype=float)
    a_len, b_len = float(_ratio(a_tok, a_ver)), float(_ratio(b_tok, b_ver))
    idx = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
    diff = _ratio(b_tok[idx], b_ver[idx]) - _ratio(a_tok[idx], a_ver[idx])
    low, high = (float(x) for x in np.quantile(diff, [0.025, 0.975]))
    per_step = lambda rs: sum(r.output_tokens for r in rs) / max(1, sum(r.steps for r in rs))  # noqa: E731
    return Comparison(len(a), a_len, b_len, b_len - a_len, low, high, per_step(a), per_step(b),
                      b_len / a_len if a_len else 0.0)


@dataclass
class Verdict:
    promote: bool
    reasons: list[str]
    overall: Comparison
    classes: dict[str, dict[str, Comparison]] = field(default_factory=dict)   # axis -> class -> comparison
    margin: float = 0.05
    min_class_requests: int = 20

    def to_dict(self) -> dict:
        return {"promote": self.promote, "reasons": self.reasons, "margin": self.margin,
                "min_class_requests": self.min_class_requests, "overall": self.overall.to_dict(),
                "classes": {axis: {c: cmp.to_dict() for c, cmp in v.items()} for axis, v in self.classes.items()}}


def judge(records: Sequence[CaptureRecord], a: dict[str, RequestAcceptance], b: dict[str, RequestAcceptance],
          tokenizer, margin: float = 0.05, min_class_requests: int = 20, resamples: int = 2000) -> Verdict:
    """The verdict over the held-out `records` (every one replayed through both drafters)."""
    recs = [r for r in records if r.request_id in a and r.request_id in b]
    if not recs:
        raise ValueError("no held-out request was replayed through both drafters")
    pair = lambda rs: ([a[r.request_id] for r in rs], [b[r.request_id] for r in rs])  # noqa: E731
    overall = compare(*pair(recs), resamples)
    reasons = []
    if overall.gain_low > 0:
        reasons.append(f"overall acceptance length {overall.a_acceptance:.3f} -> {overall.b_acceptance:.3f} "
                       f"(gain {overall.gain:+.3f}, 95% interval [{overall.gain_low:+.3f}, {overall.gain_high:+.3f}])")
    else:
        reasons.append(f"not better overall: gain {overall.gain:+.3f}, 95% interval [{overall.gain_low:+.3f}, "
                       f"{overall.gain_high:+.3f}] does not lie above zero")
    promote = overall.gain_low > 0
    labels = [request_classes(r, tokenizer) for r in recs]
    classes: dict[str, dict[str, Comparison]] = {}
    for axis in ("language", "kind", "temperature"):
        classes[axis] = {}
        for name in sorted({lab[axis] for lab in labels}):
            members = [r for r, lab in zip(recs, labels) if lab[axis] == name]
            cmp = compare(*pair(members), resamples)
            classes[axis][name] = cmp
            if len(members) >= min_class_requests and cmp.ratio < 1 - margin:
                promote = False
                reasons.append(f"{axis}={name} is worse beyond the margin: acceptance length {cmp.a_acceptance:.3f} "
                               f"-> {cmp.b_acceptance:.3f} ({cmp.ratio:.3f}x < {1 - margin:.3f}x, "
                               f"{len(members)} requests)")
    return Verdict(promote, reasons, overall, classes, margin, min_class_requests)


def report_markdown(v: Verdict, current: str, candidate: str) -> str:
    lines = [f"# Drafter refresh: {'PROMOTE' if v.promote else 'KEEP the serving drafter'}", "",
             f"serving: `{current}`; candidate: `{candidate}`", ""]
    lines += [f"- {r}" for r in v.reasons]
    lines += ["", f"Gate: the overall gain's 95% bootstrap interval (requests resampled, paired) above zero, and "
                  f"no class of at least {v.min_class_requests} requests below {1 - v.margin:.2f}x.", "",
              "| class | requests | acceptance length serving -> candidate | gain [95% interval] | ratio | "
              "tokens/step serving -> candidate |", "|---|---:|---:|---:|---:|---:|"]

    def row(name: str, c: Comparison) -> str:
        return (f"| {name} | {c.requests} | {c.a_acceptance:.3f} -> {c.b_acceptance:.3f} | {c.gain:+.3f} "
                f"[{c.gain_low:+.3f}, {c.gain_high:+.3f}] | {c.ratio:.3f}x | {c.a_tokens_per_step:.2f} -> "
                f"{c.b_tokens_per_step:.2f} |")
    lines.append(row("**all**", v.overall))
    for axis, cls in v.classes.items():
        lines += [row(f"{axis}={name}", c) for name, c in cls.items()]
    return "\n".join(lines) + "\n"
