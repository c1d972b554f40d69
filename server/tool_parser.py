"""Kimi-K2 tool-call sections -> OpenAI `tool_calls`, incrementally (REFERENCE.md section 8).

The model writes
  <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}
  <|tool_call_end|>...<|tool_calls_section_end|>
The parser is a small state machine over the decoded text (special tokens kept). Text before the section
is content; each call becomes one `tool_calls` entry with id `functions.NAME:INDEX`, the name between the
last '.' and the ':', and the argument JSON streamed as it arrives. A tail that could be the start of a
marker is held back until the next delta decides it. The end-of-turn token's text is dropped. Marker
text never reaches `content`: a call whose name never completes (output cut off) is dropped, one cut
off inside its arguments keeps the partial arguments (finish_reason then says "length"), and a call to
a function the request did not declare is dropped (the tool-call grammar makes both rare: only
max_tokens can cut a call).
"""
from __future__ import annotations

from typing import Any

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


def _held_tail(buf: str, markers: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of the markers."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallParser:
    def __init__(self, tokenizer: Any = None, declared: set[str] | None = None):
        eos = getattr(tokenizer, "eos_token", None)
        self.drop = [eos] if eos else []
        self.declared = declared
        self.skipping = False           # inside the arguments of an undeclared function
        self.state = "content"          # content | section | header | args
        self.buf = ""
        self.header = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Consumes a text delta; returns (content delta, tool_calls deltas in the streaming shape)."""
        self.buf += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self.state == "content":
                cut = self._find([SECTION_BEGIN, *self.drop])
                if cut is None:
                    keep = 0 if final else _held_tail(self.buf, [SECTION_BEGIN, *self.drop])
                    content.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                pos, marker = cut
                content.append(self.buf[:pos])
                self.buf = self.buf[pos + len(marker):]
                if marker == SECTION_BEGIN:
                    self.state = "section"
            elif self.state == "section":
                cut = self._find([CALL_BEGIN, SECTION_END])
                if cut is None:
                    break
                pos, marker = cut
                self.buf = self.buf[pos + len(marker):]
                self.state = "header" if marker == CALL_BEGIN else "content"
            elif self.state == "header":
                cut = self._find([ARG_BEGIN])
                if cut is None:
                    if final:
                        self.buf = ""       # cut off before the call's name was complete: no call
                    break
                pos, _ = cut
                self.header = self.buf[:pos].strip()
                self.buf = self.buf[pos + len(ARG_BEGIN):]
                name = self.header.split(":", 1)[0].rsplit(".", 1)[-1]
                self.skipping = self.declared is not None and name not in self.declared
                if not self.skipping:
                    calls.append({"index": self.num_calls, "id": self.header, "type": "function",
                                  "function": {"name": name, "arguments": ""}})
                    self.num_calls += 1
                self.state = "args"
            else:   # args
                cut = self._find([CALL_END])
                if cut is None:
                    keep = 0 if final else _held_tail(self.buf, [CALL_END])
                    self._args(calls, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                pos, _ = cut
                self._args(calls, self.buf[:pos])
                self.buf = self.buf[pos + len(CALL_END):]
                self.state = "section"
        return "".join(content), calls

    def _args(self, calls: list[dict[str, Any]], text: str) -> None:
        if not text or self.skipping:
            return
        idx = self.num_calls - 1
        if calls and calls[-1]["index"] == idx:
            calls[-1]["function"]["arguments"] += text
        else:
            calls.append({"index": idx, "function": {"arguments": text}})

    def _find(self, markers: list[str]) -> tuple[int, str] | None:
        hits = [(self.buf.find(m), m) for m in markers]
        hits = [(p, m) for p, m in hits if p >= 0]
        return min(hits) if hits else None

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Whole-output form: (content or None when only tool calls, complete tool_calls)."""
        content, deltas = self.feed(text, final=True)
        calls: list[dict[str, Any]] = []
        for d in deltas:
            if "id" in d:
                calls.append({"id": d["id"], "type": "function",
                              "function": {"name": d["function"]["name"], "arguments": ""}})
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        content = content.strip() if calls else content
        return (content or None) if calls else content, calls

    @property
    def in_call(self) -> bool:
        """Inside a tool-call section (content after it is not expected)."""
        return self.state != "content"
