"""Byte-level BPE tokenizer of namazu-tiny (its Kimi-K2-style chat template lives in `chat_format`).

The chat format follows Kimi-K2: every turn is `<|im_ROLE|>ROLE<|im_middle|>CONTENT<|im_end|>`, tools are
declared in a `tool_declare` system turn, assistant tool calls use the K2 tool-call section tokens and
tool results come back in a `<|im_tool|>` turn headed `## Return of functions.NAME:INDEX`. `<|im_end|>` is
the end-of-turn (eos) token; `<|end_of_text|>` separates pretraining documents; `<|mask|>` is reserved for
the speculative drafter's block input and never appears in training text.

`python -m namazu.tiny.tokenizer --out DIR` trains it on the corpus train split (plus a sample of the
generated chat data, so JSON and the template get merges) and writes tokenizer.json +
tokenizer_config.json loadable by `transformers.AutoTokenizer.from_pretrained(DIR)`.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from namazu.tiny.chat_format import (  # noqa: F401  (re-exported: the tokenizer's public names)
    BOS,
    CHAT_TEMPLATE,
    EOT,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_TOOL,
    IM_USER,
    MASK,
    NUM_RESERVED,
    PAD,
    SPECIAL_TOKENS,
    TOOL_ARG_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SECTION_BEGIN,
    TOOL_SECTION_END,
    render_chat,
)

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 12288


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Trains byte-level BPE; the special tokens take ids 0..len(SPECIAL_TOKENS)-1."""
    if not 8192 <= vocab_size <= 16384:
        raise ValueError(f"vocab_size {vocab_size} outside the 8k-16k range namazu-tiny is designed for")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "mask_token": MASK,
        "additional_special_tokens": [s for s in SPECIAL_TOKENS if s not in (BOS, IM_END, PAD, MASK)],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path | str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD, "mask_token": MASK}, indent=2) + "\n")


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The raw `tokenizers` object (fast, no transformers import) from a directory or tokenizer.json."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"tokenizer file {p} does not exist; build it with python -m namazu.tiny.tokenizer")
    return Tokenizer.from_file(str(p))


def training_texts(corpus_dir: Path | str, chat_sample: int = 4000) -> Iterator[str]:
    """Corpus train documents (ja + en) followed by a deterministic sample of rendered chat data."""
    from namazu.tiny.corpus import read_documents
    from namazu.tiny.data import ChatDataConfig, generate_chat_examples

    for lang in ("ja", "en"):
        yield from read_documents(corpus_dir, lang, "train")
    cfg = ChatDataConfig(num_qa=chat_sample // 2, num_tool=chat_sample // 2)
    for ex in generate_chat_examples(corpus_dir, cfg):
        yield ex.text


def main(argv: list[str] | None = None) -> None:
    from namazu.tiny import ASSET_DIR
    from namazu.tiny.corpus import default_corpus_dir

    ap = argparse.ArgumentParser(description="Train the namazu-tiny byte-level BPE tokenizer.")
    ap.add_argument("--corpus", type=Path, default=None, help="corpus directory (default: $NAMAZU_CORPUS "
                    "or ../shared/corpus beside the repository)")
    ap.add_argument("--out", type=Path, default=ASSET_DIR)
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    corpus = args.corpus or default_corpus_dir()
    tok = train_tokenizer(training_texts(corpus), args.vocab_size)
    save_tokenizer(tok, args.out)
    print(f"tokenizer: vocab {tok.get_vocab_size()} written to {args.out}")


if __name__ == "__main__":
    main()
