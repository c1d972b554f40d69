"""Reading a request body as JSON without letting its shape hurt the server.

`json.loads` alone accepts what the rest of the server cannot handle: NaN and Infinity (not JSON, but
Python's parser takes them), integers past Python's digit limit (ValueError), nesting deep enough to hit
the recursion limit (RecursionError), and lone UTF-16 surrogates such as "\\ud800" (a str that cannot be
encoded, so the tokenizer fails on it later), and duplicate keys in an object (the last one wins, so a
proxy or validator that reads the first sees another request than the engine). Each is refused here with
a 400 that says what was wrong.
Large bodies are parsed off the event loop, so one request cannot stall every other client.
"""
from __future__ import annotations

import json
from typing import Any

from server.api_error import APIError
from server.prepare_pool import run_prepare

MAX_DEPTH = 64                      # the deepest real request (tool schemas) is far shallower
OFF_LOOP_BYTES = 64 * 1024          # parsing more than this takes long enough to matter to other clients


def _bad(message: str) -> APIError:
    return APIError(400, f"the request body is not acceptable JSON: {message}", code="invalid_json")


def _no_constants(name: str) -> Any:
    raise _bad(f"{name} is not a JSON value")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))     # type: ignore[func-returns-value]
        raise _bad(f"the key {dup[:100]!r} appears more than once in an object")
    return obj


def _check_tree(root: Any) -> None:
    """Depth and string encodings, iteratively (a recursive walk is what the limit protects)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(f"nesting deeper than {MAX_DEPTH} levels")
        if isinstance(node, str):
            _check_str(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_str(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"a string contains a lone surrogate ({s[e.start:e.end].encode('unicode_escape').decode()}); "
                   "send well-formed UTF-16 pairs or plain UTF-8") from None


def parse_json(raw: bytes) -> Any:
    """The decoded body, or an APIError (400) naming what is wrong with it."""
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constants, object_pairs_hook=_object)
    except APIError:
        raise
    except RecursionError:
        raise _bad(f"nesting deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError, integers past the digit limit
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_tree(body)
    return body


async def parse_json_async(raw: bytes) -> Any:
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_json(raw)
    return await run_prepare(parse_json, raw, size=len(raw))
