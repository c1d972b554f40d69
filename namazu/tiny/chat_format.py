"""namazu-tiny's special tokens and Kimi-K2-style chat template, and `render_chat`.

A leaf module (json and jinja only): the data generator renders conversations with it and the tokenizer
trainer writes the template into tokenizer_config.json, without either importing the other.
"""
from __future__ import annotations

import json
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|end_of_text|>"
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_TOOL = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_tool|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
TOOL_SECTION_BEGIN, TOOL_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_ARG_BEGIN, TOOL_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MASK = "<|mask|>"
NUM_RESERVED = 8

# Ids 0..len-1, in this order, so they are stable across retrainings.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, BOS, EOT, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_TOOL, IM_MIDDLE, IM_END,
    TOOL_SECTION_BEGIN, TOOL_SECTION_END, TOOL_CALL_BEGIN, TOOL_ARG_BEGIN, TOOL_CALL_END, MASK,
) + tuple(f"<|reserved_{i}|>" for i in range(NUM_RESERVED))

# Kimi-K2-style template. Tools are declared one compact JSON object per line (the OpenAI `function`
# wrapper is dropped: it carries no information and costs a tiny model context). Tool-call ids are
# `functions.NAME:INDEX` as K2 emits them; ids of another shape are rebuilt so the model always sees one form.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>"
    "{%- for tool in tools -%}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\n' if not loop.last }}"
    "{%- endfor -%}"
    "<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(call_index=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "<|im_system|>system<|im_middle|>{{ render_content(message.content) }}<|im_end|>"
    "{%- elif message.role == 'user' -%}"
    "<|im_user|>user<|im_middle|>{{ render_content(message.content) }}<|im_end|>"
    "{%- elif message.role == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|>{{ render_content(message.content) }}"
    "{%- if message.tool_calls -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if call.id is defined and call.id is string and call.id.startswith('functions.') -%}"
    "{%- set call_id = call.id -%}"
    "{%- else -%}{%- set call_id = 'functions.' ~ fn.name ~ ':' ~ ns.call_index -%}{%- endif -%}"
    "<|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>"
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}<|tool_call_end|>"
    "{%- set ns.call_index = ns.call_index + 1 -%}"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- elif message.role == 'tool' -%}"
    "<|im_tool|>tool<|im_middle|>## Return of {{ message.tool_call_id }}\n"
    "{{ render_content(message.content) }}<|im_end|>"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role ' ~ message.role ~ '; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same semantics as transformers' override of jinja's tojson (no HTML escaping, non-ASCII kept).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_env.filters["tojson"] = _tojson
_env.globals["raise_exception"] = _raise
_template = _env.from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> str:
    """Renders a conversation exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does."""
    return _template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
