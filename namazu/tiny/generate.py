"""A minimal sampler over the model and its contiguous latent cache, for evaluation and the model card.

The engine serves the model; this exists so the model can be judged (tool-call prompts, greedy samples)
without it. One sequence at a time: prefill the prompt once, then one token per forward through
`ContiguousLatentCache` (the absorbed-MLA decode path the engine also runs).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from namazu.models.kv_cache import ContiguousLatentCache, forward_with_cache


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             stop_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> list[int]:
    """Returns the new token ids (a stop token, when hit, is included as the last id).

    temperature 0 is greedy; otherwise softmax(logits / temperature) sampling with `generator`.
    """
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    cache = ContiguousLatentCache(model.config, 1, len(prompt_ids) + max_new_tokens, model.dtype, model.device)
    logits = forward_with_cache(model, torch.tensor([list(prompt_ids)], device=model.device), cache)[0, -1]
    stops = set(stop_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        if nxt in stops or len(out) == max_new_tokens:
            break
        logits = forward_with_cache(model, torch.tensor([[nxt]], device=model.device), cache)[0, -1]
    return out
