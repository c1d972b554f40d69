"""The drifted traffic mix of `make drafter-refresh` (`namazu.tiny.drift_tasks`, `traffic.build_requests`'s
kind weights and seed share), its replay (`replay_params` keeps an unseeded request unseeded) and the draft
vocabulary a fine-tune extends (`draft_vocab.extend_vocab`)."""
import hashlib
import json
import random
from collections import Counter

import jsonschema
import pytest

from namazu.spec.capture import CaptureRecord
from namazu.spec.draft_vocab import extend_vocab
from namazu.spec.training.replay import replay_params
from namazu.spec.training.traffic import build_requests, request_body
from namazu.tiny.drift_tasks import continuation, json_extraction, tool_call_request

SENTENCES = ["会議は午後三時から始まります。", "The report is due on Friday afternoon."]


def test_a_tool_call_request_ends_at_the_user_turn_and_its_call_is_valid_under_a_declared_schema():
    for seed in range(30):
        msgs, tools, fmt = tool_call_request(random.Random(seed), "en" if seed % 2 else "ja", SENTENCES)
        assert fmt is None and [m["role"] for m in msgs] == ["user", "assistant"]
        call = msgs[-1]["tool_calls"][0]["function"]
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        assert 2 <= len(declared) <= 4 and call["name"] in declared
        jsonschema.validate(json.loads(call["arguments"]), declared[call["name"]])
        # every argument value is stated in the request (the call is read off it, not remembered)
        for v in json.loads(call["arguments"]).values():
            text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            assert text in msgs[0]["content"]


def test_a_json_extraction_answer_parses_and_validates_under_its_response_format():
    for seed in range(30):
        msgs, tools, fmt = json_extraction(random.Random(seed), "ja" if seed % 2 else "en", SENTENCES)
        assert tools is None and fmt["type"] == "json_schema"
        answer = json.loads(msgs[-1]["content"])
        jsonschema.validate(answer, fmt["json_schema"]["schema"])
        assert list(answer) == list(fmt["json_schema"]["schema"]["properties"])   # keys in schema order
        for key in answer:
            assert f"({key}):" in msgs[0]["content"]


def test_a_continuation_prompts_with_a_documents_opening_and_answers_with_its_next_lines():
    docs = [[f"line {d}.{i}" for i in range(8)] for d in range(3)]
    msgs, tools, fmt = continuation(random.Random(0), "en", docs)
    head, answer = msgs[0]["content"].split("\n\n", 1)[1], msgs[1]["content"]
    doc = next(d for d in docs if d[0] == head.split("\n")[0])
    cut = len(head.split("\n"))
    assert head.split("\n") == doc[:cut] and answer.split("\n") == doc[cut:cut + 2]


def test_the_drift_kinds_appear_in_their_weights_and_the_old_mix_is_unchanged():
    old = build_requests(60, "valid", seed=3, max_tokens=32)
    # the digest of this file before the drift kinds and the seed share existed: old request files stay
    assert hashlib.sha256(json.dumps(old, ensure_ascii=False).encode()).hexdigest()[:16] == "2e7c9794c5ac81e8"
    assert old == build_requests(60, "valid", seed=3, max_tokens=32, qa_weight=1, call_weight=0, json_weight=0,
                                 continue_weight=0, seed_share=1)
    assert all("seed" in r["sampling"] and "response_format" not in r for r in old)
    drift = build_requests(200, "valid", seed=3, qa_weight=1, tool_weight=0, copy_weight=0, call_weight=2,
                           json_weight=1, continue_weight=1, seed_share=0.2)
    kinds = Counter(r["kind"] for r in drift)
    assert set(kinds) == {"qa", "call", "json", "continue"}
    assert kinds["call"] > 1.5 * kinds["json"] and kinds["call"] > 1.5 * kinds["continue"]   # weights 2 : 1 : 1
    assert all(r["messages"][-1]["role"] == "user" for r in drift)
    assert all(("response_format" in r) == (r["kind"] == "json") for r in drift)
    assert all(r["tools"] for r in drift if r["kind"] == "call")
    seeded = sum("seed" in r["sampling"] for r in drift)
    assert 20 <= seeded <= 70                          # ~20% of 200
    body = request_body(next(r for r in drift if r["kind"] == "json"))
    assert body["response_format"]["type"] == "json_schema" and body["stream"] is True


def _record(sampling):
    return CaptureRecord("req-7", [1, 2, 3], [[4, 5, 6]], ["stop"], sampling)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_replayed_request_keeps_its_seed_or_its_lack_of_one(temperature):
    assert replay_params(_record({"temperature": temperature, "seed": 42})).seed == 42
    assert replay_params(_record({"temperature": temperature})).seed is None       # the lossless rule, as served
    assert replay_params(_record({"temperature": temperature}), seed_unseeded=True).seed is not None
    assert replay_params(_record({"temperature": temperature})).max_tokens == 3


def test_extend_vocab_keeps_the_base_and_adds_the_commonest_new_tokens():
    import torch

    base = torch.tensor([2, 5, 9])
    outs = [[5, 5, 7, 7, 7, 1, 1, 8], [9, 3, 3, 1]]    # outside the base: 7:3 1:3 3:2 8:1
    assert extend_vocab(base, outs, 2).tolist() == [1, 2, 5, 7, 9]
    assert extend_vocab(base, outs, 10).tolist() == [1, 2, 3, 5, 7, 8, 9]
    assert extend_vocab(None, outs, 2) is None
