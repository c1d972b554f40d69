"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Status classes the server uses:
- 400 invalid_request_error: well-formed JSON whose values are out of range or unsupported (prompt over
  the context limit, temperature < 0, `suffix`, an unknown field), or a body that is not JSON;
- 401 authentication_error: missing or wrong API key;
- 404 not_found_error: unknown route or unknown model name;
- 408 invalid_request_error with code "request_timeout": the body did not arrive within --body-timeout;
- 413 request_too_large: body over --max-request-bytes;
- 422 invalid_request_error with code "invalid_type": a field of the wrong JSON type, or a required field
  missing (the body is JSON but not the shape of the request);
- 429 rate_limit_error: the engine's queue is full (--max-waiting-seqs), with a Retry-After header;
- 500 server_error: the engine step serving the request failed (the server goes on serving others);
- 503 server_error: the engine is unavailable (worker died and is restarting, or shutting down);
- 504 server_error with code "request_timeout": the request ran past --request-timeout.
The official `openai` client maps each of these to its typed exception (BadRequestError, ...).
"""
from __future__ import annotations

from http import HTTPStatus

from namazu.async_engine import (
    EngineOverloadedError,
    EngineUnavailableError,
    RequestFailedError,
    RequestTimeoutError,
)
from server.api_error import APIError  # the server's one error class, re-exported


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the value of `param` is not acceptable."""
    return APIError(400, message, param=param, code=code)


def wrong_type(param: str, expected: str, got: object) -> APIError:
    """422: `param` has the wrong JSON type."""
    return APIError(422, f"'{param}' must be {expected}, got {_json_type(got)}", param=param,
                    code="invalid_type")


ENGINE_ERRORS = (EngineOverloadedError, EngineUnavailableError, RequestFailedError, RequestTimeoutError)


def as_api_error(e: BaseException) -> APIError:
    """Any error met while serving a request, as the response it deserves (no traceback in it)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return APIError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineUnavailableError):
        return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e), code="request_timeout")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="engine_step_failed")
    return APIError(500, f"internal server error ({type(e).__name__}); see the server log")


def http_error(status: int, detail: str | None = None) -> APIError:
    """An APIError for a plain HTTP status (unknown route, wrong method)."""
    return APIError(status, detail or HTTPStatus(status).phrase, code=HTTPStatus(status).phrase.lower()
                    .replace(" ", "_"))


def _json_type(x: object) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, int):
        return "an integer"
    if isinstance(x, float):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "an array"
    if isinstance(x, dict):
        return "an object"
    return type(x).__name__
