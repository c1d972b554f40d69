"""Evaluation / calibration data: corpus text documents, gzip, JSONL chats through the chat template."""
import gzip
import json

import pytest
from quant_fixtures import write_char_tokenizer

from namazu.eval.data import iter_texts, load_tokenizer, parse_labelled, token_windows


@pytest.fixture()
def tok(tmp_path):
    write_char_tokenizer(str(tmp_path / "tok"))
    return load_tokenizer(tmp_path / "tok")


def test_corpus_documents_and_windows(tmp_path, tok):
    p = tmp_path / "ja" / "valid.txt.gz"
    p.parent.mkdir()
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write("abc def\nghi\n\n<|doc|>\nsecond doc\n")
    assert list(iter_texts(str(p))) == ["abc def\nghi", "second doc\n"]
    w = token_windows([str(p)], tok, seq_len=4, label="ja")
    total = len(tok.encode("abc def\nghi", add_special_tokens=False)) + len(
        tok.encode("second doc\n", add_special_tokens=False))
    assert total == 22 and [len(x) for x in w.windows] == [4, 4, 4, 4, 4, 2]   # partial tail kept
    assert w.num_tokens == total
    assert len(token_windows([str(p)], tok, seq_len=4, max_tokens=8).windows) == 2
    assert parse_labelled([str(p), f"en={p}"]) == {"ja": [str(p)], "en": [str(p)]}


def test_jsonl_chats_use_the_chat_template_and_bad_lines_are_named(tmp_path, tok):
    p = tmp_path / "chats.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo"}]}) + "\n"
                 + json.dumps([{"role": "user", "content": "bare list"}]) + "\n")
    assert list(iter_texts(str(p), tok)) == ["user: hi<|im_end|>assistant: yo<|im_end|>",
                                             "user: bare list<|im_end|>"]
    p.write_text('{"messages": [{"content": "no role"}]}\n')
    with pytest.raises(ValueError, match=r"chats.jsonl:1: expected"):
        list(iter_texts(str(p), tok))
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:1: not JSON"):
        list(iter_texts(str(p), tok))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        list(iter_texts(str(tmp_path / "missing.txt")))
