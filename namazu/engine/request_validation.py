"""Admission checks for one request, run before it reaches the step loop.

Everything the engine can refuse about a request is refused here, with a message that names the field
and the limit: an empty or over-long prompt, token ids outside the vocabulary, sampling settings the
model cannot honour. Nothing here changes engine state, so the server can call it before it sends any
response byte.
"""
from __future__ import annotations

from dataclasses import dataclass

from namazu.sampling_params import SamplingParams
from namazu.tokenizer import Tokenizer


@dataclass
class RequestValidator:
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_logprobs: int

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model serves at most "
                             f"{self.max_model_len} tokens (prompt + output), so at most "
                             f"{self.max_model_len - 1} prompt tokens")
        return ids

    def params(self, params: SamplingParams) -> None:
        params.check_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.max_logprobs:
                raise ValueError(f"{name}={v} exceeds --max-logprobs={self.max_logprobs}")

    def __call__(self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None) -> list[int]:
        """Returns the request's prompt token ids, or raises ValueError saying what is wrong."""
        ids = self.prompt_ids(prompt, prompt_token_ids)
        self.params(params)
        return ids
