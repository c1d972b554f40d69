"""JSONSchemaBench's test instances through three JSON-schema compilers, token by token, no model.

    python bench/structured.py --instances bench/data/jsonschemabench [--subsets A,B] [--limit N] [--write]

For every schema of every subset (one `<Subset>.jsonl` per subset, lines {name, schema, tests}) each
compiler is asked to compile it: namazu's (the schema normalized as a request's is, then xgrammar),
xgrammar's own default (`compile_json_schema` with its defaults) and llguidance's own default
(`grammar_from_json_schema` with its defaults). Then every test instance, written as JSON with
`json.dumps` separators (`, ` and `: `, which all three accept), is fed through the compiled grammar
token by token in namazu-tiny's tokenizer and must then allow the end token. A valid instance the
grammar refuses is over-constraint; an invalid one it accepts to the end is under-constraint. A
schema is covered when it compiled and every one of its instances came out right (JSONSchemaBench's
coverage). The instance labels are checked against `jsonschema` (2020-12 format checking, or the
schema's own draft) first; an instance whose label `jsonschema` disagrees with is left out and counted.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

ENGINES = ("namazu", "xgrammar", "llguidance")


def dump(value: Any) -> str:
    """The instance as JSON text; integral floats written as integers (JSON Schema calls 1.0 an integer,
    and a grammar writes integers without a fraction)."""
    def canon(x: Any) -> Any:
        if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
            return int(x)
        if isinstance(x, list):
            return [canon(i) for i in x]
        if isinstance(x, dict):
            return {k: canon(i) for k, i in x.items()}
        return x
    return json.dumps(canon(value), ensure_ascii=False)


@dataclass
class Tally:
    schemas: int = 0
    compiled: int = 0
    refused: int = 0
    errors: int = 0
    covered: int = 0
    valid: int = 0
    invalid: int = 0
    over: int = 0
    under: int = 0
    compile_s: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    via: dict[str, int] = field(default_factory=dict)     # namazu: which compiler served the schema
    examples: list[str] = field(default_factory=list)
    outcomes: list[dict] = field(default_factory=list)   # per schema and wrong instance, for --outcomes


class NamazuEngine:
    name = "namazu"

    def __init__(self, backend: Any):
        self.backend = backend

    def compile(self, schema: Any) -> Any:
        from namazu.structured.xgrammar_backend import json_schema_spec

        spec = json_schema_spec(schema, strict=True)
        self.backend.compile(spec)
        return spec

    def accepts(self, compiled: Any, tokens: list[int]) -> bool:
        m = self.backend.matcher(compiled, max_rollback=0)
        return m.accept_tokens(tokens) and m.accept_tokens([self.backend.stop_ids[0]])


class XGrammarDefault:
    name = "xgrammar"

    def __init__(self, backend: Any):
        import xgrammar as xgr

        self.xgr = xgr
        self.compiler = backend.compiler
        self.stop = backend.stop_ids[0]

    def compile(self, schema: Any) -> Any:
        try:
            return self.compiler.compile_json_schema(json.dumps(schema))
        except Exception as e:   # noqa: BLE001 -- any refusal of the compiler is its outcome
            raise RuntimeError(str(e).strip().splitlines()[-1][:200]) from None

    def accepts(self, compiled: Any, tokens: list[int]) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in tokens) and m.accept_token(self.stop)


class LLGuidanceDefault:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, eos: list[int]):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(str(tokenizer_json), eos_token=eos[0])

    def compile(self, schema: Any) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error()[:200])
        return m

    def accepts(self, compiled: Any, tokens: list[int]) -> bool:
        m = compiled.deep_copy()
        return m.consume_tokens(tokens) and not m.is_error() and m.is_accepting()


def _oracle(schema: Any):
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def run_subset(path: Path, engines: list[Any], tokenizer: Any, limit: int | None) -> tuple[dict[str, Tally], int]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    tallies = {e.name: Tally() for e in engines}
    mislabeled = 0
    for row in tqdm(rows, desc=path.stem, leave=False):
        schema = row["schema"]
        try:
            oracle = _oracle(schema)
            tests = []
            for t in row["tests"]:
                if oracle.is_valid(t["data"]) == t["valid"]:
                    text = dump(t["data"])
                    if oracle.is_valid(json.loads(text)) != t["valid"]:   # draft-04: 1.0 is no integer
                        text = json.dumps(t["data"], ensure_ascii=False)
                    tests.append((t["valid"], tokenizer.encode(text, add_special_tokens=False)))
                else:
                    mislabeled += 1
        except Exception:   # noqa: BLE001 -- a schema jsonschema cannot read: its labels are untestable
            mislabeled += len(row["tests"])
            continue
        for e in engines:
            tally = tallies[e.name]
            tally.schemas += 1
            t0 = time.perf_counter()
            try:
                compiled = e.compile(schema)
            except ValueError as err:            # namazu's refusal names the keyword
                tally.refused += 1
                tally.outcomes.append({"kind": "refused", "subset": path.stem, "name": row["name"],
                                       "reason": str(err)[:300]})
                key = _reason(str(err))
                tally.reasons[key] = tally.reasons.get(key, 0) + 1
                continue
            except Exception as err:             # noqa: BLE001 -- the compiler's own refusal or failure
                tally.errors += 1
                tally.outcomes.append({"kind": "error", "subset": path.stem, "name": row["name"],
                                       "reason": str(err)[:300]})
                key = _reason(str(err))
                tally.reasons[key] = tally.reasons.get(key, 0) + 1
                continue
            tally.compile_s.append(time.perf_counter() - t0)
            tally.compiled += 1
            if isinstance(e, NamazuEngine):
                which = e.backend.compiler_for(compiled)
                tally.via[which] = tally.via.get(which, 0) + 1
            right = True
            for valid, tokens in tests:
                ok = e.accepts(compiled, tokens)
                if valid:
                    tally.valid += 1
                    if not ok:
                        tally.over += 1
                        right = False
                        if len(tally.examples) < 8:
                            tally.examples.append(f"over  {path.stem}/{row['name']}")
                        tally.outcomes.append({"kind": "over", "subset": path.stem, "name": row["name"],
                                               "instance": tokenizer.decode(tokens)})
                else:
                    tally.invalid += 1
                    if ok:
                        tally.under += 1
                        right = False
                        if len(tally.examples) < 8:
                            tally.examples.append(f"under {path.stem}/{row['name']}")
                        tally.outcomes.append({"kind": "under", "subset": path.stem, "name": row["name"],
                                               "instance": tokenizer.decode(tokens)})
            tally.covered += right
            if right:
                tally.outcomes.append({"kind": "covered", "subset": path.stem, "name": row["name"]})
    return tallies, mislabeled


def _reason(msg: str) -> str:
    """A short bucket for a refusal message (the keyword it names)."""
    msg = re.sub(r"\[[0-9:]+\] \S+:\d+: ", "", msg)        # xgrammar's "[hh:mm:ss] file.cc:line: "
    for word in ("any order", "'not'", "contains", "oneOf", "if/then/else", "uniqueItems", "minProperties", "dependent",
                 "format", "allOf", "$ref", "pattern", "unevaluated", "accepts no", "accepts nothing", "nests",
                 "too large", "$dynamicRef", "$recursiveRef", "propert"):
        if word in msg:
            return word.strip("'")
    return msg[:60]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]


def run(data_dir: str, subsets: list[str] | None = None, limit: int | None = None,
        model: str | None = None) -> tuple[str, dict[str, dict[str, Tally]]]:
    from namazu.assets import default_model_path
    from namazu.config import ModelConfig
    from namazu.structured.xgrammar_backend import XGrammarBackend
    from namazu.tokenizer import Tokenizer

    model_dir = Path(model) if model else Path(default_model_path())
    tok = Tokenizer.from_pretrained(str(model_dir))
    cfg = ModelConfig.from_pretrained(str(model_dir))
    stops = sorted(set(tok.eos_token_ids) | set(cfg.eos_token_ids))
    backend = XGrammarBackend(tok, cfg.vocab_size, stops, cache_size=4)
    engines = [NamazuEngine(backend), XGrammarDefault(backend), LLGuidanceDefault(model_dir / "tokenizer.json", stops)]
    files = sorted(Path(data_dir).glob("*.jsonl"))
    if subsets:
        files = [f for f in files if f.stem in subsets]
    results: dict[str, dict[str, Tally]] = {}
    lines = ["| subset | compiler | schemas | compiled | refused | compile errors | covered | coverage "
             "| valid over-constrained | invalid under-constrained | compile p50 ms | compile p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for f in files:
        tallies, mislabeled = run_subset(f, engines, tok, limit)
        results[f.stem] = tallies
        for name in ENGINES:
            t = tallies[name]
            lines.append(f"| {f.stem} | {name} | {t.schemas} | {t.compiled} | {t.refused} | {t.errors} "
                         f"| {t.covered} | {t.covered / max(t.schemas, 1):.1%} | {t.over}/{t.valid} "
                         f"| {t.under}/{t.invalid} | {_pct(t.compile_s, 0.5):.1f} | {_pct(t.compile_s, 0.99):.1f} |")
        if mislabeled:
            notes.append(f"{f.stem}: {mislabeled} instance(s) whose label jsonschema disagrees with, left out")
    total = {n: Tally() for n in ENGINES}
    for tallies in results.values():
        for n, t in tallies.items():
            a = total[n]
            for k in ("schemas", "compiled", "refused", "errors", "covered", "valid", "invalid", "over", "under"):
                setattr(a, k, getattr(a, k) + getattr(t, k))
            a.compile_s += t.compile_s
            for k, v in t.reasons.items():
                a.reasons[k] = a.reasons.get(k, 0) + v
            for k, v in t.via.items():
                a.via[k] = a.via.get(k, 0) + v
            a.examples += t.examples[:2]
    for name in ENGINES:
        t = total[name]
        lines.append(f"| **all** | {name} | {t.schemas} | {t.compiled} | {t.refused} | {t.errors} | {t.covered} "
                     f"| {t.covered / max(t.schemas, 1):.1%} | {t.over}/{t.valid} | {t.under}/{t.invalid} "
                     f"| {_pct(t.compile_s, 0.5):.1f} | {_pct(t.compile_s, 0.99):.1f} |")
    for name in ENGINES:
        top = sorted(total[name].reasons.items(), key=lambda kv: -kv[1])[:8]
        if top:
            notes.append(f"{name} refusals/errors by reason: " + ", ".join(f"{k}: {v}" for k, v in top))
    via = total["namazu"].via
    notes.append("namazu's compiled schemas by compiler (the rule in namazu/structured/llguidance_backend.py): "
                 + ", ".join(f"{k}: {v}" for k, v in sorted(via.items())))
    for name in ENGINES:
        if total[name].examples:
            notes.append(f"{name} examples: " + "; ".join(total[name].examples[:6]))
    text = "\n".join(lines) + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
    return text, results
