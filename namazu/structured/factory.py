"""Which grammar a request gets, from its sampling settings."""
from __future__ import annotations

from namazu.sampling_params import SamplingParams
from namazu.structured.grammar import AllOf, Grammar, MinTokensGrammar, TokenSetGrammar


def grammar_for(params: SamplingParams, end_ids: list[int], vocab_size: int) -> Grammar | None:
    """A fresh grammar for one sequence, or None when its sampling is unconstrained. `end_ids` are the
    model's end tokens (banned under min_tokens unless ignore_eos)."""
    parts: list[Grammar] = []
    if params.grammar_factory is not None:
        parts.append(params.grammar_factory())
    if params.allowed_token_ids is not None:
        parts.append(TokenSetGrammar(params.allowed_token_ids, vocab_size))
    if params.min_tokens > 0:
        banned = list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(end_ids))
        if banned:
            parts.append(MinTokensGrammar(params.min_tokens, banned, vocab_size))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(parts)
