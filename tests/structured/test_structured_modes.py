"""Structured output with the engine's other modes on: graph mode (`enforce_eager=False`, traced with
torch.compile's "eager" backend here to skip inductor's compile time), async scheduling on and off, and
speculation (the n-gram drafter and a DFlash drafter) on namazu-tiny. The guarantee is the same in every
combination: an output that ends with "stop" validates under its schema (`jsonschema`, format checking
on), and one that does not end with "stop" ends with "length". The schemas cover both compilers and
the rewrites of the normalizer: a closed object (xgrammar), properties in any order, a narrowed
overlapping oneOf, a pattern read as a search, and length-bounded strings (llguidance)."""
import json

import jsonschema
import pytest
from dflash_fixtures import random_drafter

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path

pytest.importorskip("llguidance")

SCHEMAS = [
    {"type": "object", "properties": {"status": {"enum": ["ok", "ng"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 50}},
     "required": ["status", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer", "minimum": -5,
                                                                      "maximum": 5}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 5}},
     "oneOf": [{"required": ["x"]}, {"required": ["y"]}], "additionalProperties": False},
    {"type": "object", "properties": {"url": {"type": "string", "pattern": "^https?://", "maxLength": 24}},
     "required": ["url"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}, "minItems": 1, "maxItems": 3},
]

DFLASH = "dflash"
SLOW = pytest.mark.slow        # graph capture: about a minute a mode on a 2-core machine
MODES = [
    pytest.param(dict(enforce_eager=False), id="graph", marks=SLOW),
    pytest.param(dict(enforce_eager=False, async_scheduling=False), id="graph-sync", marks=SLOW),
    pytest.param(dict(enforce_eager=False, speculative_method="ngram", num_speculative_tokens=3), id="graph-ngram",
                 marks=SLOW),
    pytest.param(dict(enforce_eager=False, speculative_model=DFLASH, num_speculative_tokens=3), id="graph-dflash",
                 marks=SLOW),
    pytest.param(dict(enforce_eager=False, async_scheduling=False, speculative_model=DFLASH,
                      num_speculative_tokens=3), id="graph-sync-dflash", marks=SLOW),
    pytest.param(dict(speculative_model=DFLASH, num_speculative_tokens=3), id="eager-async-dflash"),
]


def _check(schema, text):
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))


@pytest.mark.parametrize("mode", MODES)
def test_outputs_validate_in_every_mode(mode, monkeypatch):
    monkeypatch.setenv("NAMAZU_GRAPH_BACKEND", "eager")
    kw = dict(mode)
    if kw.get("speculative_model") == DFLASH:
        kw["speculative_model"] = random_drafter(str(default_model_path()))
    with LLM(executor="inline", max_num_seqs=4, **kw) as llm:
        assert llm.engine.async_scheduling == kw.get("async_scheduling", True)
        params, schemas = [], []
        for i in range(10):
            schema = SCHEMAS[i % len(SCHEMAS)]
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=48, json_schema=schema))
            schemas.append(schema)
        outs = llm.generate(["JSON: " + json.dumps(s)[:60] for s in schemas], params, use_tqdm=False)
        stats = llm.engine.get_stats()
    stops = 0
    for o, schema in zip(outs, schemas):
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        if c.finish_reason == "stop":
            stops += 1
            _check(schema, c.text)
    assert stops >= 5, f"only {stops} of 10 outputs completed"
    if kw.get("num_speculative_tokens"):
        assert stats.num_draft_tokens > 0
