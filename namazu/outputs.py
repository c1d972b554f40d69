"""Results handed to library users and the server (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sequence of a request. While the request runs, `text` omits a tail that might be the start
    of a stop string; `token_ids` is everything generated so far."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None   # per generated token: token id -> logprob
    finish_reason: str | None = None                 # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None             # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0                       # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
