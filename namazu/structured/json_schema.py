"""Which JSON schemas namazu enforces: the public face of `schema_normalize`.

A schema is rewritten, before xgrammar compiles it, into an equivalent schema made only of keywords
xgrammar enforces exactly (`schema_normalize.py` says how); annotations and keywords JSON Schema does
not define are ignored, as the specification says. A validation keyword that cannot be enforced is
refused with a 400 naming it and where it is (strict), or dropped and logged (not strict). Each
enforced keyword was checked by sampling random grammar-valid outputs and validating them with
`jsonschema` (format checking on); tests/structured/test_structured_xgrammar.py and
tests/structured/test_structured_keywords.py keep that check.
"""
from __future__ import annotations

from typing import Any

from namazu.structured.schema_formats import ENFORCED_FORMATS
from namazu.structured.schema_normalize import UNSUPPORTED, SchemaNormalizer

FORMATS = ENFORCED_FORMATS
__all__ = ["FORMATS", "UNSUPPORTED", "check_json_schema", "normalize_json_schema",
           "normalize_json_schema_unordered", "prepare_json_schema",
           "relax_json_schema"]


def llguidance_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def normalize_json_schema(schema: Any, strict: bool = True) -> tuple[Any, list[str], bool]:
    """(the schema as namazu compiles it, the constraints dropped because not strict, whether only
    llguidance enforces it); ValueError naming the first keyword namazu cannot enforce (strict) or a
    malformed part."""
    norm = SchemaNormalizer(schema, strict, llguidance=llguidance_available())
    out = norm.run()
    return out, list(dict.fromkeys(norm.relaxed)), norm.needs_llguidance


def normalize_json_schema_unordered(schema: Any, strict: bool = True) -> tuple[Any, Any, bool]:
    """(the schema as namazu compiles it, the same before any_order.py wrote small objects' key orders,
    whether only llguidance enforces it); ValueError as normalize_json_schema."""
    norm = SchemaNormalizer(schema, strict, llguidance=llguidance_available())
    out = norm.run()
    return out, norm.unordered, norm.needs_llguidance


def prepare_json_schema(schema: Any, strict: bool = True) -> tuple[Any, list[str]]:
    """(the schema as namazu compiles it, the constraints dropped because not strict); ValueError
    naming the first keyword namazu cannot enforce (strict) or a malformed part."""
    out, relaxed, _ = normalize_json_schema(schema, strict)
    return out, relaxed


def check_json_schema(schema: Any) -> None:
    """Raises ValueError naming the first keyword namazu cannot enforce, or a malformed part."""
    prepare_json_schema(schema, strict=True)


def relax_json_schema(schema: Any) -> Any:
    """The schema without the constraints namazu cannot enforce (for schemas not marked strict, where
    OpenAI's contract is best effort), in the form namazu compiles."""
    return prepare_json_schema(schema, strict=False)[0]
