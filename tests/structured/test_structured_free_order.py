"""Objects whose keys come in any order (`namazu/structured/free_order.py`): llguidance's parametric rules
with a bit per declared key. Checked as instance tests with `jsonschema` as the oracle (a valid instance in
any key order accepted to the end token, an invalid one refused), on raw texts for what a dict cannot
spell (a key twice), by random grammar walks validated by `jsonschema`, and end to end on namazu-tiny."""
import itertools
import json
import random

import jsonschema
import pytest
from test_structured_keywords import ENFORCED, OPEN_WALKS, validator
from test_structured_rewrites import accepts, backend, exact_on, walks_validate  # noqa: F401 -- fixture

from namazu import LLM, SamplingParams
from namazu.structured.free_order import lark_grammar, needs_free_order
from namazu.structured.json_schema import normalize_json_schema_unordered
from namazu.structured.xgrammar_backend import json_schema_spec

pytest.importorskip("llguidance")

PROPS = {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}, "score": {"type": "number"},
         "kind": {"enum": ["a", "b"]}}
FULL = {"id": 1, "name": "x", "ok": True, "tags": ["t"], "score": 0.5, "kind": "a"}
CLOSED = {"type": "object", "properties": PROPS, "required": ["id", "kind"], "additionalProperties": False}
OPEN = {"type": "object", "properties": PROPS, "required": ["id", "kind"]}


def orders(full, n=120, seed=0):
    """n dicts: subsets of `full` in random key orders, some with a wrong value or an undeclared key."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        items = rng.sample(list(full.items()), rng.randint(0, len(full)))
        if rng.random() < 0.2 and items:
            k, _ = items[0]
            items[0] = (k, {"wrong": True})
        if rng.random() < 0.3:
            items.insert(rng.randint(0, len(items)), ("zz", rng.choice([0, "s", None])))
        out.append(dict(items))
    return out


def text_accepted(backend, schema, text) -> bool:   # noqa: F811 -- the fixture's value
    b, tok, stops = backend
    g = b.matcher(json_schema_spec(schema), max_rollback=4)
    return g.accept_tokens(tok.encode(text, add_special_tokens=False)) and g.accept_tokens([stops[0]])


@pytest.mark.parametrize("schema", [CLOSED, OPEN], ids=["closed", "open"])
def test_big_objects_take_their_keys_in_any_order(backend, schema):   # noqa: F811
    spec = json_schema_spec(schema)
    assert spec.free_order, "an object of 6 declared properties needs the free-order grammar"
    values = orders(FULL) + [dict(reversed(FULL.items())), {"kind": "b", "id": 2}, {"zz": 1, "kind": "a", "id": 3}]
    assert exact_on(backend, schema, values) == "llguidance"
    valid = [v for v in values if validator(schema).is_valid(v)]
    assert len(valid) >= 10 and any(list(v)[0] not in ("id", "kind") for v in valid)
    small = {**schema, "properties": {k: {"enum": [1, "a"]} if k in ("name", "tags") else v
                                      for k, v in PROPS.items() if k != "score"}}
    if schema is CLOSED:        # an open object's walks wander in undeclared keys' random text
        walks_validate(backend, small, n=30)


def test_each_key_at_most_once_and_the_required_ones_before_the_end(backend):   # noqa: F811
    schema = {**OPEN, "additionalProperties": {"type": "string"}}
    assert text_accepted(backend, schema, '{"kind": "a", "zz": "s", "id": 1}')
    assert not text_accepted(backend, schema, '{"kind": "a", "id": 1, "id": 2}')        # a declared key twice
    assert not text_accepted(backend, schema, '{"kind": "a", "id": 1, "id": "s"}')      # nor as an undeclared one
    assert not text_accepted(backend, schema, '{"name": "x", "kind": "a"}')             # "id" is required
    assert not text_accepted(backend, schema, '{"kind": "a", "id": 1, "zz": 5}')        # undeclared: a string
    assert not text_accepted(backend, schema, '{"kind": "a","id": 1}')                  # namazu's separators
    assert text_accepted(backend, {**CLOSED, "required": []}, "{}")


def test_property_counts_on_a_closed_object(backend):   # noqa: F811
    schema = {**CLOSED, "required": [], "minProperties": 2, "maxProperties": 3}
    assert json_schema_spec(schema).free_order
    values = [dict(p) for k in range(5) for p in itertools.permutations(list(FULL.items())[:4], k)]
    exact_on(backend, schema, values[::3])


def test_forbidden_keys_type_lists_maps_and_untyped_objects(backend):   # noqa: F811
    narrowed = {"oneOf": [{"type": "object", "properties": {**PROPS, "pojo": {"type": "integer"}},
                           "required": ["pojo"]},
                          {"type": "object", "properties": {**PROPS, "json": {"type": "string"}},
                           "required": ["json"]}]}
    values = [{**v, "pojo": 1} for v in orders(FULL, 30, 1)] + [{**v, "json": "j"} for v in orders(FULL, 30, 2)]
    values += [{"json": "j", "pojo": 1}, {"pojo": 1}, dict(reversed({**FULL, "json": "j"}.items()))]
    exact_on(backend, narrowed, values)
    nullable = {"type": ["object", "null"], "properties": PROPS, "required": ["id"], "additionalProperties": False}
    exact_on(backend, nullable, [None, "s", {"id": 1}, dict(reversed(FULL.items())), {"kind": "a"}])
    services = {"type": "object", "additionalProperties": False,
                "patternProperties": {"^s-[a-z]+$": CLOSED}, "properties": {"version": {"type": "string"}}}
    exact_on(backend, services, [{"s-web": dict(reversed(FULL.items())), "version": "3"},
                                 {"version": "3", "s-db": {"kind": "a", "id": 1}, "s-web": {"id": 1, "kind": "b"}},
                                 {"s-Web": {"id": 1, "kind": "a"}}, {"s-web": {"id": 1}}, {}, {"version": 3}])
    # "version" matches the pattern too: both schemas apply to it (llguidance's own object, fixed order)
    overlapping = {**services, "patternProperties": {"^[a-z]+$": CLOSED}}
    exact_on(backend, overlapping, [{"version": "3"}, {"web": {"id": 1, "kind": "b"}},
                                    {"version": {"id": 1, "kind": "a"}}])
    untyped = {"properties": PROPS, "required": ["id"]}      # admits every type; objects are checked
    exact_on(backend, untyped, [1, "s", [1], None, {"kind": "a", "id": 1}, {"kind": "a"}, {"id": "1"}])


def test_objects_past_63_keys(backend):   # noqa: F811
    props = {f"k{i}": {"type": "integer"} for i in range(70)}
    schema = {"type": "object", "properties": props, "required": ["k69", "k0"], "additionalProperties": False}
    assert json_schema_spec(schema).free_order
    full = {f"k{i}": i for i in range(70)}
    exact_on(backend, schema, [dict(reversed(full.items())), {"k0": 0, "k69": 1}, {"k69": 1}, {"k1": 1, "k0": 0},
                               {"k0": 0, "k69": 1, "k70": 2}, {"k69": 1, "k0": 0, "k5": "x"}])
    # past the 63rd bit an optional key is not tracked: it may come twice, and json keeps the last value
    twice = '{"k69": 1, "k68": 2, "k0": 0, "k68": 3}'
    assert text_accepted(backend, schema, twice)
    jsonschema.validate(json.loads(twice), schema)
    assert not text_accepted(backend, schema, '{"k69": 1, "k3": 2, "k0": 0, "k3": 3}')   # tracked: once


def test_arrays_of_objects_keep_their_bounds(backend):   # noqa: F811
    schema = {"type": "array", "items": CLOSED, "minItems": 2, "maxItems": 3}
    item = dict(reversed(FULL.items()))
    exact_on(backend, schema, [[item] * n for n in range(5)] + [[item, {"id": 1}], [{"kind": "a", "id": 1}] * 2])


# valid seeds of the open schemas whose random walks rarely end (test_structured_keywords.OPEN_WALKS)
SEEDS = {"allOf-ref": {"id": 1, "tag": "x"}, "if-then-else": {"kind": "a", "v": 1, "w": "ab"},
         "oneOf-discriminator": {"kind": "b", "s": "abc", "n": 2}, "open-object": {"a": 1},
         "required-undeclared": {"x": 1, "y": 2}}


@pytest.mark.parametrize("name", OPEN_WALKS)
def test_open_objects_in_random_key_orders(backend, name):   # noqa: F811
    """Their seeds' keys in random orders, some dropped, some values wrong, undeclared keys anywhere:
    accepted exactly when jsonschema says the object is valid."""
    schema, seed, rng = ENFORCED[name], SEEDS[name], random.Random(name)
    values = []
    for _ in range(80):
        items = rng.sample(list(seed.items()), rng.randint(len(seed) - 1, len(seed)))
        if items and rng.random() < 0.3:
            items[0] = (items[0][0], rng.choice(["long string", 7, None]))
        for _ in range(rng.randint(0, 2)):
            items.insert(rng.randint(0, len(items)), (rng.choice(["zz", "q1"]), rng.choice([0, "s", [1]])))
        values.append(dict(items))
    exact_on(backend, schema, values)
    valid = [v for v in values if validator(schema).is_valid(v)]
    assert any(list(v)[0] not in seed for v in valid), "no valid object with an undeclared key first"


def test_a_leaf_carries_only_the_definitions_it_reaches(backend):   # noqa: F811
    # two patterns make the map a leaf (llguidance's own object); it references "a", which references "b"
    leafy = {"type": "object", "additionalProperties": False,
             "patternProperties": {"^x": {"$ref": "#/$defs/a"}, "^y": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"m": leafy, "u": {"$ref": "#/$defs/unused"}, **PROPS},
              "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}}, "b": {"type": "integer"},
                        "unused": {"type": "object", "properties": {"never_here": {"type": "string"}}}}}
    _, unordered, _ = normalize_json_schema_unordered(schema)
    text = lark_grammar(unordered)
    assert text.count("never_here") == 1 and text.count('"items"') >= 1
    exact_on(backend, schema, [{"m": {"x1": [1, 2], "y": 3}, "id": 1}, {"m": {"x1": ["s"]}}, {"kind": "a", "m": {}}])


def test_the_grammar_grows_linearly_with_the_keys():
    def size(n):
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                  "required": [f"p{i}" for i in range(0, n, 2)]}
        _, unordered, _ = normalize_json_schema_unordered(schema)
        assert needs_free_order(unordered)
        return len(lark_grammar(unordered))
    assert size(40) < 5 * size(10)       # a grammar of every order would grow by 2^30


def test_a_schema_the_free_order_grammar_cannot_hold_is_refused_under_strict(backend):   # noqa: F811
    # llguidance's regexes have no look-around: strict refuses naming it, not strict keeps the schema's order
    main = {"type": "string", "pattern": "^(?!org\\.)[a-z.]+$"}
    schema = {"type": "object", "properties": {**PROPS, "main": main}, "additionalProperties": False}
    with pytest.raises(ValueError, match="any order.*look-around"):
        backend[0].compile(json_schema_spec(schema))
    relaxed = json_schema_spec(schema, strict=False)
    assert relaxed.free_order and backend[0].compiler_for(relaxed) == "xgrammar"
    assert accepts(backend, relaxed, {"id": 1, "main": "com.x"})


def test_a_long_counted_pattern_under_a_length_is_not_refused_for_lack_of_fuel(backend):   # noqa: F811
    # with llguidance's default regex fuel this valid 11-word string was refused (JSONSchemaBench o21115)
    words = {"type": "string", "minLength": 1, "maxLength": 500, "pattern": "^(?:\\S+\\s+){0,49}\\S+$"}
    exact_on(backend, {**OPEN, "properties": {**PROPS, "note": words}},
             [{"id": 1, "kind": "a", "note": "The lab is near a bus stop and a train station."},
              {"id": 1, "kind": "a", "note": " lead"}, {"note": " ".join(["w"] * 51), "id": 1, "kind": "a"}])


SCHEMAS = [CLOSED, OPEN, {"type": "array", "items": CLOSED, "maxItems": 2},
           {"type": "object", "properties": {"user": OPEN, "n": {"type": "integer"}, "flags": PROPS["tags"],
                                             "note": {"type": "string"}}, "required": ["user"]}]


@pytest.mark.parametrize("speculation", [False, True])
def test_free_order_outputs_validate(speculation):
    kw = dict(speculative_method="ngram", num_speculative_tokens=3) if speculation else {}
    with LLM(executor="inline", max_num_seqs=16, **kw) as llm:
        backend = llm.engine.structured.backend
        params, schemas = [], []
        for i in range(12):
            schema = SCHEMAS[i % len(SCHEMAS)]
            p = SamplingParams(temperature=0.9, seed=i, max_tokens=80, json_schema=schema)
            spec = llm.engine.structured.spec(p)
            assert spec.free_order and backend.compiler_for(spec) == "llguidance"
            params.append(p)
            schemas.append(schema)
        outs = llm.generate(["JSON: " + json.dumps(s)[:80] for s in schemas], params, use_tqdm=False)
        stops = 0
        for o, schema in zip(outs, schemas):
            c = o.outputs[0]
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                stops += 1
                jsonschema.validate(json.loads(c.text), schema, format_checker=jsonschema.FormatChecker())
        assert stops >= 4, f"only {stops} of 12 outputs completed"
