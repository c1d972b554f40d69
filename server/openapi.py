"""The OpenAPI 3.0 document served at /openapi.json: every route, request body and response.

Built from the running server's limits (vocabulary size, --max-logprobs, the sampling bounds of
server/protocol.py), so a client generated from it, or a fuzzer such as schemathesis, sees the same
ranges the server enforces. Every error response has the OpenAI error shape.
"""
from __future__ import annotations

from typing import Any

from namazu.sampling_params import INT64_MAX, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, TOP_K_MAX
from server.fields import IGNORED_FIELDS, MAX_STOP
from server.protocol import MAX_N
from server.vllm_fields import MAX_BAD_WORDS, MAX_REQUEST_ID, REASONING_EFFORTS

_INT64 = {"type": "integer", "minimum": -(2**63), "maximum": INT64_MAX}


def _int(lo: int | None = None, hi: int | None = None, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "integer", "minimum": -(2**63) if lo is None else lo,
                         "maximum": INT64_MAX if hi is None else hi}
    d.update(kw)
    return d


def _num(lo: float, hi: float, exclusive_lo: bool = False, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": "number", "minimum": lo, "maximum": hi}
    if exclusive_lo:
        d["exclusiveMinimum"] = True
    d.update(kw)
    return d


def _ignored_field(json_type: str, item_type: str | None, nullable: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": json_type}
    if item_type:
        schema["items"] = {"type": item_type}
    return _nullable(schema) if nullable else schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}},
    }},
}

_ERROR_STATUSES = {
    "400": "invalid value (out of range, unsupported, over the context length, not JSON)",
    "401": "missing, wrong or ambiguous API key",
    "404": "unknown model",
    "408": "the request body was not received within --body-timeout",
    "413": "body over --max-request-bytes",
    "422": "a field of the wrong JSON type, or a required field missing",
    "429": "the engine's queue is full (--max-waiting-seqs); see Retry-After",
    "500": "the engine step serving this request failed (other requests are unaffected)",
    "503": "the engine is unavailable (worker restarting, shutting down); see Retry-After",
    "504": "the request ran past --request-timeout",
}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": _ERROR_STATUSES[s],
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


def _absent_if_null(props: dict[str, Any], required: str) -> dict[str, Any]:
    """Every optional field the server reads (server/protocol.py `Fields`) takes null as absent, as OpenAI's
    own API does: the schema says so, or a client sending null (or a fuzzer) sees a documented type the
    server does not hold to. The ignored fields keep their own rule (`IGNORED_FIELDS`)."""
    return {name: schema if name == required or name in IGNORED_FIELDS or schema.get("nullable") else _nullable(schema)
            for name, schema in props.items()}


_CHOICES = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
_VLLM_CONSTRAINTS: dict[str, Any] = {
    "guided_json": _nullable({"oneOf": [{"type": "object"}, {"type": "string"}]}),
    "guided_regex": _nullable({"type": "string", "minLength": 1}),
    "guided_choice": _nullable(_CHOICES),
    "guided_grammar": _nullable({"type": "string", "minLength": 1}),
    "regex": _nullable({"type": "string", "minLength": 1}),
    "grammar": _nullable({"type": "string", "minLength": 1}),
    "structured_outputs": _nullable({"type": "object", "additionalProperties": False, "properties": {
        "json": _nullable({"oneOf": [{"type": "object"}, {"type": "string"}]}),
        "regex": _nullable({"type": "string", "minLength": 1}), "choice": _nullable(_CHOICES),
        "grammar": _nullable({"type": "string", "minLength": 1}), "json_object": _nullable({"type": "boolean"}),
        "backend": _nullable({"type": "string"}), "disable_fallback": _nullable({"type": "boolean"}),
        "disable_any_whitespace": _nullable({"type": "boolean"}),
        "disable_additional_properties": _nullable({"type": "boolean"})}}),
}
_NAME = {"type": "string", "pattern": "^[\\w-]{1,64}$",
         "description": "letters and digits of any script, '_' and '-' (not OpenAI's ASCII-only rule)"}
_RESPONSE_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": {"type": "string"}, "schema": {"type": "object"},
        "strict": {"type": "boolean"}}}}}


def _sampling(vocab_size: int, max_logprobs: int = 20) -> dict[str, Any]:
    """The fields both generation endpoints accept (server/protocol.py `_read_sampling`)."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {
        "model": {"type": "string"},
        "n": _int(1, MAX_N),
        "best_of": _int(1, MAX_N),
        "stream": {"type": "boolean"},
        "stream_options": _nullable({"type": "object", "additionalProperties": False, "properties": {
            "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}}),
        "seed": _nullable(_int(0)),
        "temperature": _num(0.0, 2.0),
        "top_p": _num(0.0, 1.0, exclusive_lo=True),
        "top_k": _int(-1, TOP_K_MAX),
        "min_p": _num(0.0, 1.0),
        "presence_penalty": _num(-2.0, 2.0),
        "frequency_penalty": _num(-2.0, 2.0),
        "repetition_penalty": _num(0.0, 1e6, exclusive_lo=True),
        "stop": _nullable({"oneOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "maxItems": MAX_STOP,
                                      "items": {"type": "string", "minLength": 1}}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "ignore_eos": {"type": "boolean"},
        "min_tokens": _int(0),
        "skip_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "additionalProperties": {"type": "number", "minimum": -1e300, "maximum": 1e300},
                                 "description": "token id (decimal text) -> bias, clamped to [-100, 100]"}),
        "allowed_token_ids": _nullable({"type": "array", "minItems": 1, "items": token_id}),
        "bad_words": _nullable({"type": "array", "maxItems": MAX_BAD_WORDS,
                                "items": {"type": "string", "minLength": 1, "pattern": "\\S"}}),
        "priority": _INT64,
        # vLLM's extras (server/vllm_fields.py)
        **_VLLM_CONSTRAINTS,
        "prompt_logprobs": _nullable(_int(0, max_logprobs)),
        "truncate_prompt_tokens": _nullable(_int(-1)),
        "return_tokens_as_token_ids": {"type": "boolean"},
        "request_id": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_REQUEST_ID,
                                 "pattern": "^[A-Za-z0-9._:\\-]+$"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                                 "description": "requests with different salts never share prefix-cache blocks"}),
        "spaces_between_special_tokens": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "guided_decoding_backend": {"type": "string"},
        "include_reasoning": {"type": "boolean"},
        **{name: _ignored_field(*spec) for name, spec in IGNORED_FIELDS.items()},
    }


def _completion_request(vocab_size: int, max_logprobs: int) -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    props = _sampling(vocab_size, max_logprobs)
    props.update({
        "response_format": _nullable(_RESPONSE_FORMAT),
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                             ids, {"type": "array", "minItems": 1, "items": ids}]},
        "max_tokens": _int(0),
        "echo": {"type": "boolean"},
        "logprobs": _nullable(_int(0, max_logprobs)),
        "suffix": _nullable({"type": "string", "maxLength": 0}),
    })
    return {"type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": _absent_if_null(props, "prompt")}


def _chat_request(vocab_size: int, max_logprobs: int) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    # What the server reads (server/protocol.py, _read_messages): content may be absent or null (an
    # assistant turn that only calls tools; other roles are refused with 422 then, which a schema cannot
    # say per role), and every optional field may be null, which counts as absent.
    string = _nullable({"type": "string"})
    message = {
        "type": "object", "required": ["role"], "additionalProperties": False,
        "properties": {
            # Accepted and ignored (an assistant message echoed back from an earlier answer).
            **{k: {} for k in ("refusal", "audio", "annotations", "function_call", "reasoning_content",
                               "reasoning")},
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": _nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}),
            "name": string,
            "tool_call_id": string,
            "tool_calls": _nullable({"type": "array", "items": {"type": "object", "required": ["function"],
                                                                "properties": {
                "id": string, "type": string,
                "function": {"type": "object", "properties": {"name": string, "arguments": string}}}}}),
        },
    }
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": _NAME,
            "description": {"type": "string"},
            "parameters": {"type": "object"}}}}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    props = _sampling(vocab_size, max_logprobs)
    props.update({
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": _nullable(_int(1)),
        "max_completion_tokens": _nullable(_int(1)),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _nullable(_int(0, min(20, max_logprobs))),
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named]}),
        "response_format": _nullable(_RESPONSE_FORMAT),
        "functions": _nullable({"type": "array", "items": tool["properties"]["function"],
                                "description": "deprecated form of 'tools'; answered with 'function_call'"}),
        "function_call": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto"]},
                                              {"type": "object", "required": ["name"],
                                               "properties": {"name": {"type": "string"}},
                                               "additionalProperties": False}]}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "extra chat-template variables"}),
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
        "echo": {"type": "boolean"},
        "reasoning_effort": _nullable({"type": "string", "enum": list(REASONING_EFFORTS)}),
    })
    return {"type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": _absent_if_null(props, "messages")}


_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}

_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
    "created": {"type": "integer"}, "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"],
                                           "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"},
        "logprobs": {"type": "object", "nullable": True},
        "finish_reason": {"type": "string", "nullable": True},
        "stop_reason": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "integer"}]}}}}}}

_CHAT = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
    "created": {"type": "integer"}, "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"],
                                           "properties": {
        "index": {"type": "integer"},
        "message": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["assistant", "user", "system", "tool"]},
            "content": {"type": "string", "nullable": True},
            "tool_calls": {"type": "array", "items": {"type": "object"}},
            "function_call": {"type": "object"}}},
        "logprobs": {"type": "object", "nullable": True},
        "finish_reason": {"type": "string", "nullable": True},
        "stop_reason": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "integer"}]}}}}}}

def _responses_request(vocab_size: int, max_logprobs: int) -> dict[str, Any]:
    """server/serving_responses.py: the Responses fields, plus the sampling extensions passed to the chat
    reader (those with another name here, such as n or max_tokens, are left out: they are refused)."""
    text_part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}
    item = {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
        "output": {"type": "string"}}}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": _NAME, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
    fmt = {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}, "name": _NAME,
        "schema": {"type": "object"}, "strict": {"type": "boolean"}, "description": {"type": "string"}}}
    props = {k: v for k, v in _sampling(vocab_size, max_logprobs).items()
             if k not in ("n", "best_of", "stream_options", "prompt_logprobs", "return_tokens_as_token_ids")}
    props.update({
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]},
        "instructions": _nullable({"type": "string"}),
        "max_output_tokens": _nullable(_int(1)),
        "previous_response_id": _nullable({"type": "string"}),
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                            {"type": "object", "required": ["type", "name"], "properties": {
                                                "type": {"type": "string", "enum": ["function"]},
                                                "name": {"type": "string"}}}]}),
        "text": _nullable({"type": "object", "additionalProperties": False, "properties": {
            "format": fmt, "verbosity": {"type": "string"}}}),
        "truncation": _nullable({"type": "string", "enum": ["auto", "disabled"]}),
        "reasoning": _nullable({"type": "object"}),
        "include": _nullable({"type": "array", "items": {"type": "string"}}),
    })
    return {"type": "object", "required": ["input"], "additionalProperties": False,
            "properties": _absent_if_null(props, "input")}


_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "model", "output", "status"],
             "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["response"]}, "created_at": {"type": "integer"},
    "model": {"type": "string"}, "status": {"type": "string", "enum": ["completed", "incomplete", "failed"]},
    "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"], "properties": {
        "type": {"type": "string", "enum": ["message", "function_call"]}, "id": {"type": "string"}}}},
    "usage": {"type": "object", "nullable": True, "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"}}},
    "previous_response_id": {"type": "string", "nullable": True}}}

_TOKENIZE_REQUEST = {"type": "object", "additionalProperties": False, "properties": {
    "model": _nullable({"type": "string"}), "prompt": {"type": "string"},
    "add_special_tokens": _nullable({"type": "boolean"}), "return_token_strs": _nullable({"type": "boolean"}),
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                           "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {"type": "string"}}}},
    "add_generation_prompt": _nullable({"type": "boolean"}), "continue_final_message": _nullable({"type": "boolean"}),
    "chat_template_kwargs": _nullable({"type": "object"}), "tools": _nullable({"type": "array", "items": {}})},
    "oneOf": [{"required": ["prompt"], "not": {"required": ["messages"]}},
              {"required": ["messages"], "not": {"required": ["prompt"]}}]}
_TOKENIZE = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "token_strs": {"type": "array", "nullable": True, "items": {"type": "string"}}}}


def _detokenize_request(vocab_size: int) -> dict[str, Any]:
    return {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
        "model": _nullable({"type": "string"}),
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}}


def _post(summary: str, request: Any, response: dict[str, Any], errors: tuple[str, ...]) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                     "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": response}}},
                                   **_errors(*errors)}}}


_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}


def _generation(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or server-sent events when 'stream' is true",
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors("400", "401", "404", "408", "413", "422", "429", "500", "503", "504"),
        },
    }}


_DRAFTER = {"type": "object", "required": ["drafter_id"], "properties": {
    "drafter_id": {"type": "string", "nullable": True}, "path": {"type": "string", "nullable": True},
    "previous_drafter_id": {"type": "string", "nullable": True},
    "shadow_drafter_id": {"type": "string"}, "shadow_path": {"type": "string"},
    "shadow_fraction": {"type": "number"}}}


def _admin_paths() -> dict[str, Any]:
    """/admin/drafter (server/admin_routes.py): the admin key's bearer scheme, not the API key's."""
    ok = {"description": "the serving drafter", "content": {"application/json": {"schema": _DRAFTER}}}
    body = {"type": "object", "required": ["path"], "additionalProperties": False,
            "properties": {"path": {"type": "string", "description": "a drafter directory under --drafter-root"}}}
    said = {"400": "not {\"path\": DIR}, or not a directory", "401": "missing or wrong --admin-key",
            "403": "a path outside --drafter-root", "409": "no DFlash drafter serving to replace",
            "413": _ERROR_STATUSES["413"], "422": "the checkpoint does not fit the target (it names the field or "
                                                  "tensor); the serving drafter is unchanged"}
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    errors = {code: {"description": what, "content": ref} for code, what in said.items()}
    return {"/admin/drafter": {
        "get": {"summary": "the serving drafter (and the shadow drafter, with --shadow-drafter)",
                "security": [{"admin": []}], "responses": {"200": ok, "401": errors["401"]}},
        "post": {"summary": "replace the serving drafter without a restart (switched at a step boundary)",
                 "security": [{"admin": []}],
                 "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                 "responses": {"200": ok, **errors}}}}


def build_openapi(vocab_size: int, max_logprobs: int, auth: bool, strict: bool = True,
                  admin: bool = False) -> dict[str, Any]:
    """The document for a server with these limits; `auth`: whether routes need the bearer key; `strict`:
    whether unknown request fields are refused (--strict-fields) or ignored, which the request bodies'
    additionalProperties says; `admin`: the operator routes exist (--admin-key)."""
    json_ok = lambda schema, what: {"description": what, "content": {  # noqa: E731
        "application/json": {"schema": schema}}}
    health = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "namazu", "version": "1",
                 "description": "OpenAI-compatible inference server for DeepSeek-V3 / Kimi-K2 class models."},
        "paths": {
            "/health": {"get": {"summary": "liveness: 200 while the engine serves", "security": [],
                                "responses": {"200": json_ok(health, "serving"),
                                              "503": json_ok(health, "not serving (restarting, shutting down)")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors("401")}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {
                "200": json_ok({"type": "object"}, "the OpenAPI document"), **_errors("401")}}},
            "/v1/models": {"get": {"summary": "the served model", "responses": {
                "200": json_ok({"type": "object", "required": ["object", "data"], "properties": {
                    "object": {"type": "string"}, "data": {"type": "array", "items": _MODEL}}}, "model list"),
                **_errors("401")}}},
            "/v1/models/{model}": {"get": {
                "summary": "one model", "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": json_ok(_MODEL, "the model"), **_errors("401", "404")}}},
            "/v1/completions": _generation("text completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generation("chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/responses": _generation("a response (OpenAI Responses API)", "ResponsesRequest", "Response"),
            "/v1/responses/{response_id}": {"get": {
                "summary": "a stored response (this process, bounded LRU)", "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": json_ok({"$ref": "#/components/schemas/Response"}, "the response"),
                              **_errors("401", "404")}}},
            "/tokenize": _post("token ids of a prompt or of a chat (rendered by the template)", _TOKENIZE_REQUEST,
                               _TOKENIZE, ("400", "401", "404", "408", "413", "422")),
            "/detokenize": _post("the text of token ids", _detokenize_request(vocab_size),
                                 {"type": "object", "required": ["prompt"],
                                  "properties": {"prompt": {"type": "string"}}},
                                 ("400", "401", "404", "408", "413", "422")),
            "/tokenizer_info": {"get": {"summary": "the tokenizer's configuration (remote tokenizers)", "responses": {
                "200": json_ok({"type": "object", "required": ["tokenizer_class", "eos_token"], "properties": {
                    "tokenizer_class": {"type": "string"}, "eos_token": {"type": "string", "nullable": True},
                    "chat_template": {"type": "string", "nullable": True}}}, "tokenizer info"),
                **_errors("401")}}},
            "/version": {"get": {"summary": "the server's version", "responses": {
                "200": json_ok({"type": "object", "required": ["version"],
                                "properties": {"version": {"type": "string"}}}, "version"), **_errors("401")}}},
        },
        "components": {"schemas": {
            "Error": _ERROR,
            "CompletionRequest": _completion_request(vocab_size, max_logprobs),
            "ChatCompletionRequest": _chat_request(vocab_size, max_logprobs),
            "Completion": _COMPLETION,
            "ChatCompletion": _CHAT,
            "ResponsesRequest": _responses_request(vocab_size, max_logprobs),
            "Response": _RESPONSE,
        }},
    }
    if not strict:
        for schema in doc["components"]["schemas"].values():
            if schema.get("additionalProperties") is False:
                schema["additionalProperties"] = True
    schemes: dict[str, Any] = {}
    if auth:
        schemes["bearer"] = {"type": "http", "scheme": "bearer"}
        doc["security"] = [{"bearer": []}]
    if admin:
        doc["paths"].update(_admin_paths())
        schemes["admin"] = {"type": "http", "scheme": "bearer", "description": "the --admin-key"}
    if schemes:
        doc["components"]["securitySchemes"] = schemes
    return doc
