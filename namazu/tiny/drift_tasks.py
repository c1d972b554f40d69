"""Request kinds the shipped drafter's traffic never had: what a deployment drifts into.

The shipped drafter (`make drafter-model`) was trained on the target's answers to the chat generators of
`data.py`: summaries and explanations of corpus passages, answers after a tool's result, read-backs. A new
customer brings other requests, and these three are built to be unlike those in content, not only in weight:

- `tool_call_request`: a request that a freshly composed tool (`synthetic_tools`, names and keys never seen)
  serves, the conversation ending at the user's turn, so the answer is the tool call itself (in the old
  traffic every tool conversation ended after the tool's result, and the answer was prose about it);
- `json_extraction`: a record described in a business form ("Customer name (customer_name): ..."), to be
  returned as JSON under `response_format` json_schema with a fresh schema, so the answer parses as JSON;
- `continuation`: the opening lines of a manual page or section and a request to continue it, so the answer
  is the target's own prose in the corpus' register rather than a chat answer.

Each returns (messages ending with the reference assistant turn, tools or None, response_format or None).
"""
from __future__ import annotations

import json
import random
from typing import Any

from namazu.tiny.synthetic_tools import _distinct_props, synthetic_tools
from namazu.tiny.tools import Prop, _object_schema, draw_value

Messages = list[dict[str, Any]]


def _mention(p: Prop, value: Any, lang: str) -> str:
    desc = p.ja if lang == "ja" else p.en
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return f"{desc}は{text}" if lang == "ja" else f"{desc} {text}"


def tool_call_request(rng: random.Random, lang: str, sentences: list[str]
                      ) -> tuple[Messages, list[dict[str, Any]], None]:
    """A request one of 2-4 fresh tools serves, every argument stated; the answer is the call."""
    tools = synthetic_tools(rng, rng.randint(2, 4))
    target = rng.choice(tools)
    args = {p.key: draw_value(p, rng, sentences) for p in target.props if p.required or rng.random() < 0.5}
    said = [_mention(p, args[p.key], lang) for p in target.props if p.key in args]
    if lang == "ja":
        ask = rng.choice((f"{target.ja}をお願いします。", f"至急、{target.ja}必要があります。",
                          f"{target.ja}手配をしてください。")) + "条件は、" + "、".join(said) + "です。"
    else:
        verb = target.en[0].lower() + target.en[1:]
        ask = rng.choice((f"Please {verb}.", f"We need to {verb} today.", f"Can you {verb}?")) + \
            " Details: " + "; ".join(said) + "."
    call = {"id": f"functions.{target.name}:0", "type": "function",
            "function": {"name": target.name, "arguments": json.dumps(args, ensure_ascii=False)}}
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    return messages, [t.openai(lang) for t in tools], None


def json_extraction(rng: random.Random, lang: str, sentences: list[str]
                    ) -> tuple[Messages, None, dict[str, Any]]:
    """A record in a form layout, to be returned as JSON under a json_schema response format."""
    props = tuple(Prop(**{**p.__dict__, "required": True}) for p in _distinct_props(rng, rng.randint(3, 6), depth=1))
    record = {p.key: draw_value(p, rng, sentences) for p in props}
    lines = "\n".join(f"{p.ja if lang == 'ja' else p.en} ({p.key}): "
                      f"{json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}"
                      for p, v in zip(props, record.values()))
    if lang == "ja":
        ask = rng.choice(("以下の申請内容を、指定のスキーマの JSON で返してください。",
                          "次の登録票を JSON に変換してください。",
                          "下記の項目をシステム登録用の JSON にしてください。"))
    else:
        ask = rng.choice(("Return this form as JSON in the given schema.", "Convert the record below to JSON.",
                          "Extract the fields of this ticket as a JSON object."))
    schema = _object_schema(props, lang, strict=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": f"{ask}\n{lines}"},
                {"role": "assistant", "content": json.dumps(record, ensure_ascii=False)}]
    return messages, None, fmt


def continuation(rng: random.Random, lang: str, documents: list[list[str]]) -> tuple[Messages, None, None]:
    """The first lines of a document and a request to go on; the reference answer is its next lines.
    `documents`: each document's lines, filtered once by the caller (`data._document_lines`)."""
    lines = rng.choice(documents)
    cut = rng.randint(2, min(5, max(2, len(lines) - 1)))
    head, tail = "\n".join(lines[:cut]), "\n".join(lines[cut:cut + 2])
    ask = rng.choice(("次の文書の続きを書いてください。", "この説明文の続きを作成してください。")) if lang == "ja" \
        else rng.choice(("Continue this document:", "Write the next part of this text:"))
    return [{"role": "user", "content": f"{ask}\n\n{head}"}, {"role": "assistant", "content": tail}], None, None
