"""A random DFlash2 drafter for the random tiny target of the engine tests (written once per process)."""
from __future__ import annotations

import functools
import tempfile

import torch

from namazu.config import ModelConfig
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_config import DFlashConfig


def drafter_config(target_path: str, **overrides) -> DFlashConfig:
    t = ModelConfig.from_pretrained(target_path)
    kw = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, target_num_layers=t.num_hidden_layers,
              target_layers=list(range(t.num_hidden_layers)), mask_token_id=t.vocab_size - 1, block_size=5,
              num_layers=2, num_heads=2, head_dim=16, intermediate_size=64, selector_k=6, selector_rank=8,
              conv_groups=4)
    kw.update(overrides)
    return DFlashConfig(**kw)


@functools.cache
def random_drafter(target_path: str, seed: int = 0, **overrides) -> str:
    """A drafter with random weights (conv taps and selector codebooks randomised too, so every part of the
    forward matters)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(drafter_config(target_path, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tempfile.mkdtemp(prefix=f"namazu-dflash-random-{seed}-")
    model.save(path)
    return path


@functools.cache
def shortlisted_drafter(target_path: str, size: int = 120, **overrides) -> str:
    """random_drafter with a draft vocabulary of `size` random token ids (not a prefix of the vocabulary,
    so a walk that forgot to map shortlist indices back to token ids would draft other tokens)."""
    t = ModelConfig.from_pretrained(target_path)
    model = DFlashDrafter.load(random_drafter(target_path, **overrides), t.vocab_size, t.hidden_size,
                               t.num_hidden_layers)
    g = torch.Generator().manual_seed(1)
    model.set_draft_vocab(torch.randperm(t.vocab_size, generator=g)[:size])
    path = tempfile.mkdtemp(prefix="namazu-dflash-shortlist-")
    model.save(path)
    return path
