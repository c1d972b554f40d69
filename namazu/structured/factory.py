"""Which grammar a request gets, from its sampling settings, and the engine's structured-output state.

`allowed_token_ids`, `bad_words_ids` and `min_tokens` need no compiler. A JSON schema, JSON object, regex, EBNF grammar
or tool-call constraint is compiled by xgrammar (`StructuredOutputs`, created on first use so that a
server that never sees one never imports xgrammar); `compile` checks and compiles a request's grammar
ahead of time (the async front runs it off the step loop), `grammar_for` then only builds matchers.
"""
from __future__ import annotations

from typing import Any

from namazu.sampling_params import SamplingParams
from namazu.structured.bad_words import BadWordsGrammar
from namazu.structured.grammar import AllOf, Grammar, MinTokensGrammar, TokenSetGrammar


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_rollback: int):
        from namazu.structured.xgrammar_backend import XGrammarBackend

        self.tokenizer = tokenizer
        self.backend = XGrammarBackend(tokenizer, vocab_size, stop_ids)
        self.max_rollback = max_rollback
        self._markers = None
        self._token_bytes: list[bytes] | None = None

    def spec(self, params: SamplingParams) -> Any:
        """The compile key of a request's grammar (GrammarSpec or ToolCallSpec), or None."""
        from namazu.structured.tool_calls import ToolCallSpec
        from namazu.structured.xgrammar_backend import GrammarSpec, json_schema_spec

        if params.json_schema is not None:
            return json_schema_spec(params.json_schema, strict=params.json_schema_strict)
        if params.json_object:
            return GrammarSpec("json_object")
        if params.regex is not None:
            return GrammarSpec("regex", params.regex)
        if params.grammar is not None:
            return GrammarSpec("ebnf", params.grammar)
        if params.tool_calls is not None:
            tc = params.tool_calls
            functions = []
            for f in tc["functions"]:
                schema = f.get("parameters") or {"type": "object"}
                functions.append((f["name"], json_schema_spec(schema, strict=bool(f.get("strict")))))
            names = [n for n, _ in functions]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"tools: the function name(s) {dup} are declared more than once")
            choice = tc.get("tool_choice", "auto")
            if choice not in ("auto", "required") and choice not in names:
                raise ValueError(f"tool_choice names the function {choice!r}, which is not among the tools {names}")
            return ToolCallSpec(tuple(functions), choice, bool(tc.get("parallel_tool_calls", True)))
        return None

    def compile(self, params: SamplingParams) -> None:
        """Checks and compiles a request's grammar (cached); ValueError says what is wrong."""
        from namazu.structured.tool_calls import ToolCallGrammar, ToolCallSpec

        spec = self.spec(params)
        if isinstance(spec, ToolCallSpec):
            _ = self.markers                       # the tokenizer must have the markers
            for _name, fspec in spec.functions:
                self.backend.compile(fspec)
            self.backend.compile(ToolCallGrammar.header_spec_for(spec))
        elif spec is not None:
            self.backend.compile(spec)

    @property
    def markers(self) -> Any:
        if self._markers is None:
            from namazu.structured.tool_calls import ToolMarkers

            self._markers = ToolMarkers(self.tokenizer)
        return self._markers

    def grammar(self, params: SamplingParams) -> Grammar | None:
        from namazu.structured.tool_calls import ToolCallGrammar, ToolCallSpec

        spec = self.spec(params)
        if spec is None:
            return None
        if isinstance(spec, ToolCallSpec):
            if self._token_bytes is None:
                b = self.tokenizer
                self._token_bytes = [b"" if i in b.special_ids or i >= b.vocab_size else b.token_bytes(i)
                                     for i in range(self.backend.vocab_size)]
            return ToolCallGrammar(spec, self.backend, self.markers, self._token_bytes, self.max_rollback)
        return self.backend.matcher(spec, self.max_rollback)


def needs_compiler(params: SamplingParams) -> bool:
    return any(x is not None for x in (params.json_schema, params.regex, params.grammar, params.tool_calls)) \
        or params.json_object


def grammar_for(params: SamplingParams, end_ids: list[int], vocab_size: int,
                structured: StructuredOutputs | None = None) -> Grammar | None:
    """A fresh grammar for one sequence, or None when its sampling is unconstrained. `end_ids` are the
    model's end tokens (banned under min_tokens unless ignore_eos)."""
    parts: list[Grammar] = []
    if needs_compiler(params):
        assert structured is not None, "a compiled grammar was asked for without the structured-output backend"
        parts.append(structured.grammar(params))
    if params.grammar_factory is not None:
        parts.append(params.grammar_factory())
    if params.allowed_token_ids is not None:
        parts.append(TokenSetGrammar(params.allowed_token_ids, vocab_size))
    if params.bad_words_ids:
        parts.append(BadWordsGrammar(params.bad_words_ids, vocab_size))
    if params.min_tokens > 0:
        banned = list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(end_ids))
        if banned:
            parts.append(MinTokensGrammar(params.min_tokens, banned, vocab_size))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(parts)
