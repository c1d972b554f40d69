"""Tool calls in the Kimi-K2 format, under a grammar (REFERENCE.md section 8).

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}
    <|tool_call_end|> ... <|tool_calls_section_end|>

The markers are single special tokens, which xgrammar's text grammars never produce, so this grammar
is a small state machine over the markers that hands the text between them to xgrammar matchers:
the header `functions.NAME:INDEX` to a regex over the declared names, the arguments to the called
function's JSON schema. With tool_choice "required" or a named function the output must be a tool-call
section; with "auto" text is free (markers other than the section start excluded) until the model
opens a section, after which the same rules apply. parallel_tool_calls=False allows one call.

Nothing in the grammar is free to run on: the call index is a number of at most `INDEX_DIGITS` digits
without leading zeros (a model once wrote `functions.get_weather:0112011201...` for 250 tokens when
it was `[0-9]+`), and a section holds at most `MAX_CALLS` calls. The arguments are bounded by their schema.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from namazu.structured.grammar import StepwiseGrammar, ids_to_words, pack_allowed, token_mask_words
from namazu.structured.xgrammar_backend import GrammarSpec, XGrammarBackend

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)
INDEX_DIGITS = 3          # call indices 0 .. 999
MAX_CALLS = 32            # calls in one section


@dataclass(frozen=True)
class ToolCallSpec:
    """The tools a request declares (name -> compiled-spec of its arguments) and how calls are chosen."""

    functions: tuple[tuple[str, GrammarSpec], ...]
    choice: str                   # "auto", "required", or the one function's name
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.functions]


class ToolMarkers:
    """The marker token ids of a tokenizer; None if it lacks one (tool calls are then unsupported)."""

    def __init__(self, tokenizer: Any):
        ids = {m: tokenizer.token_to_id(m) for m in MARKERS}
        missing = [m for m, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"this model's tokenizer has no {', '.join(missing)} token; it cannot make "
                             "Kimi-K2 tool calls")
        self.section_begin, self.section_end = ids[SECTION_BEGIN], ids[SECTION_END]
        self.call_begin, self.arg_begin, self.call_end = ids[CALL_BEGIN], ids[ARG_BEGIN], ids[CALL_END]
        self.all = set(ids.values())


class ToolCallGrammar(StepwiseGrammar):
    depends_on_values = True

    def __init__(self, spec: ToolCallSpec, backend: XGrammarBackend, markers: ToolMarkers, token_bytes: list[bytes],
                 max_rollback: int):
        self.spec, self.backend, self.mk = spec, backend, markers
        self.token_bytes = token_bytes
        self.max_rollback = max_rollback
        self.args = dict(spec.functions)
        self.header_spec = self.header_spec_for(spec)
        vocab = backend.vocab_size
        self.stop_ids = backend.stop_ids
        text = np.ones(token_mask_words(vocab) * 32, dtype=bool)
        text[sorted(markers.all - {markers.section_begin})] = False
        self.text_words = pack_allowed(text)
        self.no_stop = pack_allowed(_all_but(vocab, self.stop_ids))
        self.state = "text" if spec.choice == "auto" else "expect_section"
        self.calls = 0
        self.sub: StepwiseGrammar | None = None
        self.header: list[int] = []
        self.undo: list[tuple] = []

    @staticmethod
    def header_spec_for(spec: ToolCallSpec) -> GrammarSpec:
        names = [spec.choice] if spec.choice not in ("auto", "required") else spec.names
        index = f"(0|[1-9][0-9]{{0,{INDEX_DIGITS - 1}}})"
        return GrammarSpec("regex", r"functions\.(" + "|".join(re.escape(n) for n in names) + r"):" + index)

    # -- transitions ------------------------------------------------------------------------------------
    def _allowed_markers(self) -> list[int]:
        mk, st = self.mk, self.state
        if st == "text":
            return [mk.section_begin]
        if st == "expect_section":
            return [mk.section_begin]
        if st == "section":
            more = self.calls < (MAX_CALLS if self.spec.parallel else 1)
            out = [mk.call_begin] if more else []
            return out + ([mk.section_end] if self.calls else [])
        if st == "header" and self.sub.is_completed():
            return [mk.arg_begin]
        if st == "args" and self.sub.is_completed():
            return [mk.call_end]
        return []

    def _accept_one(self, t: int) -> bool:
        mk, st = self.mk, self.state
        snapshot = ("state", st, self.calls, self.sub, list(self.header))
        if t in mk.all:
            if t not in self._allowed_markers():
                return False
            if t == mk.section_begin:
                self.state = "section"
            elif t == mk.call_begin:
                self.state, self.header = "header", []
                self.sub = self.backend.matcher(self.header_spec, self.max_rollback, terminate_without_stop=False)
            elif t == mk.arg_begin:
                name = b"".join(self.token_bytes[i] for i in self.header).decode("utf-8").split(".", 1)[1]
                name = name.rsplit(":", 1)[0]
                self.state = "args"
                self.sub = self.backend.matcher(self.args[name], self.max_rollback)
            elif t == mk.call_end:
                self.state, self.calls, self.sub = "section", self.calls + 1, None
            elif t == mk.section_end:
                self.state, self.sub = "done", None
            self.undo.append(snapshot)
            return True
        if t in self.stop_ids:
            if st in ("done",) or (st == "text"):
                self.state = "terminated"
                self.undo.append(snapshot)
                return True
            return False
        if st == "text":
            self.undo.append(("text",))
            return True
        if st in ("header", "args"):
            if not self.sub.accept_tokens([t]):
                return False
            if st == "header":
                self.header.append(t)
            self.undo.append(("sub",))
            return True
        return False

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self.undo):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self.undo)} accepted")
        for _ in range(num_tokens):
            rec = self.undo.pop()
            if rec[0] == "sub":
                self.sub.rollback(1)
                if self.state == "header":
                    self.header.pop()
            elif rec[0] == "state":
                _, self.state, self.calls, self.sub, self.header = rec

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        st = self.state
        if st == "text":
            bitmask[row] &= self.text_words
            return
        if st in ("header", "args"):
            mine = np.full_like(bitmask[row:row + 1], -1)
            self.sub.fill_bitmask(mine, 0)
            mine[0] &= self.no_stop              # the sub-grammar ends with a marker, not an end token
            for t in self._allowed_markers():
                mine[0, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            bitmask[row] &= mine[0]
            return
        ids = self._allowed_markers() + (list(self.stop_ids) if st == "done" else [])
        bitmask[row] &= ids_to_words(ids, self.backend.vocab_size)

    def is_terminated(self) -> bool:
        return self.state == "terminated"


def _all_but(vocab: int, ids: list[int]) -> np.ndarray:
    allowed = np.ones(token_mask_words(vocab) * 32, dtype=bool)
    allowed[list(ids)] = False
    return allowed


def tool_call_constraint(tools: list[dict[str, Any]] | None, tool_choice: Any = "auto",
                         parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """OpenAI `tools` + `tool_choice` -> `SamplingParams.tool_calls`, or None when calls are off
    (no tools, or tool_choice "none"). Raises ValueError for a malformed choice."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        choice = name
    elif tool_choice in ("auto", "required"):
        choice = tool_choice
    else:
        raise ValueError(f"tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' or a named function")
    functions = []
    for t in tools:
        f = t.get("function", t)
        functions.append({"name": f["name"], "parameters": f.get("parameters") or {"type": "object"},
                          "strict": bool(f.get("strict", False))})
    return {"functions": functions, "tool_choice": choice, "parallel_tool_calls": parallel_tool_calls}
