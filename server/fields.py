"""Typed access to one JSON object's fields: each read checks its type and range and names the field in the
error (`'temperature' must be a number`), and the fields nobody read are refused (or, not strict, logged,
ignored and named back to the client). Both the OpenAI protocol (`protocol.py`) and vLLM's extra fields
(`vllm_fields.py`) read a body through it.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from namazu.sampling_params import INT64_MAX
from server.errors import APIError, invalid, wrong_type

logger = logging.getLogger(__name__)

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

    def __init__(self, body: Any, what: str = "request body", strict: bool = True):
        self.strict = strict
        self.ignored: list[str] = []
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
        if not unknown:
            return
        if self.strict:
            raise invalid(f"unrecognized request argument(s): {', '.join(unknown)} (the server runs with "
                          "--strict-fields)", unknown[0])
        # vLLM's default: the request is served, the fields are named in the log (and in a response header).
        self.ignored = unknown
        logger.warning("ignoring unrecognized request field(s): %s", ", ".join(unknown))


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
