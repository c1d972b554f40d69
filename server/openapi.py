"""The OpenAPI 3.0 document served at /openapi.json: every route, request body and response.

Built from the running server's limits (vocabulary size, --max-logprobs, the sampling bounds of
server/protocol.py), so a client generated from it, or a fuzzer such as schemathesis, sees the same
ranges the server enforces. Every error response has the OpenAI error shape.
"""
from __future__ import annotations

from typing import Any

from namazu.sampling_params import INT64_MAX, TOP_K_MAX
from server.protocol import IGNORED_FIELDS, MAX_N, MAX_STOP

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


def _sampling(vocab_size: int) -> dict[str, Any]:
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
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "priority": _INT64,
        **{name: _ignored_field(*spec) for name, spec in IGNORED_FIELDS.items()},
    }


def _completion_request(vocab_size: int, max_logprobs: int) -> dict[str, Any]:
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    props = _sampling(vocab_size)
    props.update({
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
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object"}}}}}
    props = _sampling(vocab_size)
    props.update({
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": _nullable(_int(1)),
        "max_completion_tokens": _nullable(_int(1)),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _nullable(_int(0, min(20, max_logprobs))),
        "tools": _nullable({"type": "array", "items": tool}),
        "tool_choice": _nullable({"type": "string", "enum": ["none", "auto"]}),
        "response_format": _nullable({"type": "object", "properties": {
            "type": {"type": "string", "enum": ["text"]}}}),
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
            "role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string", "nullable": True},
            "tool_calls": {"type": "array", "items": {"type": "object"}}}},
        "logprobs": {"type": "object", "nullable": True},
        "finish_reason": {"type": "string", "nullable": True},
        "stop_reason": {"nullable": True, "oneOf": [{"type": "string"}, {"type": "integer"}]}}}}}}

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


def build_openapi(vocab_size: int, max_logprobs: int, auth: bool) -> dict[str, Any]:
    """The document for a server with these limits; `auth`: whether routes need the bearer key."""
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
        },
        "components": {"schemas": {
            "Error": _ERROR,
            "CompletionRequest": _completion_request(vocab_size, max_logprobs),
            "ChatCompletionRequest": _chat_request(vocab_size, max_logprobs),
            "Completion": _COMPLETION,
            "ChatCompletion": _CHAT,
        }},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
