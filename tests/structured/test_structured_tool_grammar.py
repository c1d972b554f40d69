"""The Kimi-K2 tool-call grammar, driven directly (no model): the call header's index is a short number,
a section holds a bounded number of calls (one with parallel_tool_calls=false), plain text may end
under tool_choice=auto, and a random walk through the whole grammar always ends."""
import json
import random

import jsonschema
import numpy as np
import pytest

from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.sampling_params import SamplingParams
from namazu.structured.factory import StructuredOutputs
from namazu.structured.tool_calls import INDEX_DIGITS, MAX_CALLS, tool_call_constraint
from namazu.tokenizer import Tokenizer

pytest.importorskip("xgrammar", reason="xgrammar is a pinned dependency; make test installs it")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["東京", "大阪"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "final_result", "strict": True,
                                           "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                          "required": ["ok"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def so():
    tok = Tokenizer.from_pretrained(default_model_path())
    cfg = ModelConfig.from_pretrained(default_model_path())
    stops = sorted(set(tok.eos_token_ids) | set(cfg.eos_token_ids))
    return StructuredOutputs(tok, cfg.vocab_size, stops, max_rollback=8), tok, stops


def grammar(so, choice="required", parallel=True):
    s, _, _ = so
    params = SamplingParams(tool_calls=tool_call_constraint(TOOLS, choice, parallel))
    s.compile(params)
    return s.grammar(params)


def allowed(g, vocab):
    mask = np.full((1, -(-vocab // 32)), -1, dtype=np.int32)
    g.fill_bitmask(mask, 0)
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]).tolist())


def text_ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def open_call(so, g):
    s, tok, _ = so
    mk = s.markers
    assert g.accept_tokens([mk.section_begin, mk.call_begin])


def test_call_index_is_a_short_number(so):
    s, tok, _ = so
    mk, vocab = s.markers, s.backend.vocab_size
    g = grammar(so)
    open_call(so, g)
    assert g.accept_tokens(text_ids(tok, "functions.get_weather:"))
    assert g.validate_tokens(text_ids(tok, "0112011201")) < len(text_ids(tok, "0112011201"))
    assert g.accept_tokens(text_ids(tok, "0"))
    # after "0" no digit may follow: only the argument marker
    assert allowed(g, vocab) == {mk.arg_begin}
    g.rollback(len(text_ids(tok, "0")))
    digits = "9" * INDEX_DIGITS
    assert g.accept_tokens(text_ids(tok, digits))
    assert allowed(g, vocab) == {mk.arg_begin}, f"a {INDEX_DIGITS + 1}th digit is allowed"
    g.rollback(len(text_ids(tok, digits)))
    assert g.validate_tokens(text_ids(tok, "9" * (INDEX_DIGITS + 1))) < len(text_ids(tok, "9" * (INDEX_DIGITS + 1)))


def one_call(so, g, name="get_weather", args='{"city": "東京", "days": 2}', index=0):
    s, tok, _ = so
    mk = s.markers
    ids = [mk.call_begin] + text_ids(tok, f"functions.{name}:{index}") + [mk.arg_begin] + text_ids(tok, args) \
        + [mk.call_end]
    assert g.accept_tokens(ids), (name, args)


def test_parallel_tool_calls_false_allows_one_call(so):
    s, _, _ = so
    mk, vocab = s.markers, s.backend.vocab_size
    g = grammar(so, parallel=False)
    assert g.accept_tokens([mk.section_begin])
    one_call(so, g)
    assert allowed(g, vocab) == {mk.section_end}
    assert not g.accept_tokens([mk.call_begin])
    g2 = grammar(so, parallel=True)
    assert g2.accept_tokens([mk.section_begin])
    one_call(so, g2)
    assert allowed(g2, vocab) == {mk.call_begin, mk.section_end}
    for i in range(1, MAX_CALLS):
        one_call(so, g2, index=i)
    assert allowed(g2, vocab) == {mk.section_end}, f"more than {MAX_CALLS} calls allowed in one section"


def test_auto_allows_the_end_after_plain_text(so):
    s, tok, stops = so
    mk, vocab = s.markers, s.backend.vocab_size
    g = grammar(so, choice="auto")
    assert g.accept_tokens(text_ids(tok, "今日は晴れです。"))
    ok = allowed(g, vocab)
    assert set(stops) <= ok and mk.section_begin in ok
    assert not ({mk.call_begin, mk.arg_begin, mk.call_end, mk.section_end} & ok)
    assert g.accept_tokens([stops[0]]) and g.is_terminated()
    req = grammar(so, choice="required")
    assert allowed(req, vocab) == {mk.section_begin}


def test_required_multi_turn_call_pydantic_ai_shape(so):
    """pydantic-ai's default structured output: tool_choice required, a second turn after a tool result;
    the grammar must take `final_result` with its strict arguments and end."""
    s, tok, stops = so
    mk = s.markers
    g = grammar(so, choice="required", parallel=False)
    assert g.accept_tokens([mk.section_begin])
    one_call(so, g, "final_result", '{"ok": true}', index=1)
    assert g.accept_tokens([mk.section_end, stops[0]]) and g.is_terminated()


def test_random_walks_always_end(so):
    """Every free part is bounded: random walks through the whole grammar (calls, headers, arguments)
    reach the end token within a fixed number of tokens, and their calls parse and validate."""
    s, tok, stops = so
    mk, vocab = s.markers, s.backend.vocab_size
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(0)
    budget = 3 + MAX_CALLS * (2 + 8 + INDEX_DIGITS + 40)
    for parallel in (False, True):
        for _ in range(6):
            g = grammar(so, choice="required", parallel=parallel)
            out: list[int] = []
            while not g.is_terminated():
                assert len(out) < budget, f"the walk ran past {budget} tokens: {tok.decode(out)[-200:]!r}"
                ok = sorted(allowed(g, vocab))
                assert ok, "stuck"
                ends = [t for t in ok if t in stops or t == mk.section_end]
                t = rng.choice(ends) if ends and rng.random() < 0.3 else rng.choice(ok)
                assert g.accept_tokens([t])
                out.append(t)
            text = tok.decode(out, skip_special_tokens=False)
            calls = text.split("<|tool_call_begin|>")[1:]
            assert calls and (parallel or len(calls) == 1)
            for c in calls:
                header, args = c.split("<|tool_call_argument_begin|>")
                name, index = header.removeprefix("functions.").split(":")
                assert len(index) <= INDEX_DIGITS and (index == "0" or not index.startswith("0"))
                jsonschema.validate(json.loads(args.split("<|tool_call_end|>")[0]), schemas[name])
