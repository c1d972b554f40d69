"""The response side of vLLM's extra fields, shared by both generation endpoints: prompt truncation,
bad words as token ids, token texts as `token_id:N`, vLLM's `prompt_logprobs` entries, and usage on every
streamed chunk."""
from __future__ import annotations

from typing import Any

from server.common import TokenText, top_n
from server.errors import invalid
from server.vllm_fields import Extras, bad_words_ids


class TokenIdText(TokenText):
    """`return_tokens_as_token_ids`: each token's text in logprobs is "token_id:N", so that a token that
    is not valid UTF-8 on its own is still identifiable (vLLM's format); the bytes stay the real ones."""

    def get(self, token_id: int) -> tuple[str, bytes]:
        return f"token_id:{token_id}", super().get(token_id)[1]


def token_text(tokenizer: Any, extras: Extras | None) -> TokenText:
    return TokenIdText(tokenizer) if extras is not None and extras.return_tokens_as_token_ids else TokenText(tokenizer)


def truncate_prompt(ids: list[int], extras: Extras | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep the last k tokens (-1: the model's context length)."""
    k = extras.truncate_prompt_tokens if extras is not None else None
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise invalid(f"'truncate_prompt_tokens' = {k} exceeds the model's context length {max_model_len}",
                      "truncate_prompt_tokens")
    return ids[-k:]


def apply_prompt_side(kwargs: dict[str, Any], extras: Extras | None, tokenizer: Any) -> None:
    """SamplingParams keywords that need the tokenizer: bad words as token-id sequences."""
    if extras is not None and extras.bad_words:
        kwargs["bad_words_ids"] = bad_words_ids(extras.bad_words, tokenizer)


def vllm_prompt_logprobs(ids: list[int], entries: list[dict[int, float] | None] | None, k: int,
                         tt: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself and the k most likely. `rank` (1 = most likely) is known for the
    top k; the prompt's own token outside them has rank null (namazu does not rank the whole vocabulary)."""
    out: list[dict[str, Any] | None] = []
    entries = entries or [None] * len(ids)
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        top = top_n(e, k)
        ranks = {tid: r + 1 for r, (tid, _) in enumerate(top)}
        d: dict[str, Any] = {}
        for tid, lp in [(t, e.get(t)), *top]:
            if str(tid) not in d and lp is not None:
                d[str(tid)] = {"logprob": lp, "rank": ranks.get(tid), "decoded_token": tt.text(tid)}
        out.append(d)
    return out
