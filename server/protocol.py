"""OpenAI request bodies -> typed requests + SamplingParams, with an error that names the bad field.

A field of the wrong JSON type is a 422 naming it; a value out of range or a feature this server does not
have (`suffix`, image parts, beam search) is a 400 naming it. vLLM's extra fields are read with
vLLM's meaning (server/vllm_fields.py). A field nobody knows is, as in vLLM, logged and ignored by default;
with `strict` (the server's `--strict-fields`) it is a 400 naming it. Fields the API accepts but that change
nothing here (`user`, `metadata`, ...) are accepted and ignored.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from namazu.sampling_params import TOP_K_MAX, SamplingParams
from server.errors import APIError, invalid, wrong_type
from server.fields import Fields
from server.vllm_fields import (
    Extras,
    legacy_functions,
    read_cache_salt,
    read_constraints,
    read_extras,
    read_logit_bias,
    read_reasoning_effort,
    read_template_kwargs,
)

logger = logging.getLogger(__name__)

MAX_N = 128
# Tool and schema names: OpenAI allows only ASCII [A-Za-z0-9_-]; vLLM allows anything. namazu takes letters
# and digits of any script (`\w`: a pydantic class or a tool named 天気 or 会議メモ is served), '_' and
# '-', 1-64 characters. Not '.', ':' or spaces: the Kimi-K2 tool-call header `functions.NAME:INDEX` is
# parsed at those characters.
NAME_RE = re.compile(r"[\w-]{1,64}")
NAME_RULE = "1-64 characters, each a letter or digit (of any script), '_' or '-'"


@dataclass
class SamplingFields:
    """What both endpoints share, read before the endpoint-specific fields."""

    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    priority: int                    # lower runs first under --scheduling-policy priority
    kwargs: dict[str, Any]
    continuous_usage: bool = False   # stream_options.continuous_usage_stats: usage on every chunk
    constraint_param: str | None = None   # the field that named the output constraint (errors name it)
    extras: Extras | None = None     # vLLM's prompt- and response-side fields


def _read_sampling(f: Fields, max_logprobs: int) -> SamplingFields:
    extras = read_extras(f, max_logprobs)
    if f.has("best_of") and f.int("best_of", lo=1) != f.int("n", 1):
        raise invalid("'best_of' is not supported (only best_of == n)", "best_of")
    n = f.int("n", 1, lo=1, hi=MAX_N)
    stream = f.bool("stream")
    include_usage = continuous = False
    opts = f.raw("stream_options")
    if opts is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        o = Fields(opts, "'stream_options' object")
        include_usage = o.bool("include_usage")
        continuous = o.bool("continuous_usage_stats")
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
        logit_bias=read_logit_bias(f.raw("logit_bias")),
        allowed_token_ids=f.int_list("allowed_token_ids"),
        cache_salt=read_cache_salt(f),
    )
    if kwargs["allowed_token_ids"] == []:
        raise invalid("'allowed_token_ids' must not be empty (it would allow no token)", "allowed_token_ids")
    if kwargs["top_p"] == 0.0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    priority = f.int("priority", 0)
    return SamplingFields(n=n, seed=seed, stream=stream, include_usage=include_usage, priority=priority,
                          kwargs=kwargs, continuous_usage=continuous and include_usage, extras=extras)


def apply_constraints(sampling: SamplingFields, constraints: list[tuple[str, dict[str, Any]]]) -> None:
    """At most one structured-output constraint per request (one grammar per sequence)."""
    if len(constraints) > 1:
        # The error names response_format when it is one of them (the OpenAI field), else the later one.
        names = [c[0] for c in constraints]
        a, b = (names[1], "response_format") if names[0] == "response_format" else (names[0], names[1])
        raise invalid(f"'{a}' and '{b}' both constrain the output; a request may use one (for tools with a "
                      "JSON answer, use tool_choice 'none' or drop the other)", b)
    for name, kw in constraints:
        sampling.kwargs.update(kw)
        sampling.constraint_param = name


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
    ignored: list[str] | None = None     # unrecognized fields, ignored (not --strict-fields)


def parse_completion(body: Any, max_logprobs: int, strict: bool = True) -> CompletionRequest:
    f = Fields(body, strict=strict)
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
    sampling = _read_sampling(f, max_logprobs)
    if max_tokens == 0 and sampling.stream:
        raise invalid("'max_tokens' = 0 cannot be streamed", "max_tokens")
    constraints = read_constraints(f)
    structured = _read_response_format(f.raw("response_format"))
    if structured:
        constraints.insert(0, ("response_format", structured))
    f.finish()
    apply_constraints(sampling, constraints)
    return CompletionRequest(model, prompts, max_tokens, echo, logprobs, sampling, f.ignored)


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
    template_kwargs: dict[str, Any] | None = None    # extra chat-template variables (vLLM chat_template_kwargs)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False                   # prepend the last message's content when it has the answer's role
    legacy_functions: bool = False       # asked with `functions`: answer with `function_call`
    ignored: list[str] | None = None


def parse_chat(body: Any, max_logprobs: int, strict: bool = True) -> ChatRequest:
    f = Fields(body, strict=strict)
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
    raw_tools, raw_choice = f.raw("tools"), f.raw("tool_choice")
    legacy_tools, legacy_choice = legacy_functions(f)
    legacy = legacy_tools is not None
    if legacy:
        if raw_tools is not None or raw_choice is not None:
            raise invalid("'functions' is the deprecated form of 'tools'; send one of them", "functions")
        raw_tools, raw_choice = legacy_tools, legacy_choice
    where = "functions" if legacy else "tools"
    try:
        tools = _read_tools(raw_tools)
        tool_choice = _read_tool_choice(raw_choice, tools)
    except APIError as e:
        if legacy and e.param:
            e.param = e.param.replace("tools", "functions").replace("tool_choice", "function_call")
            e.message = e.message.replace("'tools", "'functions").replace("tool_choice", "function_call")
        raise
    # A legacy `function_call` answer holds one call.
    parallel = f.bool("parallel_tool_calls", True) and not legacy
    structured = _read_response_format(f.raw("response_format"))
    sampling = _read_sampling(f, max_logprobs)
    constraints = read_constraints(f)
    if structured:
        constraints.insert(0, ("response_format", structured))
    if tool_choice != "none":
        constraints.append((where, {}))
    template_kwargs = read_template_kwargs(f)
    effort = read_reasoning_effort(f)
    if effort is not None:
        template_kwargs.setdefault("reasoning_effort", effort)
    add_gen = f.bool("add_generation_prompt", True)
    cont = f.bool("continue_final_message")
    if cont and add_gen:
        raise invalid("'continue_final_message' continues the last message, so 'add_generation_prompt' must "
                      "be false", "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise invalid("'continue_final_message' needs the last message to be the assistant's",
                      "continue_final_message")
    echo = f.bool("echo")
    f.finish()
    apply_constraints(sampling, constraints)
    return ChatRequest(model, messages, tools, tool_choice, parallel, max_tokens, logprobs,
                       (top or 0) if logprobs else None, sampling, template_kwargs or None, add_gen, cont, echo,
                       legacy, f.ignored)


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
    if name is None or not NAME_RE.fullmatch(name):
        raise invalid(f"'response_format.json_schema.name' must be {NAME_RULE}", "response_format.json_schema.name")
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
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise invalid(f"'tools[{i}].function.name' must be {NAME_RULE}", f"tools[{i}].function.name")
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
