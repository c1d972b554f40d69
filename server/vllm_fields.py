"""vLLM's extra request fields, read with vLLM's meaning and mapped onto namazu (docs/server.md has the table).

A client written for vLLM's OpenAI server sends these next to the OpenAI fields. Each one is either given
its vLLM meaning here (a structured-output constraint, a sampler setting, a template option, a response
option) or refused by name with the reason (`REFUSED`), in either field mode: a field whose meaning the
server cannot honour (beam search, logits processors) must never be silently dropped. Unknown fields are a
separate matter (`--strict-fields`, server/protocol.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.errors import APIError, invalid, wrong_type

if TYPE_CHECKING:
    from server.fields import Fields

# vLLM fields namazu cannot honour, with why, and the value that means "off" (sending that is accepted).
_OFF = object()
REFUSED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not implemented; sample several continuations with 'n'"),
    "length_penalty": (1.0, "it applies to beam search, which namazu does not have"),
    "early_stopping": (False, "it applies to beam search, which namazu does not have"),
    "logits_processors": (_OFF, "custom logits processors would run client-named code in the engine; use "
                                "'logit_bias', 'allowed_token_ids', 'bad_words' or a grammar"),
    "prompt_embeds": (_OFF, "namazu takes prompts as text or token ids only"),
    "mm_processor_kwargs": (_OFF, "namazu serves text-only models"),
    "kv_transfer_params": (_OFF, "namazu has no disaggregated prefill / KV transfer"),
    "guided_whitespace_pattern": (_OFF, "the JSON grammar's whitespace is fixed by the compiler (xgrammar)"),
    "structural_tag": (_OFF, "structural tags are not supported; use 'tools' or 'response_format'"),
    "documents": (_OFF, "the chat template is not given RAG documents; put them in the messages"),
    "vllm_xargs": (_OFF, "there are no custom sampling extensions to pass arguments to"),
}

# Fields accepted with no effect, and why that is vLLM's behaviour too.
_NO_EFFECT = {
    "guided_decoding_backend": "namazu has one structured-output backend (xgrammar)",
    "include_reasoning": "namazu does not split reasoning from content",
}

MAX_BAD_WORDS = 256
MAX_REQUEST_ID = 256
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def refuse_unhonoured(f: Fields) -> None:
    for name, (off, why) in REFUSED.items():
        v = f.raw(name)
        if v is None or (off is not _OFF and v == off and type(v) is type(off)):
            continue
        raise invalid(f"'{name}' is not supported by this server: {why}", name, code="unsupported_parameter")
    for name in _NO_EFFECT:
        f.raw(name)


def read_constraints(f: Fields) -> list[tuple[str, dict[str, Any]]]:
    """Every structured-output constraint the request names, as (parameter, SamplingParams keywords):
    vLLM's `guided_*` fields, its `structured_outputs` object, and namazu's own `regex` / `grammar`. The
    caller refuses more than one (a request has one grammar)."""
    out = []
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar"), ("regex", "regex"), ("grammar", "grammar")):
        v = f.raw(name)
        if v is not None:
            out.append((name, _constraint(kind, v, name)))
    so = f.raw("structured_outputs")
    if so is not None:
        from server.fields import Fields

        s = Fields(so, "'structured_outputs' object", strict=True)
        for kind in ("json", "regex", "choice", "grammar"):
            v = s.raw(kind)
            if v is not None:
                out.append((f"structured_outputs.{kind}", _constraint(kind, v, f"structured_outputs.{kind}")))
        if s.bool("json_object"):
            out.append(("structured_outputs.json_object", {"json_object": True}))
        for flag in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            s.bool(flag)        # xgrammar behaves as these ask whatever they say; accepted
        s.str("backend")
        for name in ("whitespace_pattern", "structural_tag"):
            if s.raw(name) is not None:
                raise invalid(f"'structured_outputs.{name}' is not supported by this server",
                              f"structured_outputs.{name}", code="unsupported_parameter")
        s.finish()
    return out


def _constraint(kind: str, v: Any, param: str) -> dict[str, Any]:
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise invalid(f"'{param}' is not valid JSON: {e}", param) from None
        if not isinstance(v, (dict, bool)):
            raise wrong_type(param, "a JSON-schema object (or its JSON text)", v)
        return {"json_schema": v, "json_schema_strict": True}
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise wrong_type(param, "a non-empty array of non-empty strings", v)
        # The choices as one EBNF alternation; json.dumps writes each as a quoted literal xgrammar reads.
        return {"grammar": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in v)}
    if not isinstance(v, str):
        raise wrong_type(param, "a string", v)
    if not v:
        raise invalid(f"'{param}' must not be empty", param)
    return {kind: v}


def read_cache_salt(f: Fields) -> str | None:
    """vLLM's `cache_salt`: a non-empty string (at most MAX_CACHE_SALT_CHARS); requests with different
    salts never share prefix-cache blocks (`namazu/scheduler/block_hash.py`)."""
    from namazu.sampling_params import MAX_CACHE_SALT_CHARS

    salt = f.str("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters "
                      f"(got {len(salt)})", "cache_salt")
    return salt


@dataclass
class Extras:
    """vLLM fields both endpoints read that are not sampler settings: they act on the prompt or on the
    response."""

    request_id: str | None = None
    truncate_prompt_tokens: int | None = None       # keep the last k prompt tokens
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    bad_words: list[str] | None = None
    add_special_tokens: bool | None = None          # None: the endpoint's default


def read_extras(f: Fields, max_logprobs: int) -> Extras:
    refuse_unhonoured(f)
    e = Extras()
    rid = f.str("request_id")
    if rid is not None and (len(rid) > MAX_REQUEST_ID or not re.fullmatch(r"[A-Za-z0-9._:\-]+", rid)):
        raise invalid(f"'request_id' must be 1-{MAX_REQUEST_ID} letters, digits, '.', '_', ':' or '-'",
                      "request_id")
    e.request_id = rid
    t = f.int("truncate_prompt_tokens", None, lo=-1)
    if t == 0:
        raise invalid("'truncate_prompt_tokens' must be -1 (the model's context length) or at least 1",
                      "truncate_prompt_tokens")
    e.truncate_prompt_tokens = t
    e.prompt_logprobs = f.int("prompt_logprobs", None, lo=0, hi=max_logprobs)   # vLLM's -1 (all): no
    e.return_tokens_as_token_ids = f.bool("return_tokens_as_token_ids")
    bw = f.raw("bad_words")
    if bw is not None:
        if not isinstance(bw, list) or not all(isinstance(w, str) for w in bw):
            raise wrong_type("bad_words", "an array of strings", bw)
        if len(bw) > MAX_BAD_WORDS:
            raise invalid(f"'bad_words' has {len(bw)} entries; at most {MAX_BAD_WORDS} are allowed", "bad_words")
        if any(not w.strip() for w in bw):
            raise invalid("'bad_words' entries must not be empty", "bad_words")
        e.bad_words = bw or None
    # Honoured by vLLM's (fast-tokenizer) detokenizer only on a path namazu does not have: special tokens
    # are never joined with spaces here, whatever it says. Type-checked and accepted.
    f.bool("spaces_between_special_tokens", True)
    v = f.raw("add_special_tokens")
    if v is not None and not isinstance(v, bool):
        raise wrong_type("add_special_tokens", "a boolean", v)
    e.add_special_tokens = v
    return e


def bad_words_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's token ids as written and with a leading space (how it appears mid-text), as vLLM
    tokenizes them."""
    out: list[list[int]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def read_logit_bias(v: Any) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias}; biases clamped to [-100, 100] (as vLLM does; OpenAI's
    documented range). Token ids are checked against the vocabulary with the other ids
    (`SamplingParams.check_vocab`)."""
    from namazu.sampling_params import LOGIT_BIAS_MAX, MAX_LOGIT_BIAS

    if v is None:
        return None
    if not isinstance(v, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to numbers", v)
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' has {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not re.fullmatch(r"-?[0-9]{1,19}", key):
            raise invalid(f"'logit_bias' key {key!r} is not a token id (a decimal integer)", "logit_bias")
        tid = int(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise wrong_type(f"logit_bias.{key}", "a number", bias)
        if bias != bias or bias in (float("inf"), float("-inf")):
            raise invalid(f"'logit_bias.{key}' must be a finite number", "logit_bias")
        out[tid] = max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, float(bias)))
    return {t: b for t, b in out.items() if b != 0.0} or None


def read_reasoning_effort(f: Fields) -> str | None:
    v = f.str("reasoning_effort")
    if v is not None and v not in REASONING_EFFORTS:
        raise invalid(f"'reasoning_effort' = {v!r}; expected one of {list(REASONING_EFFORTS)}", "reasoning_effort")
    return v


# Names the chat template receives from the server itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def read_template_kwargs(f: Fields) -> dict[str, Any]:
    v = f.raw("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise wrong_type("chat_template_kwargs", "an object", v)
    clash = sorted(_RESERVED_TEMPLATE_NAMES & set(v))
    if clash:
        raise invalid(f"'chat_template_kwargs' may not set {clash}: the server passes those (use the request's "
                      "own fields)", "chat_template_kwargs")
    for k in v:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise invalid(f"'chat_template_kwargs' key {k!r} is not a template variable name",
                          "chat_template_kwargs")
    return dict(v)


def legacy_functions(f: Fields) -> tuple[list[dict[str, Any]] | None, Any]:
    """The deprecated `functions` / `function_call` pair as `tools` / `tool_choice` (OpenAI's own mapping)."""
    fns, call = f.raw("functions"), f.raw("function_call")
    if fns is None:
        if call is not None:
            raise invalid("'function_call' needs 'functions'", "function_call")
        return None, None
    if not isinstance(fns, list):
        raise wrong_type("functions", "an array of function objects", fns)
    tools = [{"type": "function", "function": fn} for fn in fns]
    if call is None or call in ("none", "auto"):
        choice = call
    elif isinstance(call, dict) and isinstance(call.get("name"), str) and set(call) == {"name"}:
        choice = {"type": "function", "function": {"name": call["name"]}}
    else:
        raise invalid("'function_call' must be 'none', 'auto' or {'name': ...}", "function_call")
    return tools, choice


def clash(*names: str) -> APIError:
    return invalid(f"'{names[0]}' and '{names[1]}' cannot be used together", names[1])
