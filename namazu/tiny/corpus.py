"""Reads the Japanese/English documentation corpus (format in the corpus' SOURCES.md).

Files are `{lang}/{split}.txt[.gz]`, documents separated by "\\n\\n<|doc|>\\n". The corpus directory is
taken from the `NAMAZU_CORPUS` environment variable, else `../shared/corpus` beside the repository.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path

DOC_SEPARATOR = "\n\n<|doc|>\n"
LANGS = ("ja", "en")
SPLITS = ("train", "valid", "test")


def default_corpus_dir() -> Path:
    env = os.environ.get("NAMAZU_CORPUS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "corpus"


def split_path(corpus_dir: Path | str, lang: str, split: str) -> Path:
    if lang not in LANGS:
        raise ValueError(f"unknown corpus language {lang!r}; expected one of {LANGS}")
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {SPLITS}")
    base = Path(corpus_dir) / lang / f"{split}.txt"
    for p in (base, base.with_suffix(".txt.gz")):
        if p.exists():
            return p
    raise FileNotFoundError(
        f"corpus split {lang}/{split} not found under {corpus_dir} (looked for {base} and {base}.gz); "
        "set NAMAZU_CORPUS to the corpus directory")


def read_text(corpus_dir: Path | str, lang: str, split: str) -> str:
    p = split_path(corpus_dir, lang, split)
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as f:
            return f.read()
    return p.read_text(encoding="utf-8")


def read_documents(corpus_dir: Path | str, lang: str, split: str) -> list[str]:
    """Documents of one split, each without a trailing newline."""
    text = read_text(corpus_dir, lang, split)
    return [d.rstrip("\n") for d in text.split(DOC_SEPARATOR) if d.strip()]
