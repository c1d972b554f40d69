"""namazu-tiny tokenizer: byte-level round trips, special tokens, and the chat template in transformers."""
import json

import pytest

from namazu.tiny import ASSET_DIR
from namazu.tiny.evaluate import parse_tool_calls
from namazu.tiny.tokenizer import (
    IM_END,
    MASK,
    SPECIAL_TOKENS,
    TOOL_CALL_BEGIN,
    load_tokenizer,
    render_chat,
    train_tokenizer,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "指定した都市の天気予報を取得する",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "都市名"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "丁寧に回答してください。"},
    {"role": "user", "content": "東京の天気を教えてください。"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_x1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"forecast\": \"晴れ\"}"},
    {"role": "assistant", "content": "東京は晴れの予報です。"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET_DIR)


def test_round_trips_japanese_english_and_bytes(tok):
    for text in ("aptitude は多くの機能をもったかなり大きなプログラムです。", "Debian の ｱﾌﾟﾘ 🐟 ①②",
                 "The package manager resolves dependencies.\n\tindent", "混在 mixed 123,456.78円"):
        assert tok.decode(tok.encode(text).ids) == text
    assert 8192 <= tok.get_vocab_size() <= 16384


def test_special_tokens_are_single_fixed_ids(tok):
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
        assert tok.encode(s).ids == [i]
    ids = tok.encode(f"前{TOOL_CALL_BEGIN}後{MASK}").ids
    assert tok.token_to_id(TOOL_CALL_BEGIN) in ids and tok.token_to_id(MASK) in ids


def test_transformers_loads_and_renders_tools_and_results():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ASSET_DIR)
    assert hf.eos_token == IM_END and hf.mask_token == MASK
    text = hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text == render_chat(CONVERSATION, TOOLS)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>{\"name\": \"get_weather\"")
    # A foreign call id is rebuilt in K2 form; dict arguments are serialised as JSON.
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            "{\"city\": \"東京\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>") in text
    result = "<|im_tool|>tool<|im_middle|>## Return of functions.get_weather:0\n{\"forecast\": \"晴れ\"}<|im_end|>"
    assert result in text
    calls = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "東京"})]
    prompt = hf.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = hf.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)["input_ids"]
    assert hf.decode(ids) == prompt


def test_template_rejects_unknown_role():
    with pytest.raises(ValueError, match="unknown chat role"):
        render_chat([{"role": "robot", "content": "x"}])


def test_vocab_size_range_is_enforced():
    with pytest.raises(ValueError, match="8k-16k"):
        train_tokenizer(["x"], vocab_size=1000)
