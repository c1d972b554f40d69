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
    # Rows of copy tasks (ChatDataConfig.num_copy), a source of their own so their rate can be set, and
    # raised for the first copy_warmup_steps batches: copying is learned in a burst when it dominates the
    # batch, and barely at all while it is a few percent of it.
    copy_share: float = 0.0
    copy_warmup_steps: int = 0
    copy_warmup_share: float = 0.0


class _RowPool:
    """Packed rows drawn in a fresh random order every epoch."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, gen: torch.Generator):
        self.ids, self.mask, self.gen = ids, mask, gen
        self.order = torch.randperm(len(ids), generator=gen)
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos == len(self.order):
            self.order = torch.randperm(len(self.ids), generator=self.gen)
            self.pos = 0
        i = self.order[self.pos]
        self.pos += 1
        return self.ids[i], self.mask[i]


class BatchSampler:
    """Yields (input_ids [B, L] int64, loss_mask [B, L] bool) for L = seq_len + 1."""

    def __init__(self, streams: dict[str, torch.Tensor], chat_ids: torch.Tensor, chat_mask: torch.Tensor,
                 mix: MixConfig, batch_size: int, seq_len: int, seed: int,
                 copy_rows: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.streams = streams
        self.batch_size, self.row_len = batch_size, seq_len + 1
        self.gen = torch.Generator().manual_seed(seed)
        self.sources = ["ja", "en", "chat"]
        shares = [mix.ja_share, mix.en_share, mix.chat_share]
        if mix.copy_share or mix.copy_warmup_share:
            if copy_rows is None or not len(copy_rows[0]):
                raise ValueError("mix.copy_share / copy_warmup_share need copy-task rows (chat.num_copy > 0)")
            self.sources.append("copy")
            shares.append(mix.copy_share)
        self.probs = torch.tensor(shares, dtype=torch.float64)
        if (self.probs < 0).any() or self.probs.sum() <= 0 or not 0 <= mix.copy_warmup_share < 1:
            raise ValueError(f"data mix shares must be >= 0 with a positive sum, got {mix}")
        self.warmup_steps = mix.copy_warmup_steps
        self.warmup_probs = self.probs
        if "copy" in self.sources:
            rest = self.probs[:3] / self.probs[:3].sum() * (1 - mix.copy_warmup_share)
            self.warmup_probs = torch.cat([rest, torch.tensor([mix.copy_warmup_share], dtype=torch.float64)])
        self.pools = {}
        if len(chat_ids):
            self.pools["chat"] = _RowPool(chat_ids, chat_mask, self.gen)
        if "copy" in self.sources:
            self.pools["copy"] = _RowPool(*copy_rows, self.gen)
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.warmup_probs if self.step < self.warmup_steps else self.probs
        self.step += 1
        picks = torch.multinomial(probs, self.batch_size, replacement=True, generator=self.gen)
        ids = torch.empty(self.batch_size, self.row_len, dtype=torch.int64)
        mask = torch.ones(self.batch_size, self.row_len, dtype=torch.bool)
        for b, s in enumerate(picks.tolist()):
            src = self.sources[s]
            if src in self.pools:
                ids[b], mask[b] = self.pools[src].next()
            else:
                stream = self.streams[src if src in self.streams else "ja"]
                start = int(torch.randint(0, len(stream) - self.row_len, (1,), generator=self.gen))
                ids[b] = stream[start:start + self.row_len]
        return ids, mask


def build_sampler(tok: Tokenizer, corpus_dir: Path | str, chat_cfg: ChatDataConfig, mix: MixConfig,
                  batch_size: int, seq_len: int, seed: int) -> BatchSampler:
    streams = {lang: encode_documents(tok, read_documents(corpus_dir, lang, "train")) for lang in ("ja", "en")}
    examples = generate_chat_examples(corpus_dir, chat_cfg)
    copy_rows = None
    if mix.copy_share or mix.copy_warmup_share:
        copy_rows = pack_examples(tok, [e for e in examples if e.kind == "copy"], seq_len + 1,
                                  chat_cfg.assistant_loss_only)
        examples = [e for e in examples if e.kind != "copy"]
    chat_ids, chat_mask = pack_examples(tok, examples, seq_len + 1, chat_cfg.assistant_loss_only)
    log.info("train streams: ja %d tokens, en %d tokens, chat %d rows (%d target tokens)%s", len(streams["ja"]),
             len(streams["en"]), len(chat_ids), int(chat_mask.sum()),
             f", copy tasks {len(copy_rows[0])} rows ({int(copy_rows[1].sum())} target tokens)" if copy_rows else "")
    return BatchSampler(streams, chat_ids, chat_mask, mix, batch_size, seq_len, seed, copy_rows)


def eval_rows(tok: Tokenizer, corpus_dir: Path | str, lang: str, split: str, seq_len: int,
              max_rows: int) -> torch.Tensor:
    """Deterministic evaluation rows: consecutive windows of a split's token stream."""
    stream = encode_documents(tok, read_documents(corpus_dir, lang, split))
    n = min(max_rows, (len(stream) - 1) // (seq_len + 1))
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1).long()
