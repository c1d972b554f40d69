"""Tokenizers (tokenizer.json and tiktoken kinds), chat templates, and incremental detokenization of
multi-byte UTF-8 with stop strings spanning tokens."""
import base64
import json

import pytest
from engine_helpers import tiny_checkpoint

from namazu.engine.detokenizer import IncrementalDetokenizer
from namazu.tokenizer import Tokenizer

TEXT = "こんにちは、世界! naïve café 😀 テスト"


@pytest.fixture(scope="module")
def hf_tok():
    return Tokenizer.from_pretrained(tiny_checkpoint())


@pytest.fixture(scope="module")
def tiktoken_tok(tmp_path_factory):
    """A Kimi-style tiktoken tokenizer: 256 byte ranks + a few merges, specials after them."""
    d = tmp_path_factory.mktemp("tiktoken")
    ranks = [bytes([i]) for i in range(256)]
    for merge in ["こ".encode(), "ん".encode(), "世界".encode()[:3], b"th", b"the"]:
        # Every prefix split of a merged token must already be a token for BPE to reach it.
        for cut in range(2, len(merge) + 1):
            if merge[:cut] not in ranks:
                ranks.append(merge[:cut])
    lines = [f"{base64.b64encode(tok).decode()} {i}" for i, tok in enumerate(ranks)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    specials = ["[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
    config = {
        "added_tokens_decoder": {str(n + i): {"content": s, "special": True} for i, s in enumerate(specials)},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_assistant|>{% endif %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [n + 1]}))
    return Tokenizer.from_pretrained(d)


@pytest.mark.parametrize("kind", ["hf_tok", "tiktoken_tok"])
def test_round_trip_and_specials(kind, request):
    tok = request.getfixturevalue(kind)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    chat = tok.encode_chat([{"role": "user", "content": "日本語"}])
    assert tok.eos_token_id in chat and tok.eos_token_id in tok.special_ids
    assert "日本語" in tok.decode(chat) and "<|im_end|>" not in tok.decode(chat)
    assert "<|im_end|>" in tok.decode(chat, skip_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in tok.encode("世界")) == "世界".encode()


def test_tiktoken_kind_reads_specials_and_generation_config(tiktoken_tok):
    tok = tiktoken_tok
    assert tok.kind == "tiktoken"
    n_ranks = tok.token_to_id("[BOS]")
    assert tok.token_to_id("[EOS]") in tok.eos_token_ids and tok.eos_token_id in tok.eos_token_ids
    assert tok.vocab_size >= n_ranks + 6
    assert len(tok.encode("こん")) == 2          # merged characters


@pytest.mark.parametrize("kind", ["hf_tok", "tiktoken_tok"])
def test_incremental_detokenization_never_splits_a_character(kind, request):
    tok = request.getfixturevalue(kind)
    prompt = tok.encode("前置き")
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, prompt)
    seen = []
    for t in ids:
        assert detok.append(t) is None
        seen.append(detok.stream_text)
        assert "\ufffd" not in detok.stream_text
    detok.finish()
    assert detok.text == TEXT
    assert all(TEXT.startswith(s) for s in seen)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(hf_tok, include):
    ids = hf_tok.encode("おはよう世界、また明日")   # "世界" is six byte tokens
    detok = IncrementalDetokenizer(hf_tok, [], stop=["世界"], include_stop_str_in_output=include)
    hit, streamed = None, []
    for t in ids:
        hit = detok.append(t)
        streamed.append(detok.stream_text)
        if hit:
            break
    assert hit == "世界"
    assert detok.text == ("おはよう世界" if include else "おはよう")
    # While unfinished, a possible stop-string start is held back from the stream.
    assert all(not s.endswith("世") for s in streamed[:-1])


def test_chat_template_needs_a_template(tmp_path):
    from namazu.assets.random_model import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def _parity_dirs():
    from namazu.assets import default_model_path

    dirs = [tiny_checkpoint()]
    if (default_model_path() / "tokenizer.json").is_file():
        dirs.append(str(default_model_path()))
    return dirs


@pytest.mark.parametrize("path", _parity_dirs(), ids=["random", "namazu-tiny"][:len(_parity_dirs())])
def test_matches_transformers_tokenizer_and_template(path):
    from transformers import AutoTokenizer

    ours, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": "あなたは助手です"}, {"role": "user", "content": "東京の天気は？ ok"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode(TEXT) == ref.encode(TEXT)
    assert ours.decode(ours.encode(TEXT)) == ref.decode(ref.encode(TEXT), skip_special_tokens=True)
