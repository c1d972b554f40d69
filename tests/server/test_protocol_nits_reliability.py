"""Request-shape nits of issue 34: a falsy non-object `logit_bias` is not "no bias", unknown keys inside
`messages[]` are refused like unknown top-level keys, and so are duplicate JSON keys."""
from __future__ import annotations

import pytest

from server.api_error import APIError
from server.json_body import parse_json
from server.protocol import parse_chat, parse_completion


@pytest.mark.parametrize("bias", [False, 0, "", [], "x", 1.5])
def test_logit_bias_that_is_not_an_object_is_refused(bias):
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", "logit_bias": bias}, 5)
    assert e.value.status == 422 and e.value.param == "logit_bias"


def test_an_empty_or_null_logit_bias_is_no_bias_and_a_real_one_is_read():
    for empty in ({}, None):
        assert not parse_completion({"prompt": "x", "logit_bias": empty}, 5).sampling.kwargs.get("logit_bias")
    req = parse_completion({"prompt": "x", "logit_bias": {"5": 10}}, 5)
    assert req.sampling.kwargs["logit_bias"] == {5: 10.0}


def test_unknown_message_keys_are_refused_and_echoed_fields_accepted():
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x", "contnet": "y"}]}, 5)
    assert e.value.status == 400 and e.value.param == "messages[0].contnet"
    parse_chat({"messages": [{"role": "user", "content": "x"},
                             {"role": "assistant", "content": "y", "refusal": None, "annotations": []}]}, 5)


def test_duplicate_keys_are_refused():
    with pytest.raises(APIError) as e:
        parse_json(b'{"prompt": "x", "max_tokens": 1, "max_tokens": 100000}')
    assert e.value.status == 400 and "more than once" in e.value.message
    with pytest.raises(APIError):
        parse_json(b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}')
