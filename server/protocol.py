"""OpenAI request bodies -> typed requests + SamplingParams, with an error that names the bad field.

Reading is strict the way the OpenAI API is: a field of the wrong JSON type is a 422 naming it, a value
out of range or a feature this server does not have (`suffix`, `logit_bias`, image parts) is a 400 naming
it, and an unknown field is a 400 rather than being silently ignored. Fields the API accepts but that
change nothing here (`user`, `metadata`, ...) are accepted and ignored.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from namazu.sampling_params import INT64_MAX, TOP_K_MAX, SamplingParams
from server.errors import APIError, invalid, wrong_type

MAX_N = 128
INT64_MIN = -(2**63)
MAX_STOP = 16
# Fields OpenAI defines that namazu accepts and does not act on, with their JSON type: each is type-checked
# like any other field (a request the API document calls invalid is refused), then ignored. The document
# (server/openapi.py) describes them from this table. (json type, element type of an array, null allowed)
IGNORED_FIELDS: dict[str, tuple[str, str | None, bool]] = {
    "user": ("string", None, False),
    "metadata": ("object", None, True),
    "store": ("boolean", None, True),
    "service_tier": ("string", None, True),
    "parallel_tool_calls": ("boolean", None, True),
    "modalities": ("array", "string", True),
}
_PY_TYPES = {"string": str, "object": dict, "boolean": bool, "array": list}


class Fields:
    """Typed access to one JSON object's fields; remembers which were read so leftovers are refused."""

    def __init__(self, body: Any, what: str = "request body"):
        if not isinstance(body, dict):
            raise APIError(422, f"the {what} must be a JSON object, got {type(body).__name__}",
                           code="invalid_type")
        self.body = body
        self.seen: set[str] = set(IGNORED_FIELDS)
        for name, (json_type, item_type, nullable) in IGNORED_FIELDS.items():
            if name in body:
                _check_ignored(name, body[name], json_type, item_type, nullable)

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def int(self, name: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        v = self.raw(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise wrong_type(name, "an integer", v)
        # Every integer the engine keeps lives in an int64 array; nothing wider can mean anything.
        _check_range(name, v, INT64_MIN if lo is None else lo, INT64_MAX if hi is None else hi)
        return v

    def number(self, name: str, default: float | None = None, lo: float | None = None,
               hi: float | None = None) -> float | None:
        v = self.raw(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise wrong_type(name, "a number", v)
        if isinstance(v, int) and abs(v) > 2**53:
            raise invalid(f"'{name}' = {v} is out of range", name)
        if not math.isfinite(v):
            raise invalid(f"'{name}' must be a finite number", name)
        _check_range(name, v, lo, hi)
        return float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.raw(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise wrong_type(name, "a boolean", v)
        return v

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self.raw(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise wrong_type(name, "a string", v)
        return v

    def int_list(self, name: str) -> list[int] | None:
        v = self.raw(name)
        if v is None:
            return None
        if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
            raise wrong_type(name, "an array of integers", v)
        return v

    def stop(self) -> list[str]:
        v = self.raw("stop")
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or any(not isinstance(s, str) for s in v):
            raise wrong_type("stop", "a string or an array of strings", v)
        if len(v) > MAX_STOP:
            raise invalid(f"'stop' has {len(v)} sequences; at most {MAX_STOP} are allowed", "stop")
        if any(s == "" for s in v):
            raise invalid("'stop' sequences must be non-empty strings", "stop")
        return v

    def finish(self) -> None:
        unknown = sorted(set(self.body) - self.seen)
        if unknown:
            raise invalid(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])


def _check_ignored(name: str, v: Any, json_type: str, item_type: str | None, nullable: bool) -> None:
    if v is None and nullable:
        return
    what = f"an array of {item_type}s" if item_type else f"a {json_type}" if json_type != "object" else "an object"
    if not isinstance(v, _PY_TYPES[json_type]) or (item_type and not all(isinstance(x, _PY_TYPES[item_type])
                                                                          for x in v)):
        raise wrong_type(name, what + (" or null" if nullable else ""), v)


def _check_range(name: str, v: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise invalid(f"'{name}' = {v} is out of range; it must be in [{lo_s}, {hi_s}]", name)


@dataclass
class SamplingFields:
    """What both endpoints share, read before the endpoint-specific fields."""

    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    priority: int                    # lower runs first under --scheduling-policy priority
    kwargs: dict[str, Any]


def _read_sampling(f: Fields) -> SamplingFields:
    bias = f.raw("logit_bias")
    if bias is not None and not isinstance(bias, dict):      # false, 0, "" and [] are not a bias map either
        raise wrong_type("logit_bias", "an object mapping token ids to biases", bias)
    if bias:
        raise invalid("'logit_bias' is not supported by this server", "logit_bias")
    if f.has("best_of") and f.int("best_of", lo=1) != f.int("n", 1):
        raise invalid("'best_of' is not supported (only best_of == n)", "best_of")
    n = f.int("n", 1, lo=1, hi=MAX_N)
    stream = f.bool("stream")
    include_usage = False
    opts = f.raw("stream_options")
    if opts is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        o = Fields(opts, "'stream_options' object")
        include_usage = o.bool("include_usage")
        o.raw("continuous_usage_stats")
        o.finish()
    seed = f.int("seed", None, lo=0, hi=2**63 - 1)
    kwargs: dict[str, Any] = dict(
        temperature=f.number("temperature", 1.0, lo=0.0, hi=2.0),
        top_p=f.number("top_p", 1.0, lo=0.0, hi=1.0),
        top_k=f.int("top_k", 0, lo=-1, hi=TOP_K_MAX),
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        presence_penalty=f.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, lo=0.0, hi=1e6),
        stop=f.stop(),
        stop_token_ids=f.int_list("stop_token_ids"),
        ignore_eos=f.bool("ignore_eos"),
        min_tokens=f.int("min_tokens", 0, lo=0),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        include_stop_str_in_output=f.bool("include_stop_str_in_output"),
    )
    if kwargs["top_p"] == 0.0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    # Extra (non-OpenAI) parameters: constrain the output to a regex or an EBNF grammar.
    for name in ("regex", "grammar"):
        v = f.str(name)
        if v is not None:
            if not v:
                raise invalid(f"'{name}' must not be empty", name)
            kwargs[name] = v
    priority = f.int("priority", 0)
    return SamplingFields(n=n, seed=seed, stream=stream, include_usage=include_usage, priority=priority,
                          kwargs=kwargs)


def make_sampling_params(s: SamplingFields, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None, vocab_size: int) -> SamplingParams:
    """SamplingParams from the read fields; its own validation errors become 400s naming the field."""
    try:
        params = SamplingParams(n=s.n, seed=s.seed, max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, **s.kwargs)
        params.check_vocab(vocab_size)
    except ValueError as e:
        m = re.match(r"SamplingParams\.(\w+)", str(e))
        raise invalid(str(e), m.group(1) if m else None) from None
    return params


# -- /v1/completions ------------------------------------------------------------------------------------
@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    max_tokens: int                  # 0 only with echo: score the prompt, generate nothing
    echo: bool
    logprobs: int | None
    sampling: SamplingFields


def parse_completion(body: Any, max_logprobs: int) -> CompletionRequest:
    f = Fields(body)
    model = f.str("model")
    if f.raw("suffix"):
        raise invalid("'suffix' (fill-in-the-middle) is not supported: namazu's models only continue "
                      "text left to right; put everything in 'prompt'", "suffix", code="unsupported_parameter")
    prompts = _read_prompts(f.raw("prompt"))
    echo = f.bool("echo")
    logprobs = f.int("logprobs", None, lo=0, hi=max_logprobs)
    max_tokens = f.int("max_tokens", 16, lo=0)
    if max_tokens == 0 and not echo:
        raise invalid("'max_tokens' must be at least 1 (0 is only allowed with 'echo', to score the "
                      "prompt)", "max_tokens")
    sampling = _read_sampling(f)
    if max_tokens == 0 and sampling.stream:
        raise invalid("'max_tokens' = 0 cannot be streamed", "max_tokens")
    f.finish()
    return CompletionRequest(model, prompts, max_tokens, echo, logprobs, sampling)


def _read_prompts(p: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if p is None:
        raise APIError(422, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif is_ids(p) and p:
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (is_ids(x) and x) for x in p):
        prompts = list(p)
    else:
        raise wrong_type("prompt", "a string, an array of strings, an array of token ids or an array of "
                                   "token-id arrays (all non-empty)", p)
    if any(isinstance(x, str) and not x for x in prompts):
        raise invalid("'prompt' must not be an empty string", "prompt")
    return prompts


# -- /v1/chat/completions -------------------------------------------------------------------------------
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str                 # "none", "auto", "required" or the name of one declared function
    parallel_tool_calls: bool
    max_tokens: int | None           # None: up to the end of the context
    logprobs: bool
    top_logprobs: int | None
    sampling: SamplingFields


def parse_chat(body: Any, max_logprobs: int) -> ChatRequest:
    f = Fields(body)
    model = f.str("model")
    messages = _read_messages(f.raw("messages"))
    max_tokens = f.int("max_tokens", None, lo=1)
    mct = f.int("max_completion_tokens", None, lo=1)
    if mct is not None:
        max_tokens = mct
    logprobs = f.bool("logprobs")
    top = f.int("top_logprobs", None, lo=0, hi=min(20, max_logprobs))
    if top is not None and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    tools = _read_tools(f.raw("tools"))
    tool_choice = _read_tool_choice(f.raw("tool_choice"), tools)
    parallel = f.bool("parallel_tool_calls", True)
    structured = _read_response_format(f.raw("response_format"))
    sampling = _read_sampling(f)
    f.finish()
    constraints = [k for k in ("regex", "grammar") if k in sampling.kwargs] + list(structured)[:1]
    if tool_choice != "none":
        constraints.append("tools")
    if len(constraints) > 1:
        raise invalid(f"'{constraints[0]}' and '{constraints[1]}' both constrain the output; a request may use "
                      "one (for tools with a JSON answer, use tool_choice 'none' or drop response_format)",
                      "response_format" if structured else constraints[1])
    sampling.kwargs.update(structured)
    return ChatRequest(model, messages, tools, tool_choice, parallel, max_tokens, logprobs,
                       (top or 0) if logprobs else None, sampling)


def _read_response_format(v: Any) -> dict[str, Any]:
    """response_format -> SamplingParams keywords: {} (text), json_object, or json_schema + strict."""
    if v is None:
        return {}
    r = Fields(v, "'response_format' object")
    kind = r.str("type", "text")
    if kind == "text":
        r.finish()
        return {}
    if kind == "json_object":
        r.finish()
        return {"json_object": True}
    if kind != "json_schema":
        raise invalid(f"'response_format.type' = {kind!r}; expected 'text', 'json_object' or 'json_schema'",
                      "response_format.type")
    js = r.raw("json_schema")
    r.finish()
    if not isinstance(js, dict):
        raise wrong_type("response_format.json_schema", "an object with 'name' and 'schema'", js)
    j = Fields(js, "'response_format.json_schema' object")
    name = j.str("name")
    if name is None or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise invalid("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                      "response_format.json_schema.name")
    j.str("description")
    schema = j.raw("schema")
    strict = j.bool("strict", False)
    j.finish()
    if schema is None:
        schema = {}
    if not isinstance(schema, (dict, bool)):
        raise wrong_type("response_format.json_schema.schema", "a JSON-schema object", schema)
    return {"json_schema": schema, "json_schema_strict": strict}


# The fields of a chat message; those the template does not use (an assistant message's `refusal`,
# `audio`, `annotations`, `reasoning_content` echoed back from an earlier answer) are accepted and ignored.
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio",
                           "annotations", "function_call", "reasoning_content", "reasoning"})


def _read_messages(v: Any) -> list[dict[str, Any]]:
    if v is None:
        raise APIError(422, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(v, list):
        raise wrong_type("messages", "an array of message objects", v)
    if not v:
        raise invalid("'messages' must contain at least one message", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise wrong_type(where, "an object", m)
        unknown = sorted(set(m) - _MESSAGE_KEYS)
        if unknown:         # refused as unknown top-level fields are, not silently dropped
            raise invalid(f"'{where}' has unknown field(s) {unknown[:5]}; a message has {sorted(_MESSAGE_KEYS)}",
                          f"{where}.{unknown[0]}")
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"'{where}.role' = {role!r}; expected one of {list(_ROLES)}", f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise APIError(422, f"'{where}.content' is required for role {role!r}",
                               param=f"{where}.content", code="missing_required_parameter")
            msg["content"] = ""
        elif isinstance(content, str):
            msg["content"] = content
        elif isinstance(content, list):
            msg["content"] = _text_parts(content, f"{where}.content")
        else:
            raise wrong_type(f"{where}.content", "a string or an array of content parts", content)
        calls = _read_tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
        if role == "assistant" and calls:
            msg["tool_calls"] = calls
        tcid = _optional_string(m.get("tool_call_id"), f"{where}.tool_call_id")
        if role == "tool":
            if tcid is None:
                raise APIError(422, f"'{where}.tool_call_id' (a string) is required for role 'tool'",
                               param=f"{where}.tool_call_id", code="missing_required_parameter")
            msg["tool_call_id"] = tcid
        name = _optional_string(m.get("name"), f"{where}.name")
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


def _optional_string(v: Any, where: str) -> str | None:
    """A message's optional string field: absent or null is None; any other non-string is refused, for
    every role (the document types it whether or not the role uses it)."""
    if v is not None and not isinstance(v, str):
        raise wrong_type(where, "a string", v)
    return v


def _read_tool_calls(v: Any, where: str) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise wrong_type(where, "an array of {id, type, function} objects", v)
    for j, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise wrong_type(f"{where}[{j}]", "an {id, type, function} object", c)
        for key in ("id", "type"):
            _optional_string(c.get(key), f"{where}[{j}].{key}")
        for key in ("name", "arguments"):
            _optional_string(c["function"].get(key), f"{where}[{j}].function.{key}")
    return v


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise wrong_type(f"{where}[{j}]", "a content part object with a 'type'", p)
        if p["type"] != "text":
            raise invalid(f"'{where}[{j}]' has type {p['type']!r}; this server only accepts text parts",
                          f"{where}[{j}].type")
        if not isinstance(p.get("text"), str):
            raise wrong_type(f"{where}[{j}].text", "a string", p.get("text"))
        texts.append(p["text"])
    return "".join(texts)


def _read_tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise wrong_type("tools", "an array of tool objects", v)
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(f"'tools[{i}]' must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = t["function"].get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise invalid(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_' or '-'",
                          f"tools[{i}].function.name")
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise wrong_type(f"tools[{i}].function.parameters", "a JSON-schema object", params)
        strict = t["function"].get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise wrong_type(f"tools[{i}].function.strict", "a boolean", strict)
    names = [t["function"]["name"] for t in v]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"'tools[{i}].function.name' = {name!r} is declared twice; tool names must be unique",
                          f"tools[{i}].function.name")
    return v or None


def _read_tool_choice(v: Any, tools: list[dict[str, Any]] | None) -> str:
    if v is None:
        return "auto" if tools else "none"
    if v in ("none", "auto", "required"):
        if v != "none" and not tools:
            raise invalid(f"'tool_choice' is {v!r} but no 'tools' were given", "tool_choice")
        return v
    if isinstance(v, dict):
        fn = v.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if v.get("type") != "function" or not isinstance(name, str):
            raise invalid("'tool_choice' must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in [t["function"]["name"] for t in tools or []]:
            raise invalid(f"'tool_choice' names the function {name!r}, which is not among 'tools'", "tool_choice")
        return name
    raise invalid(f"'tool_choice' = {json.dumps(v)}; expected 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
