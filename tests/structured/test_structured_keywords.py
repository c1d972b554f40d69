"""JSON Schema as the specification reads it: unknown keywords are annotations (never refused), the
keywords namazu enforces hold on random grammar walks (every walk validated by `jsonschema`'s 2020-12
validator with format checking), the ones it cannot enforce are refused by name wherever they sit
(under `items` too), and schemas that accept nothing are refused instead of served."""
import json
import logging
import random
import re

import jsonschema
import numpy as np
import pytest

from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.structured.json_schema import check_json_schema, prepare_json_schema
from namazu.structured.schema_normalize import check_pattern, xgrammar_pattern
from namazu.structured.xgrammar_backend import XGrammarBackend, json_schema_spec
from namazu.tokenizer import Tokenizer

pytest.importorskip("xgrammar", reason="xgrammar is a pinned dependency; make test installs it")
pytest.importorskip("rfc3339_validator", reason="the time/date-time oracle (requirements-dev.txt)")


def validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def backend():
    tok = Tokenizer.from_pretrained(default_model_path())
    cfg = ModelConfig.from_pretrained(default_model_path())
    stops = sorted(set(tok.eos_token_ids) | set(cfg.eos_token_ids))
    return XGrammarBackend(tok, cfg.vocab_size, stops), tok, stops


def walk(b, tok, stops, spec, rng, max_len=160, stop_p=0.35):
    """A random output the grammar allows, ended where the grammar allows an end token (by coin)."""
    g = b.matcher(spec, max_rollback=4)
    out: list[int] = []
    mask = np.full((1, -(-b.vocab_size // 32)), -1, dtype=np.int32)
    for _ in range(max_len):
        mask[:] = -1
        g.fill_bitmask(mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:b.vocab_size]).tolist()
        ends = [t for t in allowed if t in stops]
        rest = [t for t in allowed if t not in stops]
        if ends and (not rest or rng.random() < stop_p):
            return tok.decode(out)
        assert rest, f"the grammar is stuck after {tok.decode(out)!r}: nothing allowed, no end"
        t = rng.choice(rest)
        assert g.accept_tokens([t])
        out.append(t)
    return None


def walks_validate(backend, schema, n=24, strict=True, min_done=4):
    b, tok, stops = backend
    spec = json_schema_spec(schema, strict=strict)
    check = validator(schema)
    rng = random.Random(0)
    done = 0
    for _ in range(n):
        text = walk(b, tok, stops, spec, rng)
        if text is None:
            continue
        done += 1
        errors = list(check.iter_errors(json.loads(text)))
        assert not errors, f"{text!r} breaks the schema: {errors[0].message}"
    assert done >= min_done, f"only {done} of {n} walks ended"


OBJ = {"type": "object"}
ENFORCED = {
    # JSON Schema's own defaults: an object admits properties it does not declare
    "open-object": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    "required-undeclared": {"type": "object", "required": ["x", "y"], "additionalProperties": {"type": "integer"}},
    "oneOf-types": {"oneOf": [{"type": "integer", "minimum": 3}, {"type": "string", "maxLength": 3},
                              {"type": "null"}]},
    "oneOf-discriminator": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}}, "required": ["kind", "n"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 4}},
         "required": ["kind", "s"]}]},
    "oneOf-forbidden": {"oneOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
         "additionalProperties": False},
        {"type": "object", "properties": {"y": {"type": "boolean"}}, "required": ["y"],
         "additionalProperties": False}]},
    "oneOf-enum": {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["c", 1]}]},
    "allOf-merge": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}},
                               "required": ["a"]},
                              {"properties": {"a": {"maximum": 9}, "b": {"type": "string", "maxLength": 3}},
                               "required": ["b"], "additionalProperties": False}]},
    "allOf-ref": {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}},
                                     "required": ["id"]}},
                  "allOf": [{"$ref": "#/$defs/base"},
                            {"properties": {"tag": {"enum": ["x", "y"]}}, "required": ["tag"]}]},
    "uniqueItems-enum": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 1},
    "uniqueItems-bool": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
    "min-maxProperties-closed": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                                  "c": {"type": "integer"}},
                                 "minProperties": 2, "maxProperties": 2, "additionalProperties": False},
    "maxProperties-open": {"type": "object", "maxProperties": 2, "minProperties": 1},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                           "c": {"type": "string", "maxLength": 2}},
                          "dependentRequired": {"a": ["b"], "c": ["a"]}, "additionalProperties": False},
    "dependencies-draft7": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            "dependencies": {"a": ["b"]}, "additionalProperties": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}},
                          "additionalProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "maxProperties": 3},
    "prefixItems-2020": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
                         "items": {"type": "boolean"}, "maxItems": 4},
    "items-array-draft4": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array",
                           "items": [{"type": "integer"}, {"type": "null"}], "additionalItems": False},
    "exclusive-draft4": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
                         "minimum": 3, "exclusiveMinimum": True, "maximum": 6, "exclusiveMaximum": True},
    "if-then-else": {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "v": {"type": "integer"},
                                                      "w": {"type": "string", "maxLength": 2}},
                     "required": ["kind"], "if": {"properties": {"kind": {"const": "a"}}},
                     "then": {"required": ["v"]}, "else": {"required": ["w"]}},
    "const-compound": {"enum": [{"a": [1, 2]}, [True, None], "x"]},
    "enum-filtered-by-type": {"type": "string", "enum": ["a", 1, "b", None]},
    "time": {"type": "string", "format": "time"},
    "date-time": {"type": "string", "format": "date-time"},
    "ipv4": {"type": "string", "format": "ipv4"},
    "ipv6": {"type": "string", "format": "ipv6"},
    "hostname": {"type": "string", "format": "hostname"},
    "uri-reference": {"type": "string", "format": "uri-reference"},
    "optional-group-pattern": {"type": "string", "pattern": "^a(x[0-9]{1,3})?$"},
    "pattern-with-lengths": {"type": "string", "pattern": "^[a-z0-9_.]+$", "minLength": 3, "maxLength": 5},
    "date-with-lengths": {"type": "string", "format": "date", "maxLength": 10},
    "number-multipleOf": {"type": "number", "multipleOf": 5, "minimum": 0, "maximum": 40},
    # only llguidance enforces these (xgrammar drops the lengths): compiled by it
    "pattern-lengths-llguidance": {"type": "string", "pattern": "^(ab)+$", "maxLength": 6},
    "email-lengths-llguidance": {"type": "string", "format": "email", "maxLength": 12},
    "recursive-ref": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                          "next": {"$ref": "#/$defs/node"}},
                                         "required": ["v"], "additionalProperties": False}},
                      "$ref": "#/$defs/node"},
}


# open objects admit any key and value: a random walk seldom closes them
# Objects open to undeclared keys take them anywhere (free_order.py), before a required key too: a uniform
# walk picks an undeclared key of random text far more often than the required one and rarely ends within
# its length. Their ended walks are still checked; their instances in random key orders are checked
# against jsonschema in test_structured_free_order.py::test_open_objects_in_random_key_orders.
OPEN_WALKS = ("allOf-ref", "if-then-else", "oneOf-discriminator", "open-object", "required-undeclared")
FEW_END = {"maxProperties-open": 1, **{name: 0 for name in OPEN_WALKS}}


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_keywords_hold_on_random_walks(backend, name):
    walks_validate(backend, ENFORCED[name], min_done=FEW_END.get(name, 4))


REAL_WORLD_ANNOTATIONS = {
    "$schema": "http://json-schema.org/draft-04/schema#", "id": "http://example.com/thing.json",
    "self": {"vendor": "com.acme", "name": "thing", "format": "jsonschema", "version": "1-0-0"},
    "@context": "https://schema.org", "x-deprecated": True, "$default": 3, "authorization": "user",
    "categories": ["a"], "data": {"x": 1}, "definitions": {"unused": {"not": {}, "x-whatever": 1}},
    "type": "object", "properties": {"n": {"type": "integer", "x-order": 1, "format": "int64",
                                           "example": 4, "$comment": "c"}},
    "required": ["n"], "additionalProperties": False,
}


def test_unknown_keywords_are_annotations(backend, caplog):
    """draft-04's id, Snowplow's self, JSON-LD's @context, x-*, OpenAPI formats, unused definitions:
    none of them is a validation keyword, so none is refused (and none reaches the grammar)."""
    with caplog.at_level(logging.DEBUG, logger="namazu.structured.schema_normalize"):
        prepared, relaxed = prepare_json_schema(REAL_WORLD_ANNOTATIONS, strict=True)
    assert relaxed == []
    assert prepared == {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                        "additionalProperties": False}
    walks_validate(backend, REAL_WORLD_ANNOTATIONS)


def test_each_ignored_keyword_is_logged_once(caplog):
    from namazu.structured import schema_normalize

    schema_normalize._seen_ignored.discard("x-once-only")
    with caplog.at_level(logging.DEBUG, logger="namazu.structured.schema_normalize"):
        for _ in range(3):
            check_json_schema({"type": "integer", "x-once-only": 1})
    assert sum("x-once-only" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("schema, word", [
    ({"type": "array", "items": {"type": "string", "not": {"const": "a"}}}, "'not' at #/items/not"),
    ({"type": "array", "items": [{"contains": {"const": 1}}]}, "'contains' at #/prefixItems/0/contains"),
    ({"type": "array", "prefixItems": [{"type": "object", "dependentSchemas": {"a": {}}}]},
     "'dependentSchemas' at #/prefixItems/0/dependentSchemas"),
    ({"type": "object", "additionalProperties": {"not": {}}}, "#/additionalProperties/not"),
    ({"type": "object", "propertyNames": {"not": {"const": "x"}}}, "#/propertyNames/not"),
    ({"type": "object", "patternProperties": {"^a": {"not": {}}}}, "#/patternProperties/^a/not"),
    ({"anyOf": [{"type": "integer"}, {"not": {}}]}, "#/anyOf/1/not"),
    ({"$defs": {"a": {"not": {}}}, "properties": {"x": {"$ref": "#/$defs/a"}}}, "#/$defs/a/not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if/then/else at #/if"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "branches 0 and 1 may both match"),
    ({"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "branches 0 and 1 may both match"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems at #/uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "duration"}}},
     "format 'duration' at #/properties/a/format"),
    ({"type": "object", "minProperties": 3}, "minProperties at #/minProperties"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired ('a')"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "two different 'pattern' values"),
    ({"type": "array", "items": {"unevaluatedProperties": False}}, "#/items/unevaluatedProperties"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf 0.01 at #/multipleOf"),
    ({"type": "string", "allOf": [{"format": "uri"}, {"pattern": "^https?://"}]}, "format 'uri' with a pattern"),
])
def test_unenforceable_keywords_are_refused_by_name_anywhere(schema, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        check_json_schema(schema)
    relaxed, dropped = prepare_json_schema(schema, strict=False)   # best effort: dropped and reported
    assert dropped and any(word.split(" at ")[0].strip("'") in d for d in dropped), dropped
    check_json_schema(relaxed)                                     # what is left is all enforced


@pytest.mark.parametrize("schema, word", [
    ({"type": []}, "empty list"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "names 'x'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["x"], "additionalProperties": False},
     "names 'x'"),
    ({"anyOf": [{"$ref": "#"}]}, "no finite JSON value"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite JSON value"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"},
     "no finite JSON value"),
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite JSON value"),
    ({"$ref": "http://example.com/other.json#/a"}, "points outside the schema"),
    ({"$ref": "other.json"}, "points outside the schema"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"enum": []}, "accepts nothing"),
    ({"type": "string", "enum": [1, 2]}, "accepts nothing"),
    ({"anyOf": [{"type": "integer", "minimum": 5, "maximum": 1}]}, "no branch of anyOf"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3}, "accepts nothing"),
    ({"type": "string", "pattern": "(a{1000}){1000}"}, "nests repetitions"),
    ({"type": "string", "pattern": "a{100000}"}, "repeats 100000 times"),
    ({"type": "string", "pattern": "(unclosed"}, "not a valid regular expression"),
    ({"enum": list(range(5000))}, "at most 4096"),
])
def test_schemas_that_accept_nothing_or_cannot_compile_are_refused(schema, word):
    for strict in (True, False):
        with pytest.raises(ValueError, match=re.escape(word)):
            prepare_json_schema(schema, strict=strict)


def test_deep_nesting_is_refused_quickly():
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper"):
        json_schema_spec(deep)
    with pytest.raises(ValueError, match="nests deeper|not valid JSON"):
        json_schema_spec("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("schema, word", [
    ({"type": "string", "pattern": "^(ab)+$", "maxLength": 6}, "pattern with minLength/maxLength at #"),
    ({"type": "string", "format": "email", "maxLength": 30}, "format 'email' at # with minLength/maxLength"),
])
def test_what_only_llguidance_enforces(backend, schema, word):
    """Lengths beside a pattern xgrammar cannot fold, or beside an email format: llguidance's (the spec
    says so, so the backend compiles it there); refused by name where llguidance is not installed."""
    from namazu.structured.schema_normalize import SchemaNormalizer

    with pytest.raises(ValueError, match=re.escape(word)):
        SchemaNormalizer(schema, strict=True, llguidance=False).run()
    pytest.importorskip("llguidance")
    spec = json_schema_spec(schema)
    assert spec.compiler == "llguidance" and backend[0].compiler_for(spec) == "llguidance"


def test_lengths_fold_into_a_repeated_class():
    from namazu.structured.schema_normalize import fold_lengths

    assert fold_lengths("^[a-z]+$", 2, 4) == "^[a-z]{2,4}$"
    assert fold_lengths("[a-z]*", 0, 9) == "^[a-z]{0,9}$"
    assert fold_lengths("^\\d{3}$", 1, 5) == "^\\d{3}$"          # implied
    assert fold_lengths("^\\d{3}$", 4, 5) is False
    assert fold_lengths("^[a-z]+?$", 2, 4) is None          # lazy: left alone
    assert fold_lengths("^(ab)+$", 2, 4) is None


def test_xgrammar_optional_group_workaround():
    """xgrammar (0.2.9) compiles `(x[0-9]+)?` inside a schema as if `x` were optional; `{0,1}` is right."""
    assert xgrammar_pattern(r"^a(x[0-9]+)?\)?[)?](c)??$") == r"^a(x[0-9]+){0,1}\)?[)?](c)??$"
    check_pattern("^(a|b){2}$", "#")


def test_open_object_accepts_undeclared_properties(backend):
    """JSON Schema's default: without additionalProperties: false an object admits other properties (a
    valid instance must be accepted); and a required property nobody declares is still required."""
    b, tok, _ = backend
    spec = json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]})
    for text, ok in [('{"a": 1, "z": "x", "q": [1]}', True), ('{"a": 1, "q": 2}', False), ('{"z": null}', True)]:
        g = b.matcher(spec, max_rollback=4)
        accepted = g.accept_tokens(tok.encode(text, add_special_tokens=False)) and g.is_completed()
        assert accepted == ok, text


def test_compiler_choice_rule_and_both_paths_agree_with_jsonschema(backend):
    """Open objects go to llguidance, closed ones to xgrammar (llguidance_backend.prefers_llguidance);
    either way a valid instance is accepted to the end token and an invalid one is not."""
    pytest.importorskip("llguidance")
    b, tok, stops = backend
    closed = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}, "s": {"enum": ["a", "b"]}},
              "required": ["n"], "additionalProperties": False}
    opened = {k: v for k, v in closed.items() if k != "additionalProperties"}
    assert b.compiler_for(json_schema_spec(closed)) == "xgrammar"
    assert b.compiler_for(json_schema_spec(opened)) == "llguidance"
    nested = {"type": "array", "items": opened}
    assert b.compiler_for(json_schema_spec(nested)) == "llguidance"
    cases = [{"n": 3}, {"n": 3, "s": "b"}, {"n": 0}, {"s": "a"}, {"n": 2, "extra": [1, {"x": None}]},
             {"n": 2, "s": "c"}, {"n": "2"}, [], {"n": 1.5}]
    for schema in (closed, opened, nested):
        check = validator(schema)
        spec = json_schema_spec(schema)
        for value in cases + [[c] for c in cases]:
            g = b.matcher(spec, max_rollback=4)
            ids = tok.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
            accepted = g.accept_tokens(ids) and g.accept_tokens([stops[0]])
            assert accepted == check.is_valid(value), (b.compiler_for(spec), schema, value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
])
def test_an_escaped_key_cannot_alias_a_declared_one(backend, schema):
    """'{"\\u0061": "x"}' parses as {"a": "x"}: an open object's undeclared key must not be spelled so."""
    b, tok, stops = backend
    spec = json_schema_spec(schema)
    for text in ['{"\\u0061": "x"}', '{"a": 1, "\\u0061": "x"}']:
        g = b.matcher(spec, max_rollback=4)
        ids = tok.encode(text, add_special_tokens=False)
        assert not (g.accept_tokens(ids) and g.accept_tokens([stops[0]])), (b.compiler_for(spec), text)
    g = b.matcher(spec, max_rollback=4)
    assert g.accept_tokens(tok.encode('{"a": 1, "b": "x\\ny"}', add_special_tokens=False) + [stops[0]])


@pytest.mark.parametrize("schema, instances", [
    # keywords beside anyOf go into each branch (xgrammar reads a branch alone)
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     [({}, False), ({"a": 1}, True), ({"b": 2}, True), ({"a": "x"}, False)]),
    # a required name only a pattern admits is declared (xgrammar enforces required for declared ones)
    ({"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "additionalProperties": False,
      "required": ["x1"]},
     [({}, False), ({"x1": 1}, True), ({"x1": "s"}, False), ({"x2": 1}, False)]),
])
def test_xgrammar_path_is_exact(backend, schema, instances):
    b, tok, stops = backend
    spec = json_schema_spec(schema)
    assert b.compiler_for(spec) == "xgrammar"
    for value, valid in instances:
        assert validator(schema).is_valid(value) == valid
        g = b.matcher(spec, max_rollback=4)
        ids = tok.encode(json.dumps(value), add_special_tokens=False)
        assert (g.accept_tokens(ids) and g.accept_tokens([stops[0]])) == valid, value
