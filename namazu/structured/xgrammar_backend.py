"""xgrammar behind the grammar seam: one compiler per tokenizer, a bounded cache of compiled grammars,
and `MatcherGrammar`, the `Grammar` protocol over one xgrammar matcher. JSON schemas with objects
open to undeclared properties go to llguidance instead, by the rule `llguidance_backend.py` states.

The tokenizer is described to xgrammar by each token's raw bytes. Special tokens are given no bytes,
which xgrammar reads as "never part of grammar text": a JSON string can then never contain an end
token or a tool-call marker. Tool-call markers are handled around xgrammar (`tool_calls.py`).

Compiling is the slow part (milliseconds to seconds for a large schema); it happens once per distinct
grammar text (the cache key), before the request reaches the step loop (`AsyncEngine` compiles on a
worker thread, so only that request waits).
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from namazu.structured.grammar import StepwiseGrammar, token_mask_words
from namazu.structured.json_schema import normalize_json_schema_unordered

MAX_GRAMMAR_BYTES = 256 * 1024   # a bound on compile work per request
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: kind is json_schema, json_object, regex or ebnf; text is its source."""

    kind: str
    text: str = ""
    compiler: str = ""     # "llguidance" where only llguidance enforces the schema; "" = by the rule
    free_order: str = ""   # the schema before any_order.py, where free_order.py should take its keys in any order
    free_order_strict: bool = False   # a free-order grammar that cannot be written is a refusal (strict)


class XGrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], cache_size: int = 512):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        special = set(tokenizer.special_ids)
        encoded = [b"" if i in special or i >= tokenizer.vocab_size else tokenizer.token_bytes(i)
                   for i in range(vocab_size)]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # JSON forbids raw control characters anywhere (strings included), and with fixed separators no
        # whitespace but the space is needed between tokens: tokens holding such bytes are never allowed.
        allowed = np.ones(token_mask_words(vocab_size) * 32, dtype=bool)
        for i, b in enumerate(encoded):
            if any(c < 0x20 for c in b):
                allowed[i] = False
        from namazu.structured.grammar import pack_allowed

        self.json_words = pack_allowed(allowed)
        self.llg = None
        try:
            from namazu.structured.llguidance_backend import LLGuidanceCompiler

            self.llg = LLGuidanceCompiler(tokenizer, vocab_size, self.stop_ids)
        except (ImportError, ValueError) as err:      # not installed, or not a tokenizer it reads
            log.info("llguidance not used (%s): every JSON schema goes to xgrammar", err)
        self.cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.cache_size = cache_size
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """(compiler, compiled grammar), cached by spec; ValueError naming the problem if it cannot compile."""
        with self._lock:
            if spec in self.cache:
                self.cache.move_to_end(spec)
                self.hits += 1
                return self.cache[spec]
            self.misses += 1
        if len(spec.text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the {spec.kind} is {len(spec.text)} characters; at most {MAX_GRAMMAR_BYTES} bytes")
        compiled = self._compile_free_order(spec)
        tried_llguidance = False
        if spec.kind == "json_schema" and self.llg is not None and compiled is None:
            from namazu.structured.llguidance_backend import prefers_llguidance

            if spec.compiler == "llguidance":       # only llguidance enforces it: its refusal is final
                compiled = ("llguidance", self.llg.compile(spec.text))
            elif prefers_llguidance(json.loads(spec.text)):
                tried_llguidance = True
                try:
                    compiled = ("llguidance", self.llg.compile(spec.text))
                except ValueError as err:           # xgrammar takes it, its open objects closed
                    log.debug("llguidance refused a schema, xgrammar compiles it closed: %s", err)
        if compiled is None and spec.compiler == "llguidance":
            raise ValueError("the JSON schema needs llguidance (lengths beside a pattern), which is not installed")
        if compiled is None:
            try:
                compiled = ("xgrammar", self._compile_xgrammar(spec))
            except ValueError as err:
                # xgrammar refuses some schemas llguidance enforces (an integer bound past 2**63, say)
                if spec.kind != "json_schema" or self.llg is None or tried_llguidance:
                    raise
                try:
                    compiled = ("llguidance", self.llg.compile(spec.text))
                except ValueError:
                    raise err from None
        with self._lock:
            self.cache[spec] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _compile_free_order(self, spec: GrammarSpec) -> Any:
        """llguidance's grammar with objects' keys in any order (free_order.py), or None: not needed,
        llguidance not installed, or a schema it cannot write (the ordinary path then fixes the order)."""
        if spec.kind != "json_schema" or not spec.free_order or self.llg is None:
            return None
        from namazu.structured.free_order import lark_grammar

        try:
            text = lark_grammar(json.loads(spec.free_order))
            if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
                raise ValueError(f"the free-order grammar is {len(text)} characters")
            return ("llguidance", self.llg.compile_lark(text))
        except ValueError as err:
            if spec.free_order_strict:      # refused by name rather than served with one key order only
                detail = " ".join(re.split(r"\n\s*\d+ \|", str(err))[0].split())[:400]   # not llguidance's listing
                raise ValueError("the schema's objects cannot take their keys in any order (JSON Schema gives "
                                 f"keys no order; not strict, they follow the schema's order): {detail}") from None
            log.debug("keys in the schema's order, the free-order grammar was not written: %s", err)
            return None

    def _compile_xgrammar(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                # The schema is normalized (json_schema.py). An object it leaves open goes to llguidance
                # (llguidance_backend.py); one that reaches xgrammar is closed, as xgrammar's open objects
                # admit an undeclared key spelled with \u escapes that parses as a declared one.
                from namazu.structured.llguidance_backend import close_open_objects

                text = json.dumps(close_open_objects(json.loads(spec.text)), ensure_ascii=False)
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=False)
            elif spec.kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                             strict_mode=False)
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.text)
            elif spec.kind == "ebnf":
                compiled = self.compiler.compile_grammar(spec.text)
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
        except ValueError:
            raise
        except Exception as err:   # xgrammar raises RuntimeError (and its own types) for bad input
            raise ValueError(f"the {spec.kind.replace('_', ' ')} does not compile: {err}") from None
        return compiled

    def matcher(self, spec: GrammarSpec, max_rollback: int, terminate_without_stop: bool = False
                ) -> StepwiseGrammar:
        which, compiled = self.compile(spec)
        words = self.json_words if spec.kind in ("json_schema", "json_object") else None
        if which == "llguidance":
            from namazu.structured.llguidance_backend import LLMatcherGrammar

            return LLMatcherGrammar(compiled, self.stop_ids, words, max_rollback)
        return MatcherGrammar(self.xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback,
                                                      terminate_without_stop_token=terminate_without_stop),
                              words)

    def compiler_for(self, spec: GrammarSpec) -> str:
        """Which compiler serves the spec ('xgrammar' or 'llguidance')."""
        return self.compile(spec)[0]

    @property
    def stats(self) -> dict[str, int]:
        return {"grammar_cache_hits": self.hits, "grammar_cache_misses": self.misses,
                "grammar_cache_size": len(self.cache)}


def json_schema_spec(schema: Any, strict: bool = True) -> GrammarSpec:
    """Checks a JSON schema (a dict or its JSON text) and returns the spec of the schema namazu compiles
    for it (`json_schema.prepare_json_schema`); ValueError says why not. Not strict, constraints namazu
    cannot enforce are dropped (and logged) instead of refused."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
    from namazu.structured.free_order import needs_free_order

    prepared, unordered, needs_llguidance = normalize_json_schema_unordered(schema, strict)
    free = needs_free_order(unordered)
    return GrammarSpec("json_schema", json.dumps(prepared, ensure_ascii=False),   # property order matters
                       "llguidance" if needs_llguidance else "",
                       json.dumps(unordered, ensure_ascii=False) if free else "", strict and free)


class MatcherGrammar(StepwiseGrammar):
    """The `Grammar` protocol over one xgrammar matcher (one per sequence)."""

    depends_on_values = True

    def __init__(self, matcher: Any, extra_words: np.ndarray | None = None):
        self.m = matcher
        self.extra_words = extra_words
        self._row: np.ndarray | None = None

    def _accept_one(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        keep = bitmask[row].copy()
        self.m.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= keep
        if self.extra_words is not None:
            bitmask[row] &= self.extra_words

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (the grammar may end here)."""
        return self.m.is_completed()
