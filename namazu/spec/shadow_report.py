"""A shadow drafter's live numbers (`spec/shadow.py`) for the refresh report (`namazu.spec.refresh
--shadow-metrics SRC`): read from a server's GET /metrics (a URL), a saved copy of it, or a JSON file of
engine statistics (`LLM.get_stats()` / the server's stats as a dict, key `shadow_acceptance`), and put beside
the offline replay of the same drafters.

Per shadow drafter id: blocks scored by the exact rule and their mean acceptance length, blocks scored by the
expected acceptance (T > 0) and their mean, both pooled, and the serving drafter's mean acceptance length on
the same requests, so the live comparison is shadow / serving on one set of requests, as the replay's is
candidate / serving on the held-out set.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any


def _mean(total: float, count: float) -> float:
    return total / count if count else 0.0


def from_stats(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{shadow id: numbers} from engine statistics as a dict (EngineStats fields)."""
    out = {}
    for sid, t in (stats.get("shadow_acceptance") or {}).items():
        hist = t["acceptance_length_histogram"]
        exact_sum = float(sum((i + 1) * n for i, n in enumerate(hist)))
        serving = t.get("serving_acceptance_length_histogram") or []
        out[sid] = {"exact_blocks": float(t["num_exact_blocks"]), "exact_sum": exact_sum,
                    "expected_blocks": float(t["num_expected_blocks"]),
                    "expected_sum": float(t["expected_acceptance_length_sum"]),
                    "truncated_blocks": float(t["num_truncated_blocks"]),
                    "dropped_blocks": float(t["num_dropped_blocks"]),
                    "serving_steps": float(sum(serving)),
                    "serving_sum": float(sum((i + 1) * n for i, n in enumerate(serving)))}
    return _with_means(out)


def from_prometheus(text: str) -> dict[str, dict[str, float]]:
    """{shadow id: numbers} from the text of GET /metrics (`server/metrics.py`, `_shadow_metrics`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    serving: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            role, drafter = s.labels.get("role"), s.labels.get("drafter")
            if role is None or drafter is None:
                continue
            if s.name == "namazu_spec_shadow_acceptance_length_count":
                key = "exact_blocks" if role == "shadow" else "serving_steps"
            elif s.name == "namazu_spec_shadow_acceptance_length_sum":
                key = "exact_sum" if role == "shadow" else "serving_sum"
            elif s.name == "namazu_spec_shadow_expected_acceptance_length_sum_total":
                key = "expected_sum"
            elif s.name == "namazu_spec_shadow_blocks_total" and s.labels.get("rule") == "expected":
                key = "expected_blocks"
            elif s.name == "namazu_spec_shadow_unscored_blocks_total":
                key = f"{s.labels.get('why')}_blocks"
            else:
                continue
            if role == "serving":
                serving[key] = float(s.value)
            else:
                out.setdefault(drafter, {})[key] = float(s.value)
    for numbers in out.values():      # one shadow per server: the serving series is its comparison
        numbers.update(serving)
    return _with_means(out)


def _with_means(out: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    for n in out.values():
        for key in ("exact_blocks", "exact_sum", "expected_blocks", "expected_sum", "truncated_blocks",
                    "dropped_blocks", "serving_steps", "serving_sum"):
            n.setdefault(key, 0.0)
        n["mean_exact"] = _mean(n["exact_sum"], n["exact_blocks"])
        n["mean_expected"] = _mean(n["expected_sum"], n["expected_blocks"])
        n["mean"] = _mean(n["exact_sum"] + n["expected_sum"], n["exact_blocks"] + n["expected_blocks"])
        n["serving_mean"] = _mean(n["serving_sum"], n["serving_steps"])
        n["ratio"] = _mean(n["mean"], n["serving_mean"])
    return out


def read_shadow_metrics(src: str) -> dict[str, dict[str, float]]:
    """The live numbers of every shadow drafter in `src`: an http(s) URL (a server's /metrics; a bare server
    address gets /metrics appended), a file of /metrics text, or a JSON file of engine statistics. ValueError
    when `src` holds no shadow drafter's numbers."""
    if src.startswith(("http://", "https://")):
        url = src if src.rstrip("/").endswith("/metrics") else src.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
    else:
        p = Path(src)
        if not p.is_file():
            raise ValueError(f"--shadow-metrics {src}: no such file (give a server URL, a /metrics file or a JSON "
                             "stats file)")
        text = p.read_text()
    try:
        stats = json.loads(text)
    except ValueError:
        out = from_prometheus(text)
    else:
        out = from_stats(stats if isinstance(stats, dict) else {})
    if not out:
        raise ValueError(f"--shadow-metrics {src}: no shadow drafter's numbers in it (was the server started with "
                         "--shadow-drafter, and has a shadowed request been served?)")
    return out


def shadow_markdown(live: dict[str, dict[str, float]], overall: dict[str, Any], ids: dict[str, str]) -> str:
    """The live section of the refresh report: each shadow's numbers beside the offline replay's overall
    comparison (`overall`: `Comparison.to_dict()`); `ids` maps the replay's drafter ids to "serving" /
    "candidate", so a shadow that is the candidate says so."""
    lines = ["", "## Live shadow (--shadow-metrics)", "",
             "| shadow drafter | is | blocks exact / expected (truncated, dropped) | acceptance length shadow "
             "(exact; expected) | serving on the same requests | ratio live | ratio offline replay [gain "
             "95% interval] |", "|---|---|---:|---:|---:|---:|---:|"]
    for sid, n in sorted(live.items()):
        lines.append(
            f"| `{sid}` | {ids.get(sid, '-')} | {n['exact_blocks']:.0f} / {n['expected_blocks']:.0f} "
            f"({n['truncated_blocks']:.0f}, {n['dropped_blocks']:.0f}) | {n['mean']:.3f} ({n['mean_exact']:.3f}; "
            f"{n['mean_expected']:.3f}) | {n['serving_mean']:.3f} | {n['ratio']:.3f}x | {overall['ratio']:.3f}x "
            f"({overall['a_acceptance']:.3f} -> {overall['b_acceptance']:.3f}) [{overall['gain_low']:+.3f}, "
            f"{overall['gain_high']:+.3f}] |")
    lines += ["", "Live: the shadow's blocks on the shadowed share of live traffic (exact at T=0 and for seeded "
                  "requests; at T>0 the expected acceptance from the target's rows, a lower bound where "
                  "truncated); offline: the held-out replay above."]
    return "\n".join(lines) + "\n"
