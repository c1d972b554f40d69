"""Which JSON-schema constraints namazu enforces, checked before compiling.

xgrammar compiles many keywords into the grammar and silently ignores others. A constraint that is
not enforced would let an output claim to follow a schema it breaks, so a schema that uses one is
refused with a 400 naming the keyword and where it is. The supported set was established by
sampling random grammar-valid outputs for each keyword and validating them with `jsonschema`
(format checking on); see tests/structured/test_structured_xgrammar.py, which keeps that check.
"""
from __future__ import annotations

from typing import Any

# Keywords that constrain the output and are enforced.
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "$ref", "$defs", "definitions", "pattern", "format", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "patternProperties",
    "propertyNames",
}
# Keywords that describe without constraining.
ANNOTATIONS = {
    "title", "description", "examples", "example", "default", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$anchor",
}
# String formats whose grammar matches the format checker's definition. xgrammar's own date grammar
# admits 2004-09-31, so dates are lowered to exact calendar patterns (`lower_formats`).
FORMATS = {"date", "date-time", "uuid", "email", "uri"}
_YEAR = "[0-9]{4}"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
_OFFSET = "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}{_OFFSET}$"}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = {"items", "additionalProperties", "propertyNames"}
_SUBSCHEMA_LIST = {"prefixItems", "anyOf"}
_SUBSCHEMA_MAP = {"properties", "patternProperties", "$defs", "definitions"}


def check_json_schema(schema: Any, path: str = "#") -> None:
    """Raises ValueError naming the first keyword namazu cannot enforce, or a malformed part."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema at {path} must be an object or a boolean, not {type(schema).__name__}")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            hint = " (use anyOf)" if key == "oneOf" else ""
            raise ValueError(f"the JSON schema uses '{key}' at {where}, which namazu cannot enforce{hint}; "
                             "remove it or express it with supported keywords")
        if key == "format" and value not in FORMATS:
            raise ValueError(f"the JSON schema asks for format {value!r} at {where}; namazu enforces the formats "
                             f"{sorted(FORMATS)}")
        if key in _SUBSCHEMA:
            check_json_schema(value, where)
        elif key in _SUBSCHEMA_LIST:
            if not isinstance(value, list) or not value:
                raise ValueError(f"'{key}' at {where} must be a non-empty array of schemas")
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{where}/{i}")
        elif key in _SUBSCHEMA_MAP:
            if not isinstance(value, dict):
                raise ValueError(f"'{key}' at {where} must be an object of schemas")
            for name, sub in value.items():
                check_json_schema(sub, f"{where}/{name}")


def relax_json_schema(schema: Any) -> Any:
    """A copy without the constraints namazu cannot enforce (for schemas not marked strict, where
    OpenAI's contract is best effort): unsupported keywords and formats are dropped, the rest kept."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            out[key] = value
        elif key == "oneOf" and isinstance(value, list) and value:
            out["anyOf"] = [relax_json_schema(v) for v in value]
        elif key not in ENFORCED or (key == "format" and value not in FORMATS):
            continue
        elif key in _SUBSCHEMA:
            out[key] = relax_json_schema(value)
        elif key in _SUBSCHEMA_LIST and isinstance(value, list):
            out[key] = [relax_json_schema(v) for v in value]
        elif key in _SUBSCHEMA_MAP and isinstance(value, dict):
            out[key] = {k: relax_json_schema(v) for k, v in value.items()}
        else:
            out[key] = value
    return out


def lower_formats(schema: Any) -> Any:
    """A copy where formats namazu enforces by pattern (dates) are patterns."""
    if isinstance(schema, list):
        return [lower_formats(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: lower_formats(v) for k, v in schema.items()}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS:     # not a property named "format"
        if "pattern" in schema:
            raise ValueError(f"the JSON schema combines format {fmt!r} with a pattern; namazu enforces "
                             "one of them: drop the other")
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    return out
