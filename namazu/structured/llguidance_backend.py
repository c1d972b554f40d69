"""llguidance behind the grammar seam, for the JSON schemas xgrammar is slow at.

Which compiler a JSON schema gets (after `json_schema.normalize_json_schema`) is one rule:

0. a schema with an object whose keys `any_order.py` cannot free (more than 3 declared properties, or
   undeclared ones beside declared ones) is written as an llguidance grammar that takes them in any
   order (`free_order.py`); where that grammar cannot be written, strict refuses and otherwise 1-3 apply;
1. a schema only llguidance enforces (lengths beside a pattern that cannot be folded into it, lengths
   beside an email format: xgrammar drops the lengths) goes to llguidance; its refusal is final;
2. a schema with an object open to undeclared properties (no `additionalProperties: false`, as JSON
   Schema's default is; `prefers_llguidance`) goes to llguidance, or to xgrammar if llguidance refuses;
3. every other schema, and every regex, EBNF grammar and tool-call header, goes to xgrammar.

xgrammar builds, for each open object, a grammar for "any key but the declared ones" whose
compile time grows with the declared properties (about 60 ms each on namazu-tiny's vocabulary: seconds
for a Kubernetes object); llguidance compiles the same schema in milliseconds. Both enforce the
normalized schema exactly (the instance harness, bench/structured_instances.py, checks both paths). If
llguidance is not installed, rule 1's schemas are refused by name and rule 2's go to xgrammar.

The tokenizer is given to llguidance as its Hugging Face `tokenizer.json`; special tokens are never
part of grammar text for it either, so a JSON string can never hold an end token or a tool-call marker.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from namazu.structured.grammar import StepwiseGrammar

# namazu writes JSON as xgrammar does with fixed separators: ", " between items, ": " after keys. No
# \u escapes: an undeclared key written "\u0061" would be the declared key "a" once parsed, with a value
# its schema never checked (llguidance's default admits that).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allowed_escapes": 'nrbtf"\\'}


def prefers_llguidance(schema: Any) -> bool:
    """True when the (normalized) schema has an object open to undeclared properties, or a string with a
    length bound (xgrammar's bounded strings refuse every escape: `"a\\nb"` with maxLength 10)."""
    def walk(s: Any) -> bool:
        if isinstance(s, list):
            return any(walk(x) for x in s)
        if not isinstance(s, dict):
            return False
        t = s.get("type")
        is_object = t == "object" or (isinstance(t, list) and "object" in t) or (
            t is None and ("properties" in s or "required" in s))
        if is_object and s.get("additionalProperties", True) is not False:
            return True
        if ("minLength" in s or "maxLength" in s) and (t is None or t == "string" or
                                                      (isinstance(t, list) and "string" in t)):
            return True
        return any(walk(v) for k, v in s.items() if k not in ("enum", "const"))
    return walk(schema)


def close_open_objects(schema: Any) -> Any:
    """The schema with every object that leaves additionalProperties open closed (for xgrammar, whose
    open objects admit an undeclared key written with \\u escapes that parses as a declared one):
    sound, and narrower than the schema."""
    if isinstance(schema, list):
        return [close_open_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const") else close_open_objects(v)) for k, v in schema.items()}
    t = schema.get("type")
    is_object = t == "object" or (isinstance(t, list) and "object" in t) or (
        t is None and ("properties" in schema or "required" in schema))
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


class LLGuidanceCompiler:
    """One llguidance tokenizer; `compile` returns a matcher to copy per sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]):
        import llguidance

        self.llg = llguidance
        backend = getattr(tokenizer, "_backend", None)
        if getattr(tokenizer, "kind", None) != "hf" or not hasattr(backend, "to_str"):
            raise ValueError("llguidance needs a Hugging Face tokenizer")
        self.tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_ids))
        # Ten times llguidance's default fuel for building a grammar's regexes (about 200 ms at most): with
        # the default, a pattern of 50 counted words under maxLength 500 ran out of it and then refused a
        # valid 11-word string (JSONSchemaBench o21115), over-constraint with no error.
        self.limits = llguidance.LLParserLimits(initial_lexer_fuel=10_000_000)

    def compile(self, schema_text: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise ValueError(f"the JSON schema does not compile: {m.get_error()}")
        return m

    def compile_lark(self, lark_text: str) -> Any:
        """A matcher for an llguidance Lark grammar (free_order.py writes them); ValueError if it fails."""
        try:
            m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_lark(lark_text), log_level=0,
                                   limits=self.limits)
        except Exception as err:   # noqa: BLE001 -- llguidance raises its own types for a bad grammar
            raise ValueError(f"the grammar does not compile: {err}") from None
        if m.is_error():
            raise ValueError(f"the grammar does not compile: {m.get_error()}")
        return m


class LLMatcherGrammar(StepwiseGrammar):
    """The `Grammar` protocol over one llguidance matcher (one per sequence)."""

    depends_on_values = True

    def __init__(self, compiled: Any, end_ids: list[int], extra_words: np.ndarray | None = None,
                 max_rollback: int = 64):
        self.m = compiled.deep_copy()
        self.end_ids = set(end_ids)
        # Rollback restores a copy taken before each token: llguidance 1.9.1's own rollback, after a long
        # run of accepts and rollbacks (speculative drafts checked every step), can leave masks that
        # admit tokens a fresh matcher refuses (seen on namazu-tiny with n-gram drafts).
        self.snapshots: list[Any] = []
        self.max_rollback = max(max_rollback, 1)
        self.extra_words = extra_words

    def _accept_one(self, token: int) -> bool:
        if token in self.end_ids:          # validate_tokens does not count an end token
            if not self.m.is_accepting():
                return False
        elif self.m.validate_tokens([token]) != 1:
            return False                   # refused: consuming it would leave the matcher in error for good
        before = self.m.deep_copy()
        if not self.m.consume_token(token) or self.m.is_error():
            self.m = before
            return False
        self.snapshots.append(before)
        if len(self.snapshots) > self.max_rollback:
            del self.snapshots[0]
        return True

    def accept_tokens(self, tokens: list[int]) -> bool:
        start, kept = self.m.deep_copy(), list(self.snapshots)
        for t in tokens:
            if not self._accept_one(int(t)):
                self.m, self.snapshots = start, kept      # no change, however long the run
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> int:
        start, kept = self.m.deep_copy(), list(self.snapshots)
        n = 0
        for t in tokens:
            if not self._accept_one(int(t)):
                break
            n += 1
        self.m, self.snapshots = start, kept
        return n

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        if num_tokens > len(self.snapshots):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only the last {len(self.snapshots)} are kept")
        self.m = self.snapshots[-num_tokens]
        del self.snapshots[-num_tokens:]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        keep = bitmask[row].copy()
        mine = np.zeros((1, bitmask.shape[1]), dtype=np.int32)
        fill_next_token_bitmask(self.m, mine, 0)
        bitmask[row] = keep & mine[0]
        if self.extra_words is not None:
            bitmask[row] &= self.extra_words

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def is_completed(self) -> bool:
        return self.m.is_accepting()
