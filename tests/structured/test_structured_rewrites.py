"""The normalizer's rewrites that remove over-constraint the instance harness found, each checked as an
instance test (valid instances accepted to the end token, invalid ones refused, labels from
`jsonschema`) on both compilers' paths, and by random grammar walks validated by `jsonschema`:

- declared properties in any order for small objects (`any_order.py`);
- `pattern` read as JSON Schema's search (`^https?://` admits "https://example.com");
- length-bounded strings with escapes (`"a\\nb"` under maxLength), sent to llguidance;
- an overlapping `oneOf` narrowed by a property one branch requires and the other may leave out;
- strings told apart by their first character (a uuid and `^\\$...`).
"""
import itertools
import json
import random

import jsonschema
import pytest
from test_structured_keywords import validator, walk

from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.structured.any_order import MAX_ANY_ORDER, any_order
from namazu.structured.json_schema import check_json_schema, prepare_json_schema
from namazu.structured.schema_normalize import search_pattern
from namazu.structured.xgrammar_backend import XGrammarBackend, json_schema_spec
from namazu.tokenizer import Tokenizer

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def backend():
    tok = Tokenizer.from_pretrained(default_model_path())
    cfg = ModelConfig.from_pretrained(default_model_path())
    stops = sorted(set(tok.eos_token_ids) | set(cfg.eos_token_ids))
    return XGrammarBackend(tok, cfg.vocab_size, stops), tok, stops


def accepts(backend, spec, value) -> bool:
    b, tok, stops = backend
    g = b.matcher(spec, max_rollback=4)
    ids = tok.encode(json.dumps(value, ensure_ascii=False), add_special_tokens=False)
    return g.accept_tokens(ids) and g.accept_tokens([stops[0]])


def exact_on(backend, schema, values):
    """Each value accepted exactly when jsonschema says it is valid; returns the compiler used."""
    spec = json_schema_spec(schema)
    check = validator(schema)
    for v in values:
        assert accepts(backend, spec, v) == check.is_valid(v), (schema, v)
    return backend[0].compiler_for(spec)


def walks_validate(backend, schema, n=20, min_done=4):
    b, tok, stops = backend
    spec = json_schema_spec(schema)
    check = validator(schema)
    rng = random.Random(1)
    done = 0
    for _ in range(n):
        text = walk(b, tok, stops, spec, rng)
        if text is not None:
            done += 1
            errors = list(check.iter_errors(json.loads(text)))
            assert not errors, f"{text!r} breaks the schema: {errors[0].message}"
    assert done >= min_done


CLOSED3 = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                                            "c": {"type": "string", "maxLength": 3}},
           "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [CLOSED3, {k: v for k, v in CLOSED3.items() if k != "additionalProperties"}],
                         ids=["closed", "open"])
def test_small_objects_take_their_properties_in_any_order(backend, schema):
    full = {"a": 1, "b": True, "c": "x"}
    values = [dict(p) for k in range(4) for p in itertools.permutations(full.items(), k)]
    values += [{"b": False, "a": "1"}, {"c": "long", "a": 2}, {"b": True}, {"c": "x", "a": 1, "z": 0},
               {"a": 1, "b": False, "a2": None}]     # undeclared keys come after the declared ones
    exact_on(backend, schema, values)
    walks_validate(backend, schema, min_done=4 if schema is CLOSED3 else 0)   # open: see OPEN_WALKS


def test_any_order_keeps_the_schema_and_its_bounds():
    """Every branch is the object itself with `properties` reordered; bigger objects stay as written;
    nested values are shared through $defs, not copied per order."""
    nested = {"type": "object", "properties": {"x": CLOSED3, "y": {"type": "integer"}}}
    out, orders = any_order(nested)
    assert orders == 2 + 6
    branches = out["anyOf"]
    assert [list(b["properties"]) for b in branches] == [["x", "y"], ["y", "x"]]
    ref = branches[0]["properties"]["x"]
    assert set(ref) == {"$ref"} and branches[1]["properties"]["x"] == ref
    inner = out["$defs"][ref["$ref"].rsplit("/", 1)[1]]
    assert sorted(tuple(b["properties"]) for b in inner["anyOf"]) == sorted(itertools.permutations("abc"))
    assert all({k: v for k, v in b.items() if k != "properties"} ==
               {k: v for k, v in CLOSED3.items() if k != "properties"} for b in inner["anyOf"])
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_ANY_ORDER + 1)}}
    assert any_order(big) == (big, 0)


@pytest.mark.parametrize("pattern, yes, no", [
    ("^https?://", ["https://example.com", "http://"], ["ftp://x", "xhttps://"]),
    ("[a-z]+", ["Error1", "abc", "1a"], ["123", ""]),
    ("[0-9]{2}$", ["a12", "99"], ["12a", "1"]),
    ("-?[0-9]+(?:\\.[0-9]+)?,-?[0-9]+", ["40.7128,-74.0060", "x1,2y"], ["40.7", "a,b"]),
    ("^a|b$", ["a", "b"], ["c"]),          # anchors inside an alternation: kept as a whole-string match
])
def test_pattern_is_a_search(backend, pattern, yes, no):
    schema = {"type": "string", "pattern": pattern}
    for s in yes + no:
        if pattern != "^a|b$":
            assert jsonschema.Draft202012Validator(schema).is_valid(s) == (s in yes), s
    for compiler in ("xgrammar", "llguidance"):
        spec = json_schema_spec(schema if compiler == "xgrammar" else {**schema, "maxLength": 40})
        assert backend[0].compiler_for(spec) == compiler or pattern == "^a|b$"   # lengths implied there
        for s in yes + no:
            assert accepts(backend, spec, s) == (s in yes), (compiler, pattern, s)
    keyed = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, "additionalProperties": False}
    exact_on(backend, keyed, [{s: 1} for s in yes + no if s] + [{s: "x"} for s in yes if s])


def test_search_pattern_rewrites_only_where_it_is_exact():
    assert search_pattern("^a$") == "^a$"
    assert search_pattern("a|b") == "^[\\s\\S]*(?:a|b)[\\s\\S]*$"
    assert search_pattern("^(a|b)") == "^(?:(a|b))[\\s\\S]*$"
    assert search_pattern("x\\$") == "^[\\s\\S]*(?:x\\$)[\\s\\S]*$"      # an escaped $ is a character
    for kept in ("^a|b", "a\\bc", "(?=x)y", "a$|b"):
        assert search_pattern(kept) == kept


def test_bounded_strings_take_escapes(backend):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"],
              "additionalProperties": False}
    values = [{"s": "a\nb"}, {"s": 'q"t'}, {"s": "\\\\"}, {"s": "日本語"}, {"s": "a\nbcdef"}, {"s": "abcdefg"}]
    assert exact_on(backend, schema, values) == "llguidance"


NARROWED = [
    # the branches overlap where both properties are present: each keeps the objects without the other's
    ({"type": "object", "properties": {"pojo": {"type": "integer"}, "json": {"type": "string", "maxLength": 4}},
      "oneOf": [{"required": ["pojo"]}, {"required": ["json"]}], "additionalProperties": False},
     [{"pojo": 1}, {"json": "x"}, {"pojo": 1, "json": "x"}, {}, {"pojo": "1"}]),
    # open objects (a forbidden property beside undeclared ones: llguidance)
    ({"oneOf": [{"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}},
                 "required": ["k"]},
                {"type": "object", "properties": {"r": {"type": "string", "maxLength": 3},
                                                  "d": {"type": "integer"}}, "required": ["r", "d"]},
                {"type": "null"}]},
     [{"k": "a"}, {"r": "a", "d": 1}, {"k": "a", "r": "b", "d": 2}, {"k": "a", "r": "b"}, None, {"z": 1},
      {"k": "a", "z": 1}]),
    # a branch inside another ({radius} contains {radius, height}): the inner one never matches alone
    ({"type": "object", "properties": {"length": {"type": "integer"}, "radius": {"type": "integer"},
                                       "height": {"type": "integer"}},
      "oneOf": [{"required": ["length"]}, {"required": ["radius"]}, {"required": ["radius", "height"]}]},
     [{"length": 5}, {"radius": 3}, {"radius": 3, "height": 4}, {"length": 5, "radius": 3}, {"height": 1},
      {"length": 1, "height": 2}, {"radius": 1, "q": 0}]),
]


@pytest.mark.parametrize("schema, values", NARROWED, ids=["closed", "open", "nested-branch"])
def test_overlapping_oneof_is_narrowed_soundly(backend, schema, values):
    check = validator(schema)
    spec = json_schema_spec(schema)
    for v in values:
        if not check.is_valid(v):
            assert not accepts(backend, spec, v), (schema, v)
    assert any(accepts(backend, spec, v) for v in values)
    walks_validate(backend, schema, min_done=4 if "additionalProperties" in json.dumps(schema) else 0)   # OPEN_WALKS


def test_oneof_still_refused_where_branches_cannot_be_told_apart():
    for schema in ({"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},          # non-objects match both
                   {"oneOf": [{"type": "integer"}, {"type": "number"}]}):
        with pytest.raises(ValueError, match="branches 0 and 1 may both match"):
            check_json_schema(schema)
        assert prepare_json_schema(schema, strict=False)[1]


def test_strings_with_different_first_characters_exclude_each_other(backend):
    schema = {"type": "string", "oneOf": [{"format": "uuid"}, {"pattern": "^\\$[A-Z0-9-_]+"}]}
    exact_on(backend, schema, ["$ABC", "123e4567-e89b-12d3-a456-426614174000", "$", "abc", "$abc"])
    with pytest.raises(ValueError, match="may both match"):
        check_json_schema({"type": "string", "oneOf": [{"format": "uuid"}, {"pattern": "^[a-f]"}]})


def test_string_keywords_alone_leave_only_strings_to_a_oneof(backend):
    """Without a type, a non-string satisfies both branches (format and pattern test strings only): no
    non-string is valid, and the strings are told apart by their first character."""
    schema = {"oneOf": [{"format": "uuid"}, {"pattern": "^\\$[A-Z0-9-_]+"}]}
    exact_on(backend, schema, ["$ABC", "123e4567-e89b-12d3-a456-426614174000", 5, None, "abc", [], "$"])


def test_what_xgrammar_refuses_falls_back_to_llguidance(backend):
    """xgrammar 0.2.9 refuses an integer bound past 2**63 ("Integer exceeds maximum limit"); llguidance
    enforces the same normalized schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9223372036854776000}},
              "required": ["n"], "additionalProperties": False}
    assert exact_on(backend, schema, [{"n": 0}, {"n": 9223372036854775807}, {"n": -1}, {"n": 1.5},
                                      {"n": 92233720368547758070}]) == "llguidance"


def test_alternatives_share_a_bound_on_orders():
    """An anyOf's branches are all live at one position of llguidance's parser: together they write at
    most MAX_ALTERNATIVE_ORDERS orders (two 3-property objects: 12), more keep the schema's order."""
    def obj(tag):
        return {"type": "object", "properties": {"t": {"const": tag}, "u": {"type": "integer"},
                                                 "v": {"type": "boolean"}}, "required": ["t"]}
    two, orders2 = any_order({"anyOf": [obj("a"), obj("b")]})
    assert orders2 == 12 and all(len(b["anyOf"]) == 6 for b in two["anyOf"])
    three = {"anyOf": [obj("a"), obj("b"), obj("c")]}
    assert any_order(three) == (three, 0)
    by_ref = {"anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}, {"$ref": "#/$defs/c"}],
              "$defs": {"a": obj("a"), "b": obj("b"), "c": obj("c")}}
    assert any_order(by_ref)[1] == 0
