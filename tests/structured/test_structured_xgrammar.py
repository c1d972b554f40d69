"""Structured output with xgrammar: the keywords namazu claims to enforce hold on random grammar walks,
the others are refused by name; JSON schemas, regexes, EBNF and Kimi-K2 tool calls end to end on
namazu-tiny, with and without speculation: every output that ends with "stop" validates."""
import json
import random
import re

import jsonschema
import pytest

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.eval.json_schemas import json_schemas
from namazu.structured.factory import StructuredOutputs
from namazu.structured.json_schema import check_json_schema, relax_json_schema
from namazu.structured.tool_calls import ToolMarkers, tool_call_constraint
from namazu.structured.xgrammar_backend import GrammarSpec, XGrammarBackend, json_schema_spec
from namazu.tokenizer import Tokenizer

pytest.importorskip("xgrammar", reason="xgrammar is a pinned dependency; make test installs it")
FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module")
def backend():
    tok = Tokenizer.from_pretrained(default_model_path())
    cfg = ModelConfig.from_pretrained(default_model_path())
    stops = sorted(set(tok.eos_token_ids) | set(cfg.eos_token_ids))
    return XGrammarBackend(tok, cfg.vocab_size, stops), tok, stops


def random_walk(backend, tok, stops, spec, rng, max_len=120):
    """A random output the grammar allows (ends where the grammar allows an end token, by coin)."""
    import numpy as np

    g = backend.matcher(spec, max_rollback=4)
    out = []
    mask = np.full((1, -(-backend.vocab_size // 32)), -1, dtype=np.int32)
    for _ in range(max_len):
        mask[:] = -1
        g.fill_bitmask(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:backend.vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        ends = [t for t in allowed if t in stops]
        if ends and rng.random() < 0.5:
            return tok.decode(out)
        choices = [t for t in allowed if t not in stops] or ends
        t = rng.choice(choices)
        if t in stops:
            return tok.decode(out)
        assert g.accept_tokens([t])
        out.append(t)
    return None


ENFORCED = {
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "lengths": {"type": "string", "minLength": 3, "maxLength": 5},
    "int-bounds": {"type": "integer", "minimum": 5, "maximum": 9},
    "exclusive": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9},
    "number": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "enum-const": {"type": "object", "properties": {"a": {"enum": ["x", 1, None]}, "b": {"const": "東京"}},
                   "required": ["a", "b"], "additionalProperties": False},
    "anyOf-ref": {"$defs": {"n": {"type": "integer", "minimum": 2}}, "anyOf": [{"$ref": "#/$defs/n"},
                                                                             {"type": "string", "maxLength": 2}]},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                          "additionalProperties": False},
    "formats": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                 "t": {"type": "string", "format": "date-time"},
                                                 "u": {"type": "string", "format": "uuid"}},
                "required": ["d", "t", "u"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_keywords_hold_on_random_walks(backend, name):
    b, tok, stops = backend
    schema = ENFORCED[name]
    rng = random.Random(0)
    done = 0
    for _ in range(12):
        text = random_walk(b, tok, stops, json_schema_spec(schema), rng)
        if text is None:
            continue
        done += 1
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
    assert done >= 3


@pytest.mark.parametrize("schema, word", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "integer"}}, "'not'"),
    ({"type": "array", "contains": {"const": 5}}, "contains"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "use anyOf"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "duration"}}},
     "format 'duration' at #/properties/a"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"x": {"if": {"type": "integer"}, "then": {}}}}, "#/properties/x/if"),
])
def test_unenforceable_keywords_are_refused_by_name(schema, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        check_json_schema(schema)
    relaxed = relax_json_schema(schema)       # best effort when not strict: the constraint is dropped
    check_json_schema(relaxed)


ITEM_SCHEMAS = [
    ({"type": "array", "items": {"type": "array", "uniqueItems": True}}, "uniqueItems at #/items/uniqueItems"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {"not": {"const": 3}}}}},
     "'not' at #/properties/xs/items/not"),
    ({"type": "array", "items": {"type": "object", "properties": {"d": {"type": "string", "format": "duration"}}}},
     "format 'duration' at #/items/properties/d/format"),
]


@pytest.mark.parametrize("schema, word", ITEM_SCHEMAS, ids=["uniqueItems", "not", "format"])
def test_a_strict_schemas_unenforceable_keyword_under_items_is_refused_by_name(backend, schema, word):
    # An array's element schema is a sub-schema like a property's: a constraint namazu cannot enforce
    # there must be refused too, or a strict answer would claim a schema its elements break.
    b, tok, stops = backend
    structured = StructuredOutputs(tok, b.vocab_size, stops, max_rollback=4)
    with pytest.raises(ValueError, match=re.escape(word)):
        structured.spec(SamplingParams(json_schema=schema, json_schema_strict=True))
    # Not strict: best effort, the keyword is dropped and the rest of the schema still compiles.
    spec = structured.spec(SamplingParams(json_schema=schema, json_schema_strict=False))
    b.compile(spec)
    assert word.split(" at ")[0].split("'")[-2 if "'" in word else 0] not in spec.text


def test_bad_grammars_are_clear_errors(backend):
    b, _, _ = backend
    with pytest.raises(ValueError, match="not valid JSON"):
        json_schema_spec("{not json")
    with pytest.raises(ValueError, match="does not compile"):
        b.compile(GrammarSpec("ebnf", "root ::= undefined_rule"))
    with pytest.raises(ValueError, match="does not compile"):
        b.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(ValueError, match="at most"):
        b.compile(GrammarSpec("regex", "a" * 300_000))
    hits = b.hits
    b.compile(GrammarSpec("regex", "[0-9]+"))
    b.compile(GrammarSpec("regex", "[0-9]+"))
    assert b.hits == hits + 1


@pytest.fixture(scope="module")
def llm():
    with LLM(executor="inline", max_num_seqs=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_spec():
    with LLM(executor="inline", max_num_seqs=64, speculative_method="ngram", num_speculative_tokens=3) as llm:
        yield llm


def check_json_outputs(outs, schemas):
    stops = 0
    for o, schema in zip(outs, schemas):
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(c.text), schema, format_checker=FORMATS)
    return stops


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("speculation", [False, True])
def test_fifty_json_schemas_validate(llm, llm_spec, temperature, speculation):
    engine = llm_spec if speculation else llm
    schemas = json_schemas(50)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96, json_schema=s)
              for i, s in enumerate(schemas)]
    prompts = ["次の形式のJSONで答えてください: " + json.dumps(s, ensure_ascii=False)[:200] for s in schemas]
    outs = engine.generate(prompts, params, use_tqdm=False)
    stops = check_json_outputs(outs, schemas)
    assert stops >= 25, f"only {stops} of 50 outputs completed their JSON within max_tokens"


def test_regex_ebnf_and_json_object(llm):
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=40, regex=r"[0-9]{3}-[0-9]{4}"),
              SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                             grammar='root ::= "はい" | "いいえ" | "たぶん" ("、" [0-9])?'),
              SamplingParams(temperature=1.0, seed=3, max_tokens=60, json_object=True)]
    outs = llm.generate(["電話番号: ", "答え: ", "JSON: "], params, use_tqdm=False)
    a, b, c = (o.outputs[0] for o in outs)
    assert a.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", a.text)
    assert b.finish_reason == "stop" and re.fullmatch(r"はい|いいえ|たぶん(、[0-9])?", b.text)
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)


def test_max_tokens_inside_json_is_length_not_stop(llm):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 30}}, "required": ["text"]}
    out = llm.generate(["JSON: "], SamplingParams(temperature=0, max_tokens=8, json_schema=schema),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}]


def _tool_grammar(backend, choice: str, parallel: bool):
    b, tok, stops = backend
    structured = StructuredOutputs(tok, b.vocab_size, stops, max_rollback=8)
    params = SamplingParams(tool_calls=tool_call_constraint(WEATHER, choice, parallel_tool_calls=parallel))
    return structured.grammar(params), ToolMarkers(tok)


def _allows(g, vocab_size: int, token: int) -> bool:
    import numpy as np

    mask = np.full((1, -(-vocab_size // 32)), -1, dtype=np.int32)
    g.fill_bitmask(mask, 0)
    return bool(np.unpackbits(mask.view(np.uint8), bitorder="little")[token])


def _one_call(tok, mk, index: int) -> list[int]:
    header = tok.encode(f"functions.get_weather:{index}", add_special_tokens=False)
    args = tok.encode(json.dumps({"city": "東京"}, ensure_ascii=False), add_special_tokens=False)
    return [mk.call_begin] + header + [mk.arg_begin] + args + [mk.call_end]


@pytest.mark.parametrize("parallel", [True, False])
def test_the_tool_grammar_allows_a_second_call_only_with_parallel_tool_calls(backend, parallel):
    # namazu-tiny makes one call per answer, so only the grammar itself shows whether
    # parallel_tool_calls=false is enforced: after one complete call the section may close, and may
    # open a second call only when parallel calls are allowed (in the mask and in accept_tokens alike).
    b, tok, _ = backend
    g, mk = _tool_grammar(backend, "required", parallel)
    assert g.accept_tokens([mk.section_begin] + _one_call(tok, mk, 0))
    assert _allows(g, b.vocab_size, mk.section_end)
    assert _allows(g, b.vocab_size, mk.call_begin) == parallel
    assert g.validate_tokens(_one_call(tok, mk, 1)) == (len(_one_call(tok, mk, 1)) if parallel else 0)
    assert g.accept_tokens([mk.section_end, b.stop_ids[0]]) and g.is_terminated()


def test_under_tool_choice_auto_plain_text_may_end_and_a_call_may_follow_text(backend):
    # "auto" lets the model answer in text and stop there: the end token must be allowed and accepted
    # after plain text, as it is after a closed tool-call section.
    b, tok, _ = backend
    eos = b.stop_ids[0]
    g, mk = _tool_grammar(backend, "auto", True)
    assert g.accept_tokens(tok.encode("晴れです。", add_special_tokens=False))
    assert _allows(g, b.vocab_size, eos) and not _allows(g, b.vocab_size, mk.call_begin)
    assert g.accept_tokens([eos]) and g.is_terminated()
    g, mk = _tool_grammar(backend, "auto", True)
    assert g.accept_tokens(tok.encode("調べます", add_special_tokens=False) + [mk.section_begin]
                           + _one_call(tok, mk, 0) + [mk.section_end, eos])
    assert g.is_terminated()
