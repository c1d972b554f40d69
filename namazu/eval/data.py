"""Evaluation and calibration text: plain text (the corpus format, optionally gzipped) or JSONL chats.

Plain text files are split into documents at the corpus separator (`\\n\\n<|doc|>\\n`); JSONL files hold one
chat per line (`{"messages": [...]}` or a bare list of messages), rendered with the tokenizer's chat
template. Token streams are cut into fixed-length windows, the unit of evaluation and of the bootstrap.
"""
from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DOC_SEPARATOR = "\n\n<|doc|>\n"


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer, as the engine loads it (HF tokenizer.json or Kimi's tiktoken.model)."""
    from namazu.tokenizer import Tokenizer

    try:
        return Tokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{os.fspath(path)}: no tokenizer could be loaded ({e}); pass --tokenizer DIR") from e


def _open_text(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def iter_texts(path: str, tokenizer=None) -> Iterator[str]:
    """Documents of a text file, or rendered chats of a .jsonl file."""
    raw = _open_text(path)
    base = path[:-3] if path.endswith(".gz") else path
    if not base.endswith(".jsonl"):
        for doc in raw.split(DOC_SEPARATOR):
            if doc.strip():
                yield doc
        return
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: JSONL chats need a tokenizer with a chat template")
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
        messages = obj.get("messages") if isinstance(obj, dict) else obj
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{path}:{lineno}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}")
        tools = obj.get("tools") if isinstance(obj, dict) else None
        # A whole conversation, assistant turns included: the text the model reads and writes.
        yield tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)


@dataclass
class TokenWindows:
    """Fixed-length windows of token ids from one labelled data set (e.g. a language)."""

    label: str
    windows: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(w.numel() for w in self.windows)


def token_windows(paths: list[str], tokenizer, seq_len: int, max_tokens: int | None = None,
                  label: str = "data") -> TokenWindows:
    """Tokenizes the files' documents back to back and cuts windows of `seq_len` tokens (the last partial
    one is kept if it has at least 2 tokens), stopping after `max_tokens`."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    windows: list[torch.Tensor] = []
    buf: list[int] = []
    total = 0
    done = False
    for path in paths:
        for text in iter_texts(path, tokenizer):
            buf.extend(tokenizer.encode(text, add_special_tokens=False))
            while len(buf) >= seq_len:
                windows.append(torch.tensor(buf[:seq_len], dtype=torch.long))
                buf = buf[seq_len:]
                total += seq_len
                if max_tokens is not None and total >= max_tokens:
                    done = True
                    break
            if done:
                break
        if done:
            break
    if not done and len(buf) >= 2:
        windows.append(torch.tensor(buf, dtype=torch.long))
    if not windows:
        raise ValueError(f"{label}: no tokens in {paths}")
    return TokenWindows(label, windows)


def parse_labelled(specs: list[str]) -> dict[str, list[str]]:
    """`LABEL=PATH` or `PATH` (label = the file's parent directory name, e.g. corpus/ja/test.txt -> ja)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        if "=" in spec and not os.path.exists(spec):
            label, path = spec.split("=", 1)
        else:
            path = spec
            label = os.path.basename(os.path.dirname(os.path.abspath(path))) or "data"
        out.setdefault(label, []).append(path)
    return out
