"""Token streams and batches for the namazu-tiny trainer.

Three sources, mixed per row with fixed probabilities:
- Japanese and English corpus text: documents tokenized and joined with `<|end_of_text|>`, rows are
  random windows of seq_len+1 tokens;
- chat data: whole rendered conversations packed greedily into rows (never split, so a tool call always
  sees its declaration), the tail of a row padded with `<|pad|>` and masked out of the loss (optionally
  everything but the assistant turns too).
Row choice and window offsets come from one seeded torch.Generator, so a seed fixes the batch sequence.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from namazu.tiny.corpus import read_documents
from namazu.tiny.data import ChatDataConfig, ChatExample, generate_chat_examples
from namazu.tiny.tokenizer import EOT, IM_ASSISTANT, IM_END, IM_MIDDLE, PAD

log = logging.getLogger(__name__)


def encode_documents(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """One int32 stream: EOT doc EOT doc ... (EOT first, so every document starts after a separator)."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def assistant_targets(ids: list[int], tok: Tokenizer) -> list[bool]:
    """True at the tokens of assistant turns (their content and closing `<|im_end|>`), False elsewhere."""
    assistant, middle, end = tok.token_to_id(IM_ASSISTANT), tok.token_to_id(IM_MIDDLE), tok.token_to_id(IM_END)
    out, state = [], "out"  # out -> header (after <|im_assistant|>) -> body (after its <|im_middle|>)
    for t in ids:
        out.append(state == "body")
        if t == assistant:
            state = "header"
        elif t == middle and state == "header":
            state = "body"
        elif t == end:
            state = "out"
    return out


def pack_examples(tok: Tokenizer, examples: list[ChatExample], row_len: int,
                  assistant_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy packing of whole conversations into rows of row_len tokens -> (ids [R, L], mask [R, L]).

    The mask marks loss targets: every real token, or with `assistant_only` only assistant turns.
    """
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    cur: list[int] = []
    cur_mask: list[bool] = []
    dropped = 0
    for enc in tok.encode_batch([e.text for e in examples], add_special_tokens=False):
        seq = [eot] + enc.ids
        if len(seq) > row_len:
            dropped += 1
            continue
        if len(cur) + len(seq) > row_len:
            rows.append(cur)
            masks.append(cur_mask)
            cur, cur_mask = [], []
        cur.extend(seq)
        cur_mask.extend(assistant_targets(seq, tok) if assistant_only else [True] * len(seq))
    if cur:
        rows.append(cur)
        masks.append(cur_mask)
    if dropped:
        log.warning("dropped %d of %d chat examples longer than %d tokens", dropped, len(examples), row_len)
    ids = torch.full((len(rows), row_len), pad, dtype=torch.int32)
    mask = torch.zeros((len(rows), row_len), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        mask[i, :len(r)] = torch.tensor(m, dtype=torch.bool)
    return ids, mask


@dataclass(frozen=True)
class MixConfig:
    ja_share: float = 0.55
    en_share: float = 0.15
    chat_share: float = 0.30


class BatchSampler:
    """Yields (input_ids [B, L] int64, loss_mask [B, L] bool) for L = seq_len + 1."""

    def __init__(self, streams: dict[str, torch.Tensor], chat_ids: torch.Tensor, chat_mask: torch.Tensor,
                 mix: MixConfig, batch_size: int, seq_len: int, seed: int):
        self.streams, self.chat_ids, self.chat_mask = streams, chat_ids, chat_mask
        self.batch_size, self.row_len = batch_size, seq_len + 1
        self.gen = torch.Generator().manual_seed(seed)
        self.sources = ["ja", "en", "chat"]
        self.probs = torch.tensor([mix.ja_share, mix.en_share, mix.chat_share], dtype=torch.float64)
        if (self.probs < 0).any() or self.probs.sum() <= 0:
            raise ValueError(f"data mix shares must be >= 0 with a positive sum, got {mix}")
        self._chat_order = torch.randperm(len(chat_ids), generator=self.gen) if len(chat_ids) else None
        self._chat_pos = 0

    def _chat_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._chat_pos == len(self._chat_order):
            self._chat_order = torch.randperm(len(self.chat_ids), generator=self.gen)
            self._chat_pos = 0
        i = self._chat_order[self._chat_pos]
        self._chat_pos += 1
        return self.chat_ids[i], self.chat_mask[i]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.multinomial(self.probs, self.batch_size, replacement=True, generator=self.gen)
        ids = torch.empty(self.batch_size, self.row_len, dtype=torch.int64)
        mask = torch.ones(self.batch_size, self.row_len, dtype=torch.bool)
        for b, s in enumerate(picks.tolist()):
            src = self.sources[s]
            if src == "chat" and self._chat_order is not None:
                row, m = self._chat_row()
                ids[b], mask[b] = row, m
            else:
                stream = self.streams[src if src != "chat" else "ja"]
                start = int(torch.randint(0, len(stream) - self.row_len, (1,), generator=self.gen))
                ids[b] = stream[start:start + self.row_len]
        return ids, mask


def build_sampler(tok: Tokenizer, corpus_dir: Path | str, chat_cfg: ChatDataConfig, mix: MixConfig,
                  batch_size: int, seq_len: int, seed: int) -> BatchSampler:
    streams = {lang: encode_documents(tok, read_documents(corpus_dir, lang, "train")) for lang in ("ja", "en")}
    examples = generate_chat_examples(corpus_dir, chat_cfg)
    chat_ids, chat_mask = pack_examples(tok, examples, seq_len + 1, chat_cfg.assistant_loss_only)
    log.info("train streams: ja %d tokens, en %d tokens, chat %d rows (%d tokens)", len(streams["ja"]),
             len(streams["en"]), len(chat_ids), int(chat_mask.sum()))
    return BatchSampler(streams, chat_ids, chat_mask, mix, batch_size, seq_len, seed)


def eval_rows(tok: Tokenizer, corpus_dir: Path | str, lang: str, split: str, seq_len: int,
              max_rows: int) -> torch.Tensor:
    """Deterministic evaluation rows: consecutive windows of a split's token stream."""
    stream = encode_documents(tok, read_documents(corpus_dir, lang, split))
    n = min(max_rows, (len(stream) - 1) // (seq_len + 1))
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1).long()
