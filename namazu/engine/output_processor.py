"""Folding a step's sampled tokens into sequences and requests: stop conditions, logprobs, outputs.

A verify step may bring several tokens for one sequence; they are appended one at a time and the
first that ends the sequence (end token, stop token, stop string, max_tokens, max_model_len) stops
the rest. Stops count only past `min_tokens`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from namazu.outputs import CompletionOutput, RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.scheduler.sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    stream: bool = True              # an output every step, or only the final one
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, stop_ids: list[int], max_model_len: int):
        self.stop_ids = set(stop_ids)
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None = None,
               top_ids: list[list[int]] | None = None, top_logprobs: list[list[float]] | None = None) -> str | None:
        """Appends new tokens, stopping at the first that ends the sequence; returns the finish
        reason, if any."""
        params = seq.params
        for j, token in enumerate(tokens):
            seq.append_tokens([token])
            self.num_generated_tokens += 1
            if params.logprobs is not None:
                lp = {token: logprobs[j]}
                if params.logprobs > 0:
                    lp.update(zip(top_ids[j][:params.logprobs], top_logprobs[j][:params.logprobs]))
                    lp[token] = logprobs[j]
                seq.logprobs.append(lp)
                seq.cumulative_logprob += logprobs[j]
            reason = self.stop_reason(seq, token)
            if reason is not None:
                return reason
        return None

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        # The token just appended is output number n_out; stops count only past min_tokens.
        can_stop = n_out > params.min_tokens
        if can_stop and not params.ignore_eos and token in self.stop_ids:
            return "stop"
        if can_stop and params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        hit = seq.detok.append(token, check_stop=can_stop)
        if hit is not None:
            seq.stop_reason = hit
            return "stop"
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if n_out >= max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def add_prompt_logprob(seq: Sequence, pos: int, logprob: float, top_ids: list[int] | None,
                           top_logprobs: list[float] | None) -> None:
        """Records the logprob of prompt token `pos` (and the top N there)."""
        target = seq.token_ids[pos]
        lp = {target: logprob}
        if top_ids is not None:
            n = seq.params.prompt_logprobs
            lp = dict(zip(top_ids[:n], top_logprobs[:n]))
            lp[target] = logprob
        if seq.is_finished or len(seq.prompt_logprobs) != pos:
            return    # aborted, or a recompute after preemption scored this position again
        seq.prompt_logprobs.append(lp)

    @staticmethod
    def make_output(req: RequestState) -> RequestOutput:
        outs = []
        want_lp = req.params.logprobs is not None
        for seq in req.seqs:
            outs.append(CompletionOutput(
                index=seq.index, text=seq.detok.stream_text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                logprobs=list(seq.logprobs) if want_lp else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        first = req.seqs[0]
        plp = list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["time_to_first_token"] = req.first_token_time - req.arrival_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             prompt_logprobs=plp, num_cached_tokens=first.num_cached_prompt_tokens, metrics=metrics)
